"""2:4 semi-structured sparse kernels vs dense fp16 on a GPU: prefill latency of the same model, interleaved.

Needs an NVIDIA GPU with compute capability >= 8.0; elsewhere it stops with the reason (nothing is written).

    python benchmarks/semi_structured.py [--model DIR] [--batch 8 --seq 512] [--repeats 20]
    python benchmarks/semi_structured.py --shape smollm2-135m llama-3.2-1b llama-3.1-8b   # random weights

Latency does not depend on the weights' values, so `--shape` builds models of known shapes with random weights
(no download, nothing to carry to a GPU machine but this repository); the rows say which shape they timed.

Writes benchmarks/results/semi_structured_<gpu>.json and .md.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import harness
import torch
from harness import RESULTS_DIR
from transformers import LlamaConfig, LlamaForCausalLM

from optimum_prune import MagnitudeConfig, prune_, to_semi_structured_
from optimum_prune.modeling.semi_structured import check_semi_structured_support

REQUIRES = "cuda"  # `make bench` skips this script, with a message, where torch sees no CUDA device


def _time_prefill(model, ids, warmup: int, repeats: int) -> list[float]:
    out = []
    with torch.no_grad():
        for i in range(warmup + repeats):
            torch.cuda.synchronize()
            t = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            torch.cuda.synchronize()
            if i >= warmup:
                out.append((time.perf_counter() - t) * 1e3)
    return out


def markdown(result: dict) -> str:
    lines = [
        f"# 2:4 semi-structured vs dense fp16 prefill ({result['gpu']}, torch {result['torch']})",
        "",
        "Prefill latency of the same model (random-order interleaved rounds); speedup = dense / 2:4 from the medians, "
        "with the interquartile range of the per-round ratios (a tie when it contains 1).",
        "",
        "| model | batch | seq | dense (ms) | 2:4 (ms) | speedup |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r.get('model', result['model'])} | {r['batch']} | {r['seq']} | {r['dense_ms']:.2f} | {r['sparse_ms']:.2f} | {r['speedup']:.2f}x"
        f"{harness.spread_note(r, 'speedup')} |"
        for r in result["rows"]
    ]
    return "\n".join(lines) + "\n"


# Llama-architecture shapes (hidden, MLP, layers, query heads, KV heads, vocabulary) timed with random weights.
SHAPES = {
    "smollm2-135m": (576, 1536, 30, 9, 3, 49152),
    "llama-3.2-1b": (2048, 8192, 16, 32, 8, 128256),
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, 128256),
}


def _random_model(shape: str) -> torch.nn.Module:
    hidden, mlp, layers, heads, kv, vocab = SHAPES[shape]
    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, vocab_size=vocab,
    )  # fmt: skip
    with torch.device("cuda"):
        return LlamaForCausalLM._from_config(config, torch_dtype=torch.float16).eval()


def _time_model(dense, args) -> tuple[list[dict], int]:
    sparse = copy.deepcopy(dense)
    prune_(sparse, MagnitudeConfig(pattern="2:4", sparsity=0.5))  # latency does not depend on the values
    converted = to_semi_structured_(sparse)
    rows = []
    for bs in args.batch:
        ids = torch.randint(0, dense.config.vocab_size, (bs, args.seq), device="cuda")
        times = {"dense": [], "2:4": []}
        for r in range(args.repeats):  # interleave, alternating the order
            order = [("dense", dense), ("2:4", sparse)][:: 1 if r % 2 == 0 else -1]
            for name, m in order:
                times[name] += _time_prefill(m, ids, args.warmup if r == 0 else 0, 1)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append(
            {
                "batch": bs,
                "seq": args.seq,
                "dense_ms": med["dense"],
                "sparse_ms": med["2:4"],
                "speedup": med["dense"] / med["2:4"],
                "dense_ms_rounds": times["dense"],
                "sparse_ms_rounds": times["2:4"],
                **harness.round_ratios(times["dense"], times["2:4"], "speedup"),
            }
        )
    del sparse
    torch.cuda.empty_cache()
    return rows, len(converted)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    harness.add_model_args(p)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--seq", type=int, default=512)
    p.add_argument(
        "--shape", nargs="*", choices=sorted(SHAPES), default=None,
        help="time Llama models of these shapes with random weights instead of --model",
    )  # fmt: skip
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--output", type=Path, default=None, help="results JSON (default: results/semi_structured_<gpu>)")
    args = p.parse_args(argv)
    try:
        check_semi_structured_support()
    except RuntimeError as e:
        print(f"semi-structured benchmark skipped: {e}", file=sys.stderr)
        return 1
    rows, converted = [], {}
    with harness.timing_lock():
        if args.shape:
            for shape in args.shape:
                dense = _random_model(shape)
                shape_rows, converted[shape] = _time_model(dense, args)
                rows += [{"model": shape, **r} for r in shape_rows]
                del dense
                torch.cuda.empty_cache()
            model_desc = "random weights of the shapes " + ", ".join(args.shape)
        else:
            model, _, model_desc = harness.load_model(args)
            shape_rows, converted[model_desc] = _time_model(model.half().cuda().eval(), args)
            rows += [{"model": model_desc, **r} for r in shape_rows]
    gpu = torch.cuda.get_device_name().replace(" ", "_")
    result = {
        **harness.environment(argv, "semi_structured.py"),
        "model": model_desc,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "converted_projections": converted,
        "rows": rows,
    }
    out = harness.write_results(result, args.output or RESULTS_DIR / f"semi_structured_{gpu}.json", "semi_structured")
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
