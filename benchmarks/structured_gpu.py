"""Structured pruning's speed on a GPU at the sizes people prune (Llama-3.2-1B, Llama-3.1-8B, Qwen3-8B shapes).

The dense model against the same model pruned to 20 / 50% (then 30%) with Numerical Pruning's per-layer shapes and
with `allocation="uniform"` (`_gpu_shapes.ALLOCATIONS`; the NP shapes are a real NP run's pattern on SmolLM2-135M
mapped onto the big model), then `round_to` 64 / 128 / 256 at 8B. Random bf16 weights built on the GPU (latency
depends on the shapes only). Workloads (`_gpu_timing`): prefill of 512 and 2048 tokens at batch 1 and 16 (ideal
speedup: the FLOP ratio), decoding at batch 1, 16, 64 against a static KV cache (ideal: the bytes ratio), each as a
replayed CUDA graph and, for decoding and the smallest prefill, eager too. Models of one group are timed in
interleaved rounds; each speedup (median and quartiles of the per-round ratios) stands beside its ideal.

The groups run in priority order under `--budget-s`: a group that would start after the budget is skipped, a running
workload stops after `min_rounds` once the budget is spent, and the results file is rewritten after every group, so a
run cut short keeps what it measured.

    python benchmarks/structured_gpu.py                            # GPU: the plan, within --budget-s (300 s)
    python benchmarks/structured_gpu.py --dry-run                  # the plan and a roofline time estimate
    python benchmarks/structured_gpu.py --device cpu --tiny        # CPU: the plan on a tiny shape (smoke)

Writes results/structured_gpu_large_<gpu>.json and .md (`structured_gpu_H200.json`: the first version, SmolLM2
shapes through `generate`).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import harness
import torch
from _gpu_shapes import (
    ALLOCATIONS,
    SHAPES,
    build_model,
    decode_bytes,
    dense_layers,
    describe,
    prefill_flops,
)
from _gpu_timing import Runner, Scenario, free_memory, gpu_tag, run_scenario, speedup_cell
from harness import RESULTS_DIR

REQUIRES = "cuda"  # `make bench` skips this script, with a message, where torch sees no CUDA device
MEMORY_SHARE = 0.85  # of the GPU's memory one group may plan to hold (weights, caches, graph pools)


@dataclass
class Group:
    """Models timed together (the first is the dense reference) on `scenarios`."""

    shape: str
    title: str
    models: list[tuple[str, str | None, float, int]]  # (label, allocation or None for dense, ratio, round_to)
    scenarios: list[Scenario] = field(default_factory=list)


def _pairs(specs: list[str]) -> list[tuple[int, int]]:
    """`512x16` -> (tokens, batch)."""
    out = []
    for s in specs:
        tokens, _, batch = s.lower().partition("x")
        out.append((int(tokens), int(batch or 1)))
    return out


def scenarios(args, subset: bool = False) -> list[Scenario]:
    """The workloads of a group (`subset`: the round_to sweep's: the smallest and a batched prefill, decode batch 1)."""
    graph = "graph" if args.device == "cuda" else "eager"
    prefill, decode = _pairs(args.prefill), list(args.decode)
    if subset:
        prefill, decode = prefill[:2], decode[:1]
    out = [Scenario("prefill", b, t, graph) for t, b in prefill]
    out += [Scenario("decode", b, args.decode_context, graph, args.decode_steps) for b in decode]
    if graph == "graph" and not subset:
        out += [Scenario("prefill", b, t, "eager") for t, b in _pairs(args.eager_prefill)]
        out += [Scenario("decode", b, args.decode_context, "eager", args.decode_steps) for b in decode]
    return out


def plan(args) -> list[Group]:
    """The groups in priority order: the first shape at the main ratios and its round_to sweep, the other main
    shapes at the main ratios, the main shapes at the further ratios, the further shapes at the main ratios (groups
    of one shape follow each other where the priority allows: they share one dense model)."""
    groups = []

    def allocation_group(shape: str, ratio: float) -> Group:
        models = [("dense", None, 0.0, 1)]
        models += [(f"{ALLOCATIONS[a].label} {ratio:.0%}", a, ratio, args.round_to) for a in args.allocations]
        return Group(shape, f"{shape}, {ratio:.0%} (round_to {args.round_to})", models, scenarios(args))

    groups += [allocation_group(args.shapes[0], r) for r in args.ratios]
    if args.round_to_sweep:
        shape = args.shapes[0]
        for r in args.ratios:
            models = [("dense", None, 0.0, 1)]
            models += [(f"NP {r:.0%}, round_to {m}", "np", r, m) for m in [args.round_to, *args.round_to_sweep]]
            multiples = " / ".join(str(m) for m in [args.round_to, *args.round_to_sweep])
            groups.append(Group(shape, f"{shape}, NP {r:.0%}: MLP widths rounded to {multiples}", models,
                                scenarios(args, subset=True)))  # fmt: skip
    for shape in args.shapes[1:]:
        groups += [allocation_group(shape, r) for r in args.ratios]
    for shape in args.shapes:
        groups += [allocation_group(shape, r) for r in args.extra_ratios]
    for shape in args.extra_shapes:
        groups += [allocation_group(shape, r) for r in args.ratios]
    return groups


def _layers(shape: str, allocation: str | None, ratio: float, round_to: int):
    s = SHAPES[shape]
    return dense_layers(s) if allocation is None else ALLOCATIONS[allocation].layers(s, ratio, round_to)


def _build(shape: str, layers, dtype: torch.dtype, device: str) -> torch.nn.Module:
    return build_model(SHAPES[shape], layers, dtype, device)


def _work(shape: str, layers, sc: Scenario) -> int:
    """FLOPs of a prefill or bytes of a decode step: the quantity whose ratio is the ideal speedup."""
    s = SHAPES[shape]
    if sc.kind == "prefill":
        return prefill_flops(s, layers, sc.batch, sc.tokens)
    return decode_bytes(s, layers, sc.batch, sc.cache_len)


def _state_bytes(shape: str, layers, sc: Scenario) -> int:
    """Device memory a scenario holds per model beyond the weights (KV cache; a prefill's activations, generously)."""
    s = SHAPES[shape]
    kv = (
        sum(2 * lay.kv_heads * s.head_dim for lay in layers)
        * sc.batch
        * (sc.cache_len if sc.kind == "decode" else sc.tokens)
    )
    acts = sc.batch * sc.tokens * (6 * s.hidden + 3 * s.intermediate) if sc.kind == "prefill" else 0
    return 2 * (kv + acts)


def chunks(group: Group, layers: dict, budget: float) -> list[list[int]]:
    """Indices of the group's pruned models split so that the dense model plus each part fit `budget` bytes."""

    def need(idx: list[int]) -> int:
        members = [0, *idx]
        weights = sum(2 * describe(SHAPES[group.shape], layers[i])["params"] for i in members)
        state = max(
            (sum(_state_bytes(group.shape, layers[i], sc) for i in members) for sc in group.scenarios), default=0
        )
        return weights + state

    parts: list[list[int]] = [[]]
    for i in range(1, len(group.models)):
        if parts[-1] and need([*parts[-1], i]) > budget:
            parts.append([])
        parts[-1].append(i)
    return parts


def run_group(group: Group, args, deadline: float, dense_cache: dict) -> list[dict]:
    """One record per part of the group (see `chunks`). `dense_cache` holds the last dense model built, which the
    next group of the same shape reuses."""
    layers = {i: _layers(group.shape, a, r, m) for i, (_, a, r, m) in enumerate(group.models)}
    budget = math.inf
    if args.device == "cuda":
        budget = MEMORY_SHARE * torch.cuda.get_device_properties(0).total_memory
    records = []
    if group.shape not in dense_cache:
        dense_cache.clear()
        free_memory()
        dense_cache[group.shape] = _build(group.shape, None, args.dtype, args.device)
    dense = dense_cache[group.shape]
    for part in chunks(group, layers, budget):
        members = [0, *part]
        labels = [group.models[i][0] for i in members]
        record = {
            "shape": group.shape, "title": group.title,
            "models": {group.models[i][0]: {"allocation": group.models[i][1], "ratio": group.models[i][2],
                                           "round_to": group.models[i][3], **describe(SHAPES[group.shape], layers[i])}
                       for i in members},
            "scenarios": [],
        }  # fmt: skip
        models = {labels[0]: dense}
        for i in part:
            models[group.models[i][0]] = _build(group.shape, layers[i], args.dtype, args.device)
        by_label = {group.models[i][0]: layers[i] for i in members}
        for sc in group.scenarios:
            if time.monotonic() > deadline:
                record["scenarios"].append({"name": sc.name, "skipped": "time budget spent"})
                continue
            work = {label: _work(group.shape, by_label[label], sc) for label in models}
            record["scenarios"].append(run_scenario(models, sc, args.device, args.rounds, deadline, work))
        del models
        free_memory()
        records.append(record)
    return records


def estimate_s(group: Group, args, flops_per_s: float = 6e14, bytes_per_s: float = 3e12) -> float:
    """Seconds a group should take on a GPU that sustains these rates: its timed rounds plus about two untimed
    runs per workload (warm-up, capture) at the roofline time of each model (launch overhead and builds not
    counted)."""
    total = 0.0
    for _, a, r, m in group.models:
        layers = _layers(group.shape, a, r, m)
        s = SHAPES[group.shape]
        for sc in group.scenarios:
            if sc.kind == "prefill":
                t = prefill_flops(s, layers, sc.batch, sc.tokens) / flops_per_s
            else:
                t = sc.steps * decode_bytes(s, layers, sc.batch, sc.cache_len) / bytes_per_s
            total += (args.rounds + 2) * t
    return total


def dry_run(args) -> int:
    """The plan, without a GPU: each group's models (removed share, widths) and its roofline time estimate."""
    for g in plan(args):
        print(f"{g.title}: ~{estimate_s(g, args):.0f} s at 600 TFLOP/s and 3 TB/s; {len(g.scenarios)} workloads")
        for label, a, r, m in g.models:
            d = describe(SHAPES[g.shape], _layers(g.shape, a, r, m))
            print(f"  {label}: {d['params'] / 1e9:.2f}B parameters, removed {d['removed']:.3f}, "
                  f"KV heads {_kv(d['layers'])}, MLP widths {_widths(d['layers'])}")  # fmt: skip
    return 0


def preflight(args) -> dict:
    """A tiny model's logits from replayed CUDA graphs against eager ones (prefill and decode): graphs are timed
    only when they compute what the model computes."""
    from _gpu_shapes import LayerShape

    shape = SHAPES["tiny"]
    layers = [LayerShape(shape.heads, shape.kv_heads, shape.intermediate)] * (shape.layers - 1)
    layers.append(LayerShape(shape.group, 1, shape.intermediate // 2, True))  # per-layer shapes, with biases
    model = _build("tiny", layers, args.dtype, args.device)
    out = {}
    try:
        for sc in (Scenario("prefill", 2, 16, "graph"), Scenario("decode", 2, 16, "graph", 1)):
            runner = Runner(model, sc, args.device)
            runner.reset()
            eager = runner._call().float().clone()
            runner.time_ms()
            diff = (runner.graph_output.float() - eager).abs().max().item()
            out[f"{sc.kind}_max_abs_diff"] = diff
            if not diff <= 1e-2 * eager.abs().max().item():
                raise RuntimeError(f"{sc.kind}: graph logits differ from eager by {diff}")
            runner.close()
        out["ok"] = True
    except Exception as e:  # noqa: BLE001  (any failure: time the graph rows eagerly instead)
        out.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    return out


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _widths(layers: list) -> str:
    lo, hi = min(x[2] for x in layers), max(x[2] for x in layers)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def _kv(layers: list) -> str:
    lo, hi = min(x[1] for x in layers), max(x[1] for x in layers)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def markdown(result: dict) -> str:
    if "groups" not in result:
        return _markdown_smollm2_shapes(result)
    pre = result.get("preflight") or {}
    lines = [
        f"# Structured pruning on a GPU at 1B and 8B shapes: {result['device']}, {result['dtype']}",
        "",
        f"Generated by `benchmarks/structured_gpu.py` on {result['date']} (torch {result['torch']}, transformers "
        f"{result['transformers']}). Random weights in published model shapes; NP = the per-layer pattern of Numerical "
        "Pruning's default on SmolLM2-135M (test-split grid `np_grid_smollm2_protocol.json`) mapped onto each layer depth "
        'and scaled to the ratio; uniform = `allocation="uniform"`. Each cell: speedup over dense, median '
        "[Q1, Q3] of the per-round ratios of interleaved rounds / the ideal speedup (FLOP ratio for prefill, bytes "
        "ratio for a decode step, both exact from the shapes) (speedup as a share of ideal). Prefill: one forward "
        "filling a KV cache, logits of the last token; decode: one step against a static KV cache of the context "
        "plus the round's steps. CUDA graph rows replay a captured call; eager rows run `transformers` as is.",
        "",
        "- CUDA graph check (tiny model, replayed graph vs eager logits): "
        + (
            "not run (no GPU: every row is eager)"
            if not pre
            else "passed"
            if pre["ok"]
            else f"failed ({pre['error']}): the graph rows were timed eager"
        ),
        f"- Time: {result['elapsed_s']:.0f} s of a {result['budget_s']:.0f} s budget"
        + (f"; not run (budget): {', '.join(result['skipped'])}" if result.get("skipped") else ""),
    ]
    lines += [f"- Failed: {f}" for f in result.get("failed", [])]
    for g in result["groups"]:
        labels = list(g["models"])
        lines += ["", f"## {g['title']}", "", "| model | parameters | removed (attention + MLP) | KV heads | MLP widths |",
                  "|---|---:|---:|---:|---:|"]  # fmt: skip
        for label, m in g["models"].items():
            lines.append(f"| {label} | {_count(m['params'])} | {m['removed']:.3f} | {_kv(m['layers'])} "
                         f"| {_widths(m['layers'])} |")  # fmt: skip
        lines += ["", "| workload | dense ms | " + " | ".join(labels[1:]) + " |",
                  "|---|---:|" + "---:|" * (len(labels) - 1)]  # fmt: skip
        for sc in g["scenarios"]:
            if "models" not in sc:
                lines.append(f"| {sc['name']} | {sc.get('error') or sc.get('skipped')} |" + " |" * (len(labels) - 1))
                continue
            ms = sc["models"][labels[0]]["median_ms"]
            cells = [speedup_cell(sc["models"][lab]) for lab in labels[1:]]
            unit = "per step" if sc["kind"] == "decode" else ""
            lines.append(f"| {sc['name']} ({sc['rounds']} rounds) | {ms:.2f}{' ' + unit if unit else ''} | "
                         + " | ".join(cells) + " |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _markdown_smollm2_shapes(result: dict) -> str:
    """The first version of this benchmark: SmolLM2-135M's shapes through `compare_speed` (results file kept)."""
    from optimum_prune.evaluation.speed import format_speed

    lines = [
        f"# Structured pruning on a GPU: {result['device']}, {result['dtype']}",
        "",
        f"Generated by `benchmarks/structured_gpu.py` on {result['date']} (torch {result['torch']}). Random weights "
        "in the per-layer shapes that NP's numerical scores (today's default from a ratio of 0.25) and FLAP chose on SmolLM2-135M-Instruct in the test-split "
        f'grid (`{result["grid"]}`, `round_to=1`; "MLP to x64": widths rounded to the library\'s default `round_to=64`): '
        "latency depends on the shapes only.",
        "",
    ]
    for block in result["blocks"]:
        lines += [f"## batch {block['batch_size']}", "", format_speed(block["speed"])]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["llama-3.1-8b", "llama-3.2-1b"])
    p.add_argument("--extra-shapes", nargs="*", choices=sorted(SHAPES), default=["qwen3-8b"],
                   help="timed last, at the main ratios")  # fmt: skip
    p.add_argument("--ratios", type=float, nargs="+", default=[0.2, 0.5])
    p.add_argument("--extra-ratios", type=float, nargs="*", default=[0.3], help="timed after the round_to sweep")
    p.add_argument("--allocations", nargs="+", choices=sorted(ALLOCATIONS), default=["np", "servable", "uniform"])
    p.add_argument(
        "--round-to", type=int, default=64, help="MLP width multiple of every pruned model (library default)"
    )
    p.add_argument("--round-to-sweep", type=int, nargs="*", default=[128, 256],
                   help="further multiples timed for NP at the first shape")  # fmt: skip
    p.add_argument("--prefill", nargs="+", default=["512x1", "512x16", "2048x1", "2048x16"], help="TOKENSxBATCH")
    p.add_argument("--eager-prefill", nargs="*", default=["512x1"], help="prefill workloads also timed eager")
    p.add_argument("--decode", type=int, nargs="+", default=[1, 16, 64], help="decode batch sizes")
    p.add_argument("--decode-context", type=int, default=512, help="cached positions a decode step attends to")
    p.add_argument("--decode-steps", type=int, default=16, help="decode steps per timed round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=300, help="start no group after this many seconds")
    p.add_argument("--device", default="cuda", help="cuda (the benchmark); cpu only for the smoke test")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tiny", action="store_true", help="the tiny shape and small workloads (CPU smoke test)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and a time estimate, build nothing")
    p.add_argument("--output", type=Path, default=None, help="results JSON (default: structured_gpu_large_<gpu>.json)")
    p.add_argument("--output-dir", type=Path, default=RESULTS_DIR, help="folder of the default results file")
    args = p.parse_args(argv)
    if args.tiny:
        args.shapes, args.extra_shapes, args.extra_ratios, args.round_to_sweep = ["tiny"], [], [], []
        args.round_to = min(args.round_to, 8)
        args.prefill, args.eager_prefill, args.decode = ["8x1"], [], [1]
        args.decode_context, args.decode_steps = 8, 2
    args.dtype = getattr(torch, args.dtype)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("structured GPU benchmark skipped: no CUDA device", file=sys.stderr)
        return 1
    import transformers

    start = time.monotonic()
    deadline = start + args.budget_s
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = {
        **harness.environment(argv, "structured_gpu.py"),
        "device": device,
        "dtype": str(args.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "settings": {k: (str(v) if isinstance(v, (Path, torch.dtype)) else v) for k, v in vars(args).items()},
        "budget_s": args.budget_s,
        "groups": [],
        "skipped": [],
    }
    name = args.output or args.output_dir / f"structured_gpu_large_{gpu_tag(device)}.json"
    groups = plan(args)
    with harness.timing_lock():
        if args.device == "cuda":
            result["preflight"] = preflight(args)
            if not result["preflight"]["ok"]:
                for g in groups:  # time what graphs would have timed, eagerly (labelled so)
                    eager = [Scenario(s.kind, s.batch, s.tokens, "eager", s.steps) for s in g.scenarios]
                    g.scenarios = list(dict.fromkeys(eager))
        dense_cache: dict = {}
        for group in groups:
            if time.monotonic() > deadline:
                result["skipped"].append(group.title)
                continue
            try:
                result["groups"] += run_group(group, args, deadline, dense_cache)
            except Exception as e:  # noqa: BLE001  (e.g. out of memory building a model: the next group runs)
                result["failed"] = [*result.get("failed", []), f"{group.title}: {type(e).__name__}: {str(e)[:200]}"]
                dense_cache.clear()
                free_memory()
            result["elapsed_s"] = time.monotonic() - start
            harness.write_results(result, name, "structured_gpu")
    result["elapsed_s"] = time.monotonic() - start
    out = harness.write_results(result, name, "structured_gpu")
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
