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
from .common import UserError, _check_parent, _load, _texts, _write_json, require_causal_lm
from .demo import format_demo_table, run_demo
from .recovery import add_eval_task_arguments, run_zero_shot

__all__ = ["add_tool_commands"]


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


def add_tool_commands(sub: Any, model_args, split_args) -> None:
    """Add `eval`, `bench`, `export-gguf` and `demo` to the `optimum-prune` subparsers."""

    p = sub.add_parser("eval", help="perplexity on a text source", description="Perplexity (non-overlapping windows).")
    model_args(p)
    p.add_argument("--data", help="perplexity text: file, directory of .txt, wikitext2|c4|ptb, or 'bbc'")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, help="score only the first N tokens")
    p.add_argument("--batch-size", type=int, default=1)
    split_args(p, "evaluate on the held-out part")
    add_eval_task_arguments(p)
    p.add_argument("--output", "-o", help="write the JSON result here (default: stdout)")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser(
        "bench",
        help="prefill latency / decode tokens/s",
        description="Speed of one or more models (several: interleaved, ratios against the first).",
    )
    p.add_argument("models", nargs="+", help="model directories or .gguf files; the first is the reference")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "auto"])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, help="torch.set_num_threads")
    p.add_argument("--output", "-o", help="write the JSON result here (default: stdout)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser(
        "export-gguf",
        help="write a saved model as a GGUF file for llama.cpp / Ollama",
        description="Export a save_pretrained directory (pruned or dense) to GGUF; per-layer shapes go in as llama.cpp's "
        "deci architecture.",
    )
    p.add_argument("--model", required=True, help="directory written by save_pretrained / optimum-prune prune")
    p.add_argument("--output", "-o", required=True, help="the .gguf file to write (parent directories are created)")
    p.add_argument("--outtype", choices=["f32", "f16", "bf16", "q8_0"], default="f16", help="weight type (f16)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing file")
    p.set_defaults(func=cmd_export_gguf)

    what = "SmolLM2-135M + BBC news end to end (minutes on a CPU)"
    p = sub.add_parser(
        "demo",
        help=what,
        description=f"Prune {what}; `make demo` runs it. Every figure and the wall time of each step go to "
        "RESULTS_DIR/demo_smollm2.json and its markdown rendering RESULTS_DIR/demo_smollm2.md; the committed run is "
        "benchmarks/results/demo_smollm2.{json,md}.",
    )
    p.add_argument("--output-dir", default="demo_output", help="the pruned checkpoint (default: demo_output)")
    p.add_argument(
        "--results-dir",
        default="demo_results",
        help="where demo_smollm2.json and demo_smollm2.md are written, replacing an earlier run's (default: "
        "demo_results, in the current directory)",
    )
    p.add_argument("--ratio", type=float, default=0.2)
    p.add_argument("--num-samples", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256, help="calibration sequence length")
    p.add_argument("--eval-seq-len", type=int, default=512)
    p.add_argument("--eval-tokens", type=int, default=8192, help="held-out tokens scored")
    p.add_argument("--repeats", type=int, default=5, help="speed rounds")
    p.set_defaults(func=cmd_demo)
