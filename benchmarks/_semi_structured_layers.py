"""One projection of a Llama shape through each 2:4 path, against dense: where the time of a 2:4 product goes.

For a weight of the shape's q_proj, gate_proj or down_proj and `tokens` input rows, `y = x Wᵀ` is computed by

- `dense`: `F.linear` on the dense weight (cuBLAS);
- `cuSPARSELt` / `CUTLASS`: `F.linear` on PyTorch's semi-structured weight of that backend (the path
  `to_semi_structured_` gives a model: the tensor subclass's Python dispatch, then the kernel);
- `cuSPARSELt, raw op`: `torch._cslt_sparse_mm` on the compressed weight, no subclass (the C++ call alone);
- `cuSPARSELt, searched`: the raw op with the algorithm `torch._cslt_sparse_mm_search` picks for this shape.

Each is timed per call eagerly (device events around a loop of calls: host work shows as gaps) and replayed from a
CUDA graph of the same loop (kernels only), and profiled (`torch.profiler`: each kernel's device time per call).
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.nn.functional as F
from _gpu_shapes import SHAPES
from _gpu_timing import capture, free_memory

from optimum_prune.functional.masks import nm_keep_mask

VARIANTS = ("dense", "cuSPARSELt", "cuSPARSELt, raw op", "cuSPARSELt, searched", "CUTLASS")


def projections(shape_name: str) -> dict[str, tuple[int, int]]:
    """`{name: (out_features, in_features)}` of the shape's q_proj, gate_proj (= up_proj) and down_proj."""
    s = SHAPES[shape_name]
    return {"q_proj": (s.heads * s.head_dim, s.hidden), "gate_proj": (s.intermediate, s.hidden),
            "down_proj": (s.hidden, s.intermediate)}  # fmt: skip


SEARCH_OFF = (
    "not run (--search-alg runs it): on torch 2.11 + CUDA 13 on an H200 the algorithm the search picked raised an "
    "illegal instruction, which leaves the CUDA context unusable for the rest of the process"
)


def _calls(weight: torch.Tensor, x: torch.Tensor, search: bool = False) -> dict:
    """`{variant: (callable, alg_id or None)}`, each called once here; a variant this torch / GPU cannot build or run
    (no cuSPARSELt, no CUTLASS kernel for this GPU, too few rows for the bare op) maps to its error text. The searched
    algorithm runs only with `search` (see `SEARCH_OFF`)."""
    from torch.sparse import SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS

    search_alg = search

    def cusparselt():
        w = SparseSemiStructuredTensorCUSPARSELT.from_dense(weight)
        return lambda: F.linear(x, w), None

    def raw(search: bool):
        if search and not search_alg:
            raise RuntimeError(SEARCH_OFF)
        packed, xt = torch._cslt_compress(weight), x.t()
        alg = int(torch._cslt_sparse_mm_search(packed, xt, transpose_result=True)) if search else 0
        return lambda: torch._cslt_sparse_mm(packed, xt, transpose_result=True, alg_id=alg), alg

    def cutlass():
        w = SparseSemiStructuredTensorCUTLASS.from_dense(weight)
        return lambda: F.linear(x, w), None

    makers = {"dense": lambda: (lambda: F.linear(x, weight), None), "cuSPARSELt": cusparselt,
              "cuSPARSELt, raw op": lambda: raw(False), "cuSPARSELt, searched": lambda: raw(True), "CUTLASS": cutlass}  # fmt: skip
    out = {}
    for name, make in makers.items():
        try:
            fn, alg = make()
            fn()
            out[name] = (fn, alg)
        except Exception as e:  # noqa: BLE001  (a path this torch / GPU cannot run is reported)
            out[name] = _error(e)
    return out


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def _time_us(fn, calls: int, reps: int, graph: bool) -> float:
    """Median µs per call of `reps` timings of `calls` back-to-back calls (eager, or one replay of their graph)."""
    run = lambda: [fn() for _ in range(calls)]  # noqa: E731
    run()
    if graph:
        g, keep = capture(run)  # noqa: F841  (the outputs live as long as the graph)
        run = g.replay
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        run()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(out)


def _kernels(fn, calls: int) -> dict:
    """Device time per call of each kernel (`torch.profiler`), and the host time per call of the whole loop."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        host = time.perf_counter() - t
        torch.cuda.synchronize()
    kernels = {}
    for ev in prof.key_averages():
        device_us = getattr(ev, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(ev, "self_cuda_time_total", 0)
        if device_us and str(getattr(ev, "device_type", "")).endswith("CUDA"):
            kernels[ev.key] = {"us_per_call": device_us / calls, "launches_per_call": ev.count / calls}
    top = dict(sorted(kernels.items(), key=lambda kv: -kv[1]["us_per_call"])[:6])
    return {"host_us_per_call": host * 1e6 / calls, "device_us_per_call": sum(k["us_per_call"] for k in kernels.values()),
            "kernels": top}  # fmt: skip


def run(
    shapes, dtypes, tokens, profile_tokens, deadline: float, search: bool = False
) -> tuple[list[dict], list[dict], list[str]]:
    """`(timings, profiles, skipped)`: every (shape, projection, dtype, tokens) in that order until `deadline`; kernel
    profiles of gate_proj at `profile_tokens`; `search`: also time the algorithm cuSPARSELt's search picks."""
    rows, profiles, skipped = [], [], []
    for shape in shapes:
        for proj, (out_f, in_f) in projections(shape).items():
            for dtype in dtypes:
                g = torch.Generator(device="cuda").manual_seed(0)
                w = torch.randn(out_f, in_f, device="cuda", dtype=dtype, generator=g)
                w = w * nm_keep_mask(w.abs().float(), 2, 4).to(dtype)
                for n in tokens:
                    if time.monotonic() > deadline:
                        skipped.append(f"{shape} {proj} {str(dtype)[6:]} {n} tokens")
                        continue
                    x = torch.randn(n, in_f, device="cuda", dtype=dtype, generator=g)
                    calls = max(2, min(20, math.ceil(2e10 / (2 * n * out_f * in_f))))  # ~30 µs of work or more
                    row = {"shape": shape, "projection": proj, "out": out_f, "in": in_f, "tokens": n,
                           "dtype": str(dtype).removeprefix("torch."), "calls": calls, "variants": {}}  # fmt: skip
                    for name, call in _calls(w, x, search).items():
                        if isinstance(call, str):
                            row["variants"][name] = {"error": call}
                            continue
                        fn, alg = call
                        entry = {"alg_id": alg} if alg is not None else {}
                        for mode in ("eager", "graph"):
                            try:
                                entry[f"{mode}_us"] = _time_us(fn, calls, 3, mode == "graph")
                            except Exception as e:  # noqa: BLE001
                                entry[f"{mode}_error"] = _error(e)
                        if proj == "gate_proj" and n in profile_tokens:
                            try:
                                profiles.append({"shape": shape, "tokens": n, "dtype": row["dtype"], "variant": name,
                                                 **_kernels(fn, calls)})  # fmt: skip
                            except Exception as e:  # noqa: BLE001
                                profiles.append({"shape": shape, "tokens": n, "dtype": row["dtype"], "variant": name,
                                                 "error": _error(e)})  # fmt: skip
                        row["variants"][name] = entry
                    rows.append(row)
                    del x
                del w
                free_memory()
    return rows, profiles, skipped
