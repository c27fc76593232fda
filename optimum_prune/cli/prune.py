"""`optimum-prune prune` (and `optimum-cli prune`): build the config from the flags, load, prune, save."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from ..auto import AutoPruner
from ..config import CalibrationConfig, PruningConfig
from ..methods.registry import get_config_class, get_pruner_class
from ..utils.distributed import init_from_env, is_main_process
from ..utils.scratch import check_output_dir
from .common import UserError, _check_parent, _model_location, _overrides, _rounded, _write_json
from .inputs import _load, _texts

__all__ = ["cmd_prune"]


# flags that set the config field of their name
_FLAGS = ("allocation", "gqa_mode", "round_to", "pattern", "workload", "speedup", "memory_gb", "cost_table")


def _build_config(args: argparse.Namespace):
    if args.config:
        if not Path(args.config).is_file():
            raise UserError(f"--config {args.config!r} is not a file.")
        loaded = PruningConfig.from_json_file(args.config)
        if isinstance(loaded, list):  # a recipe: the file says everything
            used = [f"--{k.replace('_', '-')}" for k in ("ratio", *_FLAGS) if getattr(args, k, None) is not None]
            used += ["--set"] if args.set else []
            if used:
                raise UserError(f"{', '.join(used)} cannot change a recipe (a list of configs); edit {args.config}.")
            return loaded
        data = loaded.to_dict()
    else:
        data = {"method": args.method}
    names = {f.name for f in dataclasses.fields(get_config_class(data["method"]))}
    flags = _overrides(args.set)
    for key in _FLAGS:
        if getattr(args, key, None) is not None:
            flags[key] = getattr(args, key)
    if getattr(args, "solution_path", None) is not None:
        flags["solution_path"] = args.solution_path
    if args.ratio is not None:  # structured pruning uses `pruning_ratio`, unstructured / N:M `sparsity`
        structured = flags.get("pattern", data.get("pattern", "structured")) == "structured"
        order = ("pruning_ratio", "sparsity") if structured else ("sparsity", "pruning_ratio")
        order += ("expert_ratio",)  # experts: the fraction of each MoE layer's experts removed
        key = next((k for k in order if k in names), None)
        if key is None:
            raise UserError(f"Method {data['method']!r} has no ratio option; use --set KEY=VALUE.")
        flags[key] = args.ratio
    unknown = sorted(set(flags) - names)
    if unknown:
        raise UserError(f"Method {data['method']!r} has no option(s) {unknown}; valid: {sorted(names)}.")
    return PruningConfig.from_dict({**data, **flags})


def cmd_prune(args: argparse.Namespace) -> int:
    config = _build_config(args)  # every argument is checked before the model is loaded
    out = Path(args.output)
    check_output_dir(out, args.overwrite, replace_hint="pass --overwrite to replace it")
    _check_parent(args.report)
    calibration = None
    configs = config if isinstance(config, list) else [config]
    needing = [c.method for c in configs if get_pruner_class(c.method)(c).requires_calibration]
    if needing:
        if args.calib is None:
            raise UserError(f"Method {needing[0]!r} needs calibration text: pass --calib PATH|DIR|NAME (or 'bbc').")
        dataset = _texts(args.calib, args.holdout_fraction, args.split_seed, part=0)
        calibration = CalibrationConfig(
            dataset=dataset,
            num_samples=args.num_samples,
            seq_len=args.seq_len,
            seed=args.seed,
            batch_size=args.batch_size,
        )
    distributed = init_from_env()
    if args.low_memory:
        location, gguf = _model_location(args.model, args.gguf_file)
        pruner = AutoPruner.from_pretrained(location, gguf_file=gguf, torch_dtype=args.dtype, low_memory=True,
                                            offload_dir=args.offload_dir)  # fmt: skip
    else:
        model, tokenizer = _load(args.model, args.gguf_file, args.dtype)
        pruner = AutoPruner(model, tokenizer)
    run = {k: getattr(args, k) for k in ("checkpoint_dir", "device", "activation_memory") if getattr(args, k)}
    report = pruner.prune(config, calibration=calibration, **run)
    saved = pruner.save_pretrained(out, overwrite=args.overwrite, format=args.format)
    if distributed and not is_main_process():
        return 0  # rank 0 writes the report and prints the summary
    if args.report:
        report.to_json_file(args.report)
    print(f"{report}; saved to {saved}", file=sys.stderr)  # the line to read; the JSON (stdout) to keep
    drop = ("config", "layers", "sparsity", "info", "calibration", "sections")  # in the saved pruning_config.json
    summary = {k: v for k, v in report.to_dict().items() if k not in drop}
    if report.sections:  # a recipe: one line per config
        keys = ("method", "target", "measured", "seconds")
        summary["sections"] = [{k: s[k] for k in keys if k in s} for s in report.sections]
    _write_json(_rounded({**summary, "output": str(saved), "report": args.report}, 6), None)
    return 0
