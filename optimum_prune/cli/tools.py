"""`optimum-prune eval`, `bench`, `export-gguf` and `demo`: the commands around a pruned checkpoint."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from ..evaluation import benchmark_speed, compare_speed, format_speed, perplexity
from ..evaluation.zero_shot import resolve_tasks
from ..export import export_gguf
from .common import UserError, _check_parent, _write_json
from .demo import format_demo_table, run_demo
from .inputs import _load, _texts, require_causal_lm
from .recovery import run_zero_shot

__all__ = ["cmd_bench", "cmd_demo", "cmd_eval", "cmd_export_gguf"]


def cmd_eval(args: argparse.Namespace) -> int:
    _check_parent(args.output)
    if args.data is None and not args.tasks:
        raise UserError("Give --data (perplexity) and/or --tasks (zero-shot accuracy).")
    if args.limit is not None:
        args.limit = int(args.limit) if args.limit >= 1 else args.limit
    if args.tasks:
        resolve_tasks(args.tasks, args.allow_hub)  # a missing / Hub-only task fails before the model is loaded
    texts = _texts(args.data, args.holdout_fraction, args.split_seed, part=1) if args.data else None
    model, tokenizer = _load(args.model, args.gguf_file, args.dtype)
    require_causal_lm(model, "`optimum-prune eval` (perplexity, lm-eval tasks)")
    if tokenizer is None:
        raise UserError(f"{args.model} has no tokenizer; evaluation needs one.")
    result: dict[str, Any] = {"model": args.model}
    if texts is not None:
        ppl = perplexity(
            model, tokenizer, texts, seq_len=args.seq_len, max_tokens=args.max_tokens, batch_size=args.batch_size
        )
        result.update(data=args.data, holdout_fraction=args.holdout_fraction, seq_len=args.seq_len)
        result.update(max_tokens=args.max_tokens, perplexity=ppl)
    if args.tasks:
        result["zero_shot"] = run_zero_shot(args, model, tokenizer)
    _write_json(result, args.output)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    kw = {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "batch_size": args.batch_size}
    kw.update(warmup=args.warmup, repeats=args.repeats)
    _check_parent(args.output)
    if len(set(args.models)) != len(args.models):
        raise UserError("The same model is listed twice.")
    loaded = {m: _load(m, None, args.dtype) for m in args.models}
    tokenizer = next((t for _, t in loaded.values() if t is not None), None)
    if len(loaded) == 1:
        result = {"model": args.models[0], **benchmark_speed(loaded[args.models[0]][0], tokenizer, **kw)}
    else:
        result = compare_speed({name: m for name, (m, _) in loaded.items()}, tokenizer, **kw)
        print(format_speed(result), file=sys.stderr)  # the table to read; the JSON (stdout or --output) to keep
    _write_json(result, args.output)
    return 0


def cmd_export_gguf(args: argparse.Namespace) -> int:
    model = Path(args.model)
    if not (model / "config.json").is_file():
        raise UserError(
            f"--model {args.model!r} is not a model directory (no config.json); pass a save_pretrained output."
        )
    out = Path(args.output)
    if out.exists() and not args.overwrite:
        raise FileExistsError(f"{out} already exists; choose another --output or pass --overwrite.")
    path = export_gguf(model, out, args.outtype, overwrite=args.overwrite)
    _write_json({"output": str(path), "outtype": args.outtype, "bytes": path.stat().st_size}, None)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    result = run_demo(
        output_dir=args.output_dir,
        results_dir=args.results_dir,
        ratio=args.ratio,
        num_samples=args.num_samples,
        seq_len=args.seq_len,
        eval_seq_len=args.eval_seq_len,
        eval_tokens=args.eval_tokens,
        bench_repeats=args.repeats,
        progress=lambda line: print(f"* {line}", file=sys.stderr, flush=True),
    )
    print(format_demo_table(result))
    return 0
