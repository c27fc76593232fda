"""`optimum-prune search`: Solution Path Pruning's search, written as a `SolutionPath` directory that
`optimum-prune prune --method spp --solution-path DIR --ratio R` cuts at any ratio without searching again."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..auto import AutoPruner
from ..config import CalibrationConfig, PruningConfig
from ..methods.spp import SPPConfig
from ..utils.scratch import check_output_dir
from .common import UserError, _load, _overrides, _texts, _write_json

__all__ = ["add_spp_commands"]


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


def add_spp_commands(sub: Any, model_args, split_args) -> None:
    p = sub.add_parser(
        "search",
        help="SPP: one search, a whole family of pruned models",
        description="Run Solution Path Pruning's search and save the path; then `prune --method spp --solution-path "
        "DIR --ratio R` extracts any ratio in seconds, without calibration.",
    )
    model_args(p)
    p.add_argument("--calib", required=True, help="calibration text: file, directory of .txt, wikitext2|c4|ptb, 'bbc'")
    p.add_argument("--num-samples", type=int, default=64, help="calibration sequences")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    p.add_argument("--seed", type=int, default=0, help="calibration sampling seed")
    p.add_argument("--steps", type=int, help="search steps (SPPConfig.steps)")
    p.add_argument("--lr", type=float, help="search step size (SPPConfig.lr)")
    p.add_argument("--config", help="an SPPConfig JSON file (its search fields are used)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any other SPPConfig field")
    split_args(p, "calibrate on the rest")
    p.add_argument("--output", "-o", required=True, help="directory for the solution path")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.set_defaults(func=cmd_search)
