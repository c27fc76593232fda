"""Timed prefill and decode steps for the GPU benchmarks: eager, or replayed from a captured CUDA graph.

- **prefill**: one forward over `batch` x `tokens` new tokens that fills a fresh KV cache and returns the logits of
  the last token only (what a server computes before the first generated token).
- **decode**: one step of `batch` sequences against a static KV cache of `cache_len` positions (the cache
  `transformers` uses with `torch.compile`), repeated `steps` times per timed round.

`mode="graph"` captures one call in a CUDA graph (`torch.cuda.graph`) and replays it, so the time is the kernels' and
not the Python and launch overhead between them; `mode="eager"` runs the model as `transformers` does. Both go through
the same call, written so that a capture never reads a device value on the host (no synchronisation: the prefill
keeps its cache, which spares `transformers` its packed-sequence check; the decode passes its positions).

`interleave` times several runners round by round in a rotating order (one machine-state drift hits all of them),
each round on device events (host clock on a CPU), and stops early at a deadline once it has `min_rounds`.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

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
    """One model on one scenario: `run()` launches one timed unit (a prefill, or `steps` decode steps)."""

    def __init__(self, model, scenario: Scenario, device: torch.device, seed: int = 0):
        self.model, self.scenario, self.device = model, scenario, torch.device(device)
        vocab = model.config.vocab_size
        gen = torch.Generator().manual_seed(seed)
        length = 1 if scenario.kind == "decode" else scenario.tokens
        self.ids = torch.randint(0, vocab, (scenario.batch, length), generator=gen).to(self.device)
        self.graph = self.graph_output = self.cache = None
        if scenario.kind == "decode":
            self._init_decode()
        self.repeats = 1
        self.warm_s = self._warm()
        if scenario.mode == "graph":
            self.graph, self.graph_output = _capture(self._call)

    # ------------------------------------------------------------------------------------------------ calls
    def _call(self):
        with torch.inference_mode():
            if self.scenario.kind == "prefill":
                return self.model(input_ids=self.ids, use_cache=True, logits_to_keep=1).logits
            return self.model(**self.decode_kwargs).logits

    def _init_decode(self) -> None:
        from transformers import StaticCache

        sc = self.scenario
        self.cache = StaticCache(config=self.model.config, max_cache_len=sc.cache_len)
        self.positions = torch.full((sc.batch, 1), sc.tokens, dtype=torch.long, device=self.device)
        self.decode_kwargs = {
            "input_ids": self.ids, "position_ids": self.positions, _cache_kwarg(self.model): self.cache,
            "use_cache": True, "logits_to_keep": 1,
        }  # fmt: skip
        if "cache_position" in inspect.signature(self.model.forward).parameters:  # transformers before 5.1x
            self.decode_kwargs["cache_position"] = self.positions[0]
        self._call()  # allocates the cache (lazily, on the first step), outside any capture
        with torch.inference_mode():
            for layer in getattr(self.cache, "layers", []):
                for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                    if isinstance(t, torch.Tensor):
                        t.normal_()  # attention over random keys, not zeros
        self.reset()

    def reset(self) -> None:
        """Rewind the static cache to the scenario's context (each step advances it by one position)."""
        with torch.inference_mode():
            for layer in getattr(self.cache, "layers", []):
                length = getattr(layer, "cumulative_length", None)
                if isinstance(length, torch.Tensor):
                    length.fill_(self.scenario.tokens)

    def _warm(self) -> float:
        self.sync()
        t = time.perf_counter()
        self.run_eager()
        self.sync()
        return time.perf_counter() - t

    # ------------------------------------------------------------------------------------------------ running
    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run_eager(self) -> None:
        for _ in range(self.repeats):
            self.reset()
            for _ in range(self.scenario.steps if self.scenario.kind == "decode" else 1):
                self._call()

    def run(self) -> None:
        if self.graph is None:
            return self.run_eager()
        for _ in range(self.repeats):
            self.reset()
            for _ in range(self.scenario.steps if self.scenario.kind == "decode" else 1):
                self.graph.replay()

    @property
    def units(self) -> int:
        """Calls per `run()` (a round's time is divided by it: ms per prefill or per decode step)."""
        return self.repeats * (self.scenario.steps if self.scenario.kind == "decode" else 1)

    def close(self) -> None:
        self.graph = self.graph_output = self.cache = self.decode_kwargs = None


def _capture(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
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


def timed_ms(runner: Runner) -> float:
    """Milliseconds per unit of one `run()`: device events on a GPU (launch gaps included), host clock on a CPU."""
    if runner.device.type != "cuda":
        t = time.perf_counter()
        runner.run()
        return (time.perf_counter() - t) * 1e3 / runner.units
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    runner.sync()
    start.record()
    runner.run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / runner.units


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
            times[name].append(timed_ms(runners[name]))
    return times
