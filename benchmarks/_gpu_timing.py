"""Timed prefill and decode steps for the GPU benchmarks: eager, or replayed from a captured CUDA graph.

- **prefill**: one forward over `batch` x `tokens` new tokens that fills an empty KV cache and returns the logits of
  the last token only (what a server computes before the first generated token).
- **decode**: one step of `batch` sequences against a static KV cache of `cache_len` positions (the cache
  `transformers` uses with `torch.compile`), repeated `steps` times per timed round.

`mode="graph"` captures one call in a CUDA graph (`torch.cuda.graph`) and replays it, so the time is the kernels' and
not the Python and launch overhead between them; `mode="eager"` runs the model as `transformers` does. Both go through
the same call, written so that a capture never reads a device value on the host (with a cache and explicit
positions, `transformers` skips its host-side packed-sequence check).

`interleave` times several runners round by round in a rotating order (one machine-state drift hits all of them),
each round on device events (host clock on a CPU), and stops early at a deadline once it has `min_rounds`.
"""

from __future__ import annotations

import gc
import inspect
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import harness
import torch


@dataclass(frozen=True)
class Scenario:
    """One timed workload: `kind` `"prefill"` (`tokens` new tokens per sequence) or `"decode"` (`tokens` cached
    positions, `steps` steps per round), `batch` sequences, `mode` `"graph"` or `"eager"`."""

    kind: str
    batch: int
    tokens: int
    mode: str = "graph"
    steps: int = 1

    @property
    def name(self) -> str:
        what = f"prefill {self.tokens} x {self.batch}" if self.kind == "prefill" else f"decode batch {self.batch}"
        return f"{what}, {'CUDA graph' if self.mode == 'graph' else 'eager'}"

    @property
    def cache_len(self) -> int:
        """Positions of the static cache a decode step reads (its context plus the steps of one round)."""
        return self.tokens + self.steps


def _cache_kwarg(model) -> str:
    """`transformers` renamed `past_key_values` to `cache` (5.2x); the forward's signature says which it takes."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class Runner:
    """One model on one scenario: `time_ms()` times `repeats` units (a prefill, or `steps` decode steps).

    Both kinds write into a static KV cache allocated (and, for decoding, filled with random keys and values) by an
    untimed call before any capture: a capture then allocates nothing and copies nothing from the host. A prefill's
    cache holds exactly its tokens, so `transformers` takes SDPA's causal path (no mask) as it does without a cache.
    """

    def __init__(self, model, scenario: Scenario, device: torch.device, seed: int = 0):
        self.model, self.scenario, self.device = model, scenario, torch.device(device)
        sc = scenario
        gen = torch.Generator().manual_seed(seed)
        length = 1 if sc.kind == "decode" else sc.tokens
        self.ids = torch.randint(0, model.config.vocab_size, (sc.batch, length), generator=gen).to(self.device)
        self.start = sc.tokens if sc.kind == "decode" else 0  # the cache position each unit starts from
        self.graph = self.graph_output = None
        self._init_cache()
        self.repeats = 1
        self.warm_s = self._warm()
        if sc.mode == "graph":
            self.reset()
            self.graph, self.graph_output = capture(self._call)

    # ------------------------------------------------------------------------------------------------ calls
    def _call(self):
        with torch.inference_mode():
            return self.model(**self.kwargs).logits

    def _init_cache(self) -> None:
        from transformers import StaticCache

        sc = self.scenario
        self.cache = StaticCache(
            config=self.model.config, max_cache_len=sc.cache_len if sc.kind == "decode" else sc.tokens
        )
        positions = torch.arange(self.ids.shape[1], device=self.device) + self.start
        self.kwargs = {
            "input_ids": self.ids, "position_ids": positions.expand(sc.batch, -1), _cache_kwarg(self.model): self.cache,
            "use_cache": True, "logits_to_keep": 1,
        }  # fmt: skip
        if "cache_position" in inspect.signature(self.model.forward).parameters:  # transformers before 5.1x
            self.kwargs["cache_position"] = positions
        self.reset()
        self._call()  # allocates the cache (lazily, on the first call), outside any capture
        if sc.kind == "decode":
            with torch.inference_mode():
                for layer in getattr(self.cache, "layers", []):
                    for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                        if isinstance(t, torch.Tensor):
                            t.normal_()  # attention over random keys, not zeros
        self.reset()

    def reset(self) -> None:
        """Rewind the static cache to where each unit starts (every call advances it by its tokens)."""
        with torch.inference_mode():
            for layer in getattr(self.cache, "layers", []):
                length = getattr(layer, "cumulative_length", None)
                if isinstance(length, torch.Tensor):
                    length.fill_(self.start)

    def _warm(self) -> float:
        self.sync()
        self.reset()
        t = time.perf_counter()
        self._unit()  # eager: no graph yet
        self.sync()
        return time.perf_counter() - t

    # ------------------------------------------------------------------------------------------------ running
    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _unit(self) -> None:
        """One timed unit: a prefill, or `steps` decode steps (replayed from the graph when there is one)."""
        for _ in range(self.scenario.steps if self.scenario.kind == "decode" else 1):
            if self.graph is None:
                self._call()
            else:
                self.graph.replay()

    def time_ms(self) -> float:
        """Milliseconds per call over `repeats` units, each timed from its own start (the cache rewind before it is
        not timed): device events on a GPU (launch gaps included), the host clock elsewhere."""
        if self.device.type != "cuda":
            total = 0.0
            for _ in range(self.repeats):
                self.reset()
                t = time.perf_counter()
                self._unit()
                total += time.perf_counter() - t
            return total * 1e3 / self.units
        events = []
        self.sync()
        for _ in range(self.repeats):
            self.reset()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._unit()
            end.record()
            events.append((start, end))
        self.sync()
        return sum(a.elapsed_time(b) for a, b in events) / self.units

    @property
    def units(self) -> int:
        """Calls per `time_ms()` (a round's time is divided by it: ms per prefill or per decode step)."""
        return self.repeats * (self.scenario.steps if self.scenario.kind == "decode" else 1)

    def close(self) -> None:
        self.graph = self.graph_output = self.cache = self.kwargs = None


def capture(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A CUDA graph of one call of `fn` (warmed up on a side stream first, as capture requires) and its output, which
    must stay alive with the graph (its replays write there)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = fn()
    return graph, output


def interleave(
    runners: dict[str, Runner], rounds: int, deadline: float = math.inf, min_rounds: int = 3, min_round_ms: float = 20
) -> dict[str, list[float]]:
    """Per-round milliseconds per unit of every runner, the order rotating by one each round.

    Every runner repeats its unit as often as the first runner needs for `min_round_ms` per round (so short units are
    not timed at the clock's resolution), and the rounds stop at `deadline` (`time.monotonic()`) once `min_rounds`
    are done.
    """
    names = list(runners)
    first = runners[names[0]]
    repeats = max(1, min(50, math.ceil(min_round_ms / 1e3 / max(first.warm_s, 1e-6))))
    for r in runners.values():
        r.repeats = repeats
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(rounds):
        if i >= min_rounds and time.monotonic() > deadline:
            break
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(runners[name].time_ms())
    return times


def gpu_tag(name: str) -> str:
    """A short name of a GPU for results file names: its model number (`NVIDIA H100 80GB HBM3` -> `H100`)."""
    import re

    found = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name)
    return found.group(1) if found else re.sub(r"\W+", "_", name).strip("_")


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_scenario(
    models: dict, sc: Scenario, device, rounds: int, deadline: float = math.inf, work: dict | None = None
) -> dict:
    """Time `models` (the first is the reference) on `sc`, interleaved: per model its per-round ms, median and, but
    for the reference, the per-round speedups over it (`harness.round_ratios`) and the ideal speedup
    `work[reference] / work[model]` (FLOPs or bytes). A failed capture or an out-of-memory error is recorded for
    this workload only."""
    record: dict = {"kind": sc.kind, "batch": sc.batch, "tokens": sc.tokens, "mode": sc.mode, "name": sc.name}
    if sc.kind == "decode":
        record.update(steps=sc.steps, cache_len=sc.cache_len)
    runners = {}
    try:
        for label, model in models.items():
            runners[label] = Runner(model, sc, device)
        times = interleave(runners, rounds, deadline)
    except Exception as e:  # noqa: BLE001  (a one-shot GPU run records the failure and goes on)
        record["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return record
    finally:
        for r in runners.values():
            r.close()
        runners.clear()
        free_memory()
    ref = next(iter(models))
    record["models"] = {}
    for label, ms in times.items():
        entry: dict = {"ms": ms, "median_ms": statistics.median(ms)}
        if work is not None:
            entry["work"] = work[label]
        if label != ref:
            if work is not None:
                entry["ideal"] = work[ref] / work[label]
            entry.update(harness.round_ratios(times[ref], ms, "speedup"))
        record["models"][label] = entry
    record["rounds"] = len(times[ref])
    return record


def speedup_cell(entry: dict) -> str:
    """`1.21x [1.20, 1.22] / 1.25x (97%)`: median [Q1, Q3] of the per-round speedups / the ideal (share of it)."""
    sp = entry.get("speedup_spread") or {}
    if not sp.get("n"):
        return "n/a"
    cell = f"{sp['median']:.2f}x [{sp['q1']:.2f}, {sp['q3']:.2f}]"
    if "ideal" in entry:
        cell += f" / {entry['ideal']:.2f}x ({sp['median'] / entry['ideal']:.0%})"
    return cell
