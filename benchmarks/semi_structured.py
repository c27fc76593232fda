"""2:4 semi-structured sparsity on a GPU: where the time of PyTorch's 2:4 path goes, and whole-model prefill.

1. **One projection** (`_semi_structured_layers`): q_proj, gate_proj and down_proj of each shape, fp16 and bf16,
   1 to 4096 input rows, through cuBLAS (dense), PyTorch's semi-structured tensors (cuSPARSELt, CUTLASS), the bare
   cuSPARSELt op with its default and with its searched algorithm; each per call eagerly and replayed from a CUDA
   graph, and the kernels of gate_proj profiled (device time of each kernel per call, host time per call).
2. **Whole models**: random-weight models of the shapes, dense against 2:4 through `to_semi_structured_` (each
   backend), prefill of 512 and 2048 tokens as CUDA graphs and eagerly, interleaved rounds. Ideal speedup: the
   dense FLOPs over the FLOPs left when the projections run at the sparse tensor cores' doubled rate.

Needs an NVIDIA GPU with compute capability >= 8.0; elsewhere it stops with the reason (nothing is written).
Latency does not depend on the weights' values, so nothing travels to the GPU machine but this repository.

    python benchmarks/semi_structured.py                             # 1B and 8B shapes (~3 min on an H100 / H200)
    python benchmarks/semi_structured.py --shape llama-3.2-1b --parts layers --tokens 512

Writes benchmarks/results/semi_structured_profile_<gpu>.json and .md (`semi_structured_H200.json`: the first
version, eager whole-model prefill only).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import harness
import torch
from _gpu_shapes import SHAPES, build_model, dense_layers, prefill_flop_parts
from _gpu_timing import Scenario, free_memory, gpu_tag, run_scenario, speedup_cell
from harness import RESULTS_DIR

from optimum_prune import to_semi_structured_
from optimum_prune.functional.masks import nm_keep_mask
from optimum_prune.modeling.architectures import get_layers, get_spec
from optimum_prune.modeling.semi_structured import check_semi_structured_support

REQUIRES = "cuda"  # `make bench` skips this script, with a message, where torch sees no CUDA device
BACKENDS = {"cusparselt": "2:4 cuSPARSELt", "cutlass": "2:4 CUTLASS"}
LAYERS_SHARE = 0.4  # of the time budget, for the one-projection timings


def _build(shape: str, dtype: torch.dtype) -> torch.nn.Module:
    return build_model(SHAPES[shape], None, dtype, "cuda")


def _mask_24_(model) -> None:
    """Zero 2 of every 4 weights of each projection (the smaller ones), as 2:4 pruning leaves them: latency does
    not depend on which, so the library's pruning pass is not needed here."""
    spec = get_spec(model)
    with torch.no_grad():
        for layer in get_layers(model, spec):
            for path in spec.linear_paths:
                w = layer.get_submodule(path).weight
                w.mul_(nm_keep_mask(w.abs(), 2, 4).to(w.dtype))


def _logits(model, ids) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=True, logits_to_keep=1).logits.float()


def time_models(shape: str, args, deadline: float) -> dict:
    """Dense against every 2:4 backend on the prefill workloads; each converted model's logits checked first."""
    record = {"shape": shape, "dtype": str(args.model_dtype).removeprefix("torch."), "models": {}, "scenarios": []}
    models = {"dense": _build(shape, args.model_dtype)}
    pruned = _build(shape, args.model_dtype)
    _mask_24_(pruned)
    ids = torch.randint(0, SHAPES[shape].vocab, (2, 64), device="cuda")
    reference = _logits(pruned, ids)
    for backend in args.backends:
        label = BACKENDS[backend]
        try:
            model = copy.deepcopy(pruned)
            converted = to_semi_structured_(model, dtype=args.model_dtype, backend=backend)
            diff = (_logits(model, ids) - reference).abs().max().item()
            record["models"][label] = {"converted": len(converted), "max_abs_logit_diff": diff}
            models[label] = model
        except Exception as e:  # noqa: BLE001  (a backend that fails here is reported, the others timed)
            record["models"][label] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    del pruned
    free_memory()
    s = SHAPES[shape]
    for tokens, batch in args.prefill:
        parts = prefill_flop_parts(s, dense_layers(s), batch, tokens)
        total = sum(parts.values())
        work = {label: total if label == "dense" else total - parts["projections"] // 2 for label in models}
        for mode in ("graph", "eager"):
            sc = Scenario("prefill", batch, tokens, mode)
            if time.monotonic() > deadline:
                record["scenarios"].append({"name": sc.name, "skipped": "time budget spent"})
                continue
            record["scenarios"].append(run_scenario(models, sc, "cuda", args.rounds, deadline, work))
    del models
    free_memory()
    return record


def _us(entry: dict, mode: str) -> float | None:
    return entry.get(f"{mode}_us")


def _layer_cell(row: dict, name: str) -> str:
    entry, dense = row["variants"].get(name, {}), row["variants"]["dense"]
    if "error" in entry:
        return "failed"
    cells = []
    for mode in ("graph", "eager"):
        us, ref = _us(entry, mode), _us(dense, mode)
        cells.append(f"{ref / us:.2f}x" if us and ref else "n/a")
    alg = f" (alg {entry['alg_id']})" if "searched" in name and "alg_id" in entry else ""
    return f"{cells[0]} / {cells[1]}{alg}"


def _markdown_layers(result: dict) -> list[str]:
    from _semi_structured_layers import VARIANTS

    lines = [
        "## One projection: speedup over dense, CUDA graph / eager",
        "",
        "`y = x Wᵀ` for the shape's projection and `tokens` rows of `x`; dense µs per call as a replayed CUDA graph "
        "(kernels only) and eagerly (host work included); each 2:4 cell: dense time / its time, graph / eager.",
        "",
        "| shape | projection (out x in) | tokens | dtype | dense µs (graph / eager) | "
        + " | ".join(VARIANTS[1:])
        + " |",
        "|---|---|---:|---|---:|" + "---:|" * (len(VARIANTS) - 1),
    ]
    for row in result["layers"]:
        dense = row["variants"]["dense"]
        ref = f"{_us(dense, 'graph') or float('nan'):.1f} / {_us(dense, 'eager') or float('nan'):.1f}"
        cells = " | ".join(_layer_cell(row, name) for name in VARIANTS[1:])
        lines.append(f"| {row['shape']} | {row['projection']} ({row['out']} x {row['in']}) | {row['tokens']} | "
                     f"{row['dtype']} | {ref} | {cells} |")  # fmt: skip
    if result.get("kernels"):
        lines += [
            "",
            "## Where the time goes: gate_proj under `torch.profiler` (eager)",
            "",
            "Host µs: wall time per call on the CPU; device µs: the kernels' time per call; the kernels with the "
            "most device time (µs per call, launches per call).",
            "",
            "| shape | tokens | dtype | path | host µs | device µs | kernels |",
            "|---|---:|---|---|---:|---:|---|",
        ]
        for p in result["kernels"]:
            if "error" in p:
                lines.append(f"| {p['shape']} | {p['tokens']} | {p['dtype']} | {p['variant']} | failed | | |")
                continue
            ks = "; ".join(f"`{k[:60]}` {v['us_per_call']:.1f} ({v['launches_per_call']:g})"
                           for k, v in list(p["kernels"].items())[:3])  # fmt: skip
            lines.append(f"| {p['shape']} | {p['tokens']} | {p['dtype']} | {p['variant']} | "
                         f"{p['host_us_per_call']:.1f} | {p['device_us_per_call']:.1f} | {ks} |")  # fmt: skip
    return lines


def _markdown_models(result: dict) -> list[str]:
    lines = [
        "## Whole models, prefill: speedup of 2:4 over dense",
        "",
        "Each cell: median [Q1, Q3] of the per-round speedups / the ideal (the projections at twice the dense rate) "
        "(share of the ideal). Logits: largest difference of each converted model from the same 2:4 weights dense.",
    ]
    for rec in result["models"]:
        labels = [lab for lab in rec["models"] if "error" not in rec["models"][lab]]
        lines += ["", f"### {rec['shape']}, {rec['dtype']}", ""]
        for label, m in rec["models"].items():
            lines.append(f"- {label}: " + (m["error"] if "error" in m else
                         f"{m['converted']} projections converted, logits within {m['max_abs_logit_diff']:.3g}"))  # fmt: skip
        lines += ["", "| workload | dense ms | " + " | ".join(labels) + " |", "|---|---:|" + "---:|" * len(labels)]
        for sc in rec["scenarios"]:
            if "models" not in sc:
                lines.append(f"| {sc['name']} | {sc.get('error') or sc.get('skipped')} |" + " |" * len(labels))
                continue
            cells = " | ".join(speedup_cell(sc["models"][lab]) for lab in labels if lab in sc["models"])
            lines.append(
                f"| {sc['name']} ({sc['rounds']} rounds) | {sc['models']['dense']['median_ms']:.2f} | {cells} |"
            )
    return lines


def markdown(result: dict) -> str:
    if "rows" in result:
        return _markdown_prefill_only(result)
    lines = [
        f"# 2:4 semi-structured sparsity on a GPU ({result['gpu']}, torch {result['torch']})",
        "",
        f"Generated by `benchmarks/semi_structured.py` on {result['date']}; cuSPARSELt "
        f"{result.get('cusparselt_version') or 'not built in'}. Random weights in published model shapes (latency "
        f"does not depend on the values). Time: {result['elapsed_s']:.0f} s of a {result['budget_s']:.0f} s budget"
        + (f"; not run (budget): {len(result['skipped'])} workloads" if result.get("skipped") else "")
        + ".",
        "",
    ]
    lines += [f"- Failed: {f}" for f in result.get("failed", [])] + ([""] if result.get("failed") else [])
    if result.get("layers"):
        lines += _markdown_layers(result) + [""]
    if result.get("models"):
        lines += _markdown_models(result)
    return "\n".join(lines).rstrip() + "\n"


def _markdown_prefill_only(result: dict) -> str:
    """The first version of this benchmark: eager prefill of whole models, full logits (results file kept)."""
    lines = [
        f"# 2:4 semi-structured vs dense fp16 prefill ({result['gpu']}, torch {result['torch']})",
        "",
        f"Generated by `benchmarks/semi_structured.py` on {result['date']}. Model: {result['model']}. Prefill "
        "latency of the same model (interleaved rounds, alternating order); speedup = dense / 2:4 from the medians, "
        "with the interquartile range of the per-round ratios (a tie when it contains 1); below 1, 2:4 is slower.",
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=["llama-3.1-8b", "llama-3.2-1b"])
    p.add_argument("--parts", nargs="+", choices=["layers", "models"], default=["layers", "models"])
    p.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"], help="of the one-projection timings")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 512, 4096], help="input rows of a projection")
    p.add_argument("--profile-tokens", type=int, nargs="*", default=[16, 4096], help="gate_proj rows profiled")
    p.add_argument("--model-dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--backends", nargs="+", choices=sorted(BACKENDS), default=["cusparselt", "cutlass"])
    p.add_argument("--prefill", nargs="+", default=["512x1", "512x16", "2048x16"], help="TOKENSxBATCH")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--search-alg",
        action="store_true",
        help="also time the algorithm torch._cslt_sparse_mm_search picks (crashed the CUDA context on torch 2.11)",
    )
    p.add_argument("--budget-s", type=float, default=160, help="start no workload after this many seconds")
    p.add_argument("--output", type=Path, default=None, help="results JSON (default: semi_structured_profile_<gpu>)")
    p.add_argument("--output-dir", type=Path, default=RESULTS_DIR, help="folder of the default results file")
    args = p.parse_args(argv)
    args.dtypes = [getattr(torch, d) for d in args.dtypes]
    args.model_dtype = getattr(torch, args.model_dtype)
    args.prefill = [(int(t), int(b or 1)) for t, _, b in (s.lower().partition("x") for s in args.prefill)]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_semi_structured_support()
    except RuntimeError as e:
        print(f"semi-structured benchmark skipped: {e}", file=sys.stderr)
        return 1
    import _semi_structured_layers as layers

    start = time.monotonic()
    deadline = start + args.budget_s
    gpu = torch.cuda.get_device_name()
    result = {
        **harness.environment(argv, "semi_structured.py"),
        "gpu": gpu,
        "torch": torch.__version__,
        "cusparselt_version": torch.backends.cusparselt.version(),
        "budget_s": args.budget_s,
        "layers": [],
        "kernels": [],
        "models": [],
        "skipped": [],
    }
    name = args.output or args.output_dir / f"semi_structured_profile_{gpu_tag(gpu)}.json"
    with harness.timing_lock():
        if "layers" in args.parts:  # at most LAYERS_SHARE of the budget when models follow
            share = LAYERS_SHARE if "models" in args.parts else 1.0
            rows, profiles, skipped = layers.run(
                args.shape,
                args.dtypes,
                args.tokens,
                args.profile_tokens,
                start + share * args.budget_s,
                search=args.search_alg,
            )
            result.update(layers=rows, kernels=profiles)
            result["skipped"] += skipped
            result["elapsed_s"] = time.monotonic() - start
            harness.write_results(result, name, "semi_structured")
        for shape in args.shape if "models" in args.parts else []:
            if time.monotonic() > deadline:
                result["skipped"].append(f"{shape} models")
                continue
            try:
                result["models"].append(time_models(shape, args, deadline))
            except Exception as e:  # noqa: BLE001  (e.g. out of memory building a model: the next shape runs)
                result["failed"] = [*result.get("failed", []), f"{shape} models: {type(e).__name__}: {str(e)[:200]}"]
                free_memory()
            result["elapsed_s"] = time.monotonic() - start
            harness.write_results(result, name, "semi_structured")
    result["elapsed_s"] = time.monotonic() - start
    out = harness.write_results(result, name, "semi_structured")
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
