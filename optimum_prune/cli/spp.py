"""`optimum-prune search`: Solution Path Pruning's search, written as a `SolutionPath` directory that
`optimum-prune prune --method spp --solution-path DIR --ratio R` cuts at any ratio without searching again."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..auto import AutoPruner
from ..config import CalibrationConfig, PruningConfig
from ..methods.spp import SPPConfig
from ..utils.scratch import check_output_dir
from .common import UserError, _overrides, _write_json
from .inputs import _load, _texts

__all__ = ["cmd_search"]


def cmd_search(args: argparse.Namespace) -> int:
    if args.config and not Path(args.config).is_file():
        raise UserError(f"--config {args.config!r} is not a file.")
    data = PruningConfig.from_json_file(args.config) if args.config else SPPConfig()
    if not isinstance(data, SPPConfig):
        raise UserError(f"`search` runs SPP's search; {args.config} is not an SPPConfig.")
    data = data.to_dict()
    if data.get("method") != "spp":
        raise UserError(f"`search` runs SPP's search; the config is for method {data.get('method')!r}.")
    flags = _overrides(args.set)
    for key in ("steps", "lr"):
        if getattr(args, key) is not None:
            flags[key] = getattr(args, key)
    config = PruningConfig.from_dict({**data, **flags, "solution_path": None})
    out = Path(args.output)
    check_output_dir(out, args.overwrite, replace_hint="pass --overwrite to replace it")
    dataset = _texts(args.calib, args.holdout_fraction, args.split_seed, part=0)
    calibration = CalibrationConfig(
        dataset=dataset, num_samples=args.num_samples, seq_len=args.seq_len, seed=args.seed, batch_size=1
    )
    model, tokenizer = _load(args.model, args.gguf_file, args.dtype)
    path = AutoPruner(model, tokenizer).search_solution_path(config, calibration)
    saved = path.save_pretrained(out, overwrite=args.overwrite)
    _write_json({**path.summary(), "output": str(saved)}, None)
    return 0
