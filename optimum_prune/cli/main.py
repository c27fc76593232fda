"""The `optimum-prune` parser, its `prune` command and the entry point `main` (the other commands: `spp.py`,
`tools.py`, `recovery.py`).

User errors (bad arguments, missing files, unsupported models, an existing output directory...) print one line on
stderr and exit with status 2; `--verbose` adds INFO logging and the traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import traceback
from pathlib import Path

from ..auto import AutoPruner
from ..config import CalibrationConfig, PruningConfig
from ..methods.registry import get_config_class, get_pruner_class
from ..utils.distributed import init_from_env, initialized, is_main_process, shutdown
from ..utils.scratch import check_output_dir
from .common import (
    _USER_ERRORS,
    UserError,
    _check_parent,
    _load,
    _model_args,
    _model_location,
    _overrides,
    _split_args,
    _texts,
    _write_json,
)
from .recovery import add_recovery_commands
from .spp import add_spp_commands
from .tools import add_tool_commands

__all__ = ["main", "build_parser", "add_prune_arguments", "run_command"]

PROG = "optimum-prune"


def _build_config(args: argparse.Namespace):
    if args.config:
        if not Path(args.config).is_file():
            raise UserError(f"--config {args.config!r} is not a file.")
        loaded = PruningConfig.from_json_file(args.config)
        if isinstance(loaded, list):  # a recipe: the file says everything
            used = [f"--{k.replace('_', '-')}" for k in ("ratio", "allocation", "gqa_mode", "round_to", "pattern")
                    if getattr(args, k) is not None] + (["--set"] if args.set else [])  # fmt: skip
            if used:
                raise UserError(f"{', '.join(used)} cannot change a recipe (a list of configs); edit {args.config}.")
            return loaded
        data = loaded.to_dict()
    else:
        data = {"method": args.method}
    names = {f.name for f in dataclasses.fields(get_config_class(data["method"]))}
    flags = _overrides(args.set)
    for key in ("allocation", "gqa_mode", "round_to", "pattern"):
        if getattr(args, key) is not None:
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


# ------------------------------------------------------------------------------------------------------ commands
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
    drop = ("layers", "sparsity", "info", "calibration", "sections")
    summary = {k: v for k, v in report.to_dict().items() if k not in drop}
    if report.sections:  # a recipe: one line per config
        keys = ("method", "target", "measured", "seconds")
        summary["sections"] = [{k: s[k] for k in keys if k in s} for s in report.sections]
    _write_json({**summary, "output": str(saved), "report": args.report}, None)
    return 0


# -------------------------------------------------------------------------------------------------------- parser
def add_prune_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of `prune` (shared by `optimum-prune prune` and `optimum-cli prune`)."""
    _model_args(p)
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--method", help="registered method, e.g. numerical, flap, magnitude, wanda, amp, experts (MoE)")
    how.add_argument(
        "--config",
        help="a PruningConfig JSON file (method included; flags below override it), or a recipe: a JSON list of "
        "configs run together (e.g. AMP on q/k + Wanda on the rest), or a saved model's pruning_config.json",
    )
    p.add_argument("--ratio", type=float, help="pruning_ratio (structured), sparsity (unstructured / N:M pattern) or "
                   "expert_ratio (experts)")  # fmt: skip
    p.add_argument("--allocation", choices=["auto", "global", "servable", "uniform", "owl"])
    p.add_argument("--gqa-mode", dest="gqa_mode", choices=["auto", "group", "query"])
    p.add_argument("--round-to", dest="round_to", type=int)
    p.add_argument("--pattern", help="unstructured / N:M methods: 'unstructured' or e.g. '2:4'")
    p.add_argument("--solution-path", help="spp: extract from a path saved by `search` (no calibration needed)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="any other config field (JSON value)"
    )
    p.add_argument("--calib", help="calibration text: file, directory of .txt, wikitext2|c4|ptb, or 'bbc'")
    p.add_argument("--num-samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0, help="calibration sampling seed")
    p.add_argument("--batch-size", type=int, default=8, help="calibration sequences per block forward")
    _split_args(p, "calibrate on the rest")
    p.add_argument("--output", "-o", required=True, help="output directory")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument(
        "--format",
        choices=["auto", "deci"],
        default="auto",
        help="auto: stock config if every layer is alike, else the DeciLM format (vLLM, SGLang, TensorRT-LLM, MLX, "
        "llama.cpp) where it holds the shapes, else optimum-prune's own; deci: the DeciLM format or an error",
    )
    p.add_argument("--report", help="write the full PruningReport JSON here")
    scale = p.add_argument_group(
        "large models (also under `torchrun` / `accelerate launch`: data-parallel calibration)"
    )
    scale.add_argument(
        "--low-memory",
        action="store_true",
        help="keep the decoder blocks on disk (safetensors, memory-mapped) and prune one at a time; the output is "
        "written shard by shard",
    )
    scale.add_argument(
        "--checkpoint-dir", help="record finished blocks here; rerun the same command after a crash to resume"
    )
    scale.add_argument("--offload-dir", help="--low-memory: where pruned blocks wait for the save (default: temp dir)")
    scale.add_argument("--device", help="where each block runs, e.g. cuda (default: where the model is)")
    scale.add_argument(
        "--activation-memory", help="memory for calibration activations between blocks, e.g. 4GB (beyond: disk)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Prune Hugging Face causal LMs into smaller checkpoints.")
    parser.add_argument("-v", "--verbose", action="store_true", help="INFO logging and tracebacks on errors")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{prune,search,eval,bench,export-gguf,demo,finetune,push}"
    )

    p = sub.add_parser("prune", help="prune a model and save it", description="Prune a model and save the result.")
    add_prune_arguments(p)
    p.set_defaults(func=cmd_prune)

    add_tool_commands(sub, _model_args, _split_args)
    add_recovery_commands(sub, _model_args, _split_args)
    add_spp_commands(sub, _model_args, _split_args)
    return parser


def run_command(command: str, args: argparse.Namespace, prog: str = PROG) -> int:
    """Run one command with the CLI's logging and error handling (also used by `optimum-cli prune`)."""
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    func = {"prune": cmd_prune}.get(command) or args.func
    try:
        return func(args)
    except _USER_ERRORS as e:
        if args.verbose:
            traceback.print_exc()
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"{prog} {command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    joined = not initialized()  # a process group the command joins (torchrun, accelerate launch) is left at the end
    try:
        return run_command(args.command, args)
    finally:
        if joined:
            shutdown()
