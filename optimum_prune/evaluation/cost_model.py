"""A cost model of where a pruned model is served: the time of one prefill or one decode step at a workload (batch,
context), per block variant, so that shapes can be chosen for a speed target instead of a parameter count.

A decoder's step time is, to a good approximation, a fixed part (embeddings, the final norm, the output head) plus
one term per sublayer, and each term depends only on that sublayer's variant:

- attention: its KV-head count (query heads stay global: fewer KV heads means query heads sharing keys / values, and
  a smaller KV cache to read) or `"no_op"` (no attention, no KV cache in that layer);
- MLP: its width (a multiple of the format's 256) or `"no_op"`.

`measure_cost_table` measures those terms on this machine with `transformers` and a static KV cache (the cache a
server keeps): for each variant a model of `layers` identical layers is timed, interleaved with the model of the same
depth whose layers are empty, and the difference per layer is the variant's cost (medians over rounds). The fixed part
is the empty model's time less its layers' residual adds. `runtime=export.LlamaCppRuntime(tokenizer)` times the same
in llama.cpp (every sequence in its own KV stream, as llama-server's `--parallel` slots): each timed model written with
`export_gguf`, a whole first layer in front (so that llama.cpp runs every one in its per-layer `deci` graph, as it runs
a pruned model), attention timed beside the narrowest MLP (llama.cpp skips a layer without MLP whole) and that MLP's
cost taken off. `analytic_cost_table` is
the bytes / FLOP model where nothing can be measured: each term is the larger of its bytes over the memory
bandwidth (weights, plus the KV cache a decode step reads) and its FLOPs over the compute rate, plus a launch
overhead per sublayer.

A `CostTable` saves as JSON and predicts the step time of any assembly of variants (`predict`, from a model's
per-layer shapes, `modeling.shapes.layer_table`); `check_cost_table` compares its predictions with the measured times
of assembled models. Timed in isolation, a variant's cost can differ from what it costs inside a full-depth model
(caches, the other layers' traffic): `fit_cost_table` refits the table by least squares to the measured step times of
whole assemblies (`random_assemblies`), its own values as the prior.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from tqdm.auto import tqdm
from transformers import StaticCache

from ..modeling.architectures import get_spec, spec_for_config
from ..modeling.auto_classes import pruned_classes
from ..modeling.decilm import FFN_MULTIPLE
from ..modeling.shapes import layer_table
from ..utils.scratch import write_text_atomic

__all__ = [
    "NO_OP",
    "CostTable",
    "Workload",
    "assembled_model",
    "analytic_cost_table",
    "attention_variants",
    "check_cost_table",
    "fit_cost_table",
    "random_assemblies",
    "layer_row_of",
    "measure_assemblies",
    "measure_cost_table",
    "mlp_variants",
    "step_seconds",
]

logger = logging.getLogger(__name__)

NO_OP = "no_op"
COST_TABLE_VERSION = 1


@dataclass(frozen=True)
class Workload:
    """What a server does in one step: `phase` `"prefill"` (a forward over `context` new tokens per sequence, the
    last token's logits kept) or `"decode"` (one new token per sequence against a KV cache of `context` positions),
    for `batch` sequences.

    `Workload.parse("decode:16:2048")` reads the `phase:batch:context` form the CLI takes."""

    phase: str = "decode"
    batch: int = 1
    context: int = 2048

    def __post_init__(self) -> None:
        if self.phase not in ("prefill", "decode"):
            raise ValueError(f"Workload phase must be 'prefill' or 'decode', got {self.phase!r}.")
        if self.batch < 1 or self.context < 1:
            raise ValueError(f"Workload batch and context must be >= 1, got {self.batch} and {self.context}.")

    @property
    def name(self) -> str:
        return f"{self.phase}:{self.batch}:{self.context}"

    @property
    def tokens(self) -> int:
        """New tokens per step (all sequences)."""
        return self.batch * (1 if self.phase == "decode" else self.context)

    @classmethod
    def parse(cls, text: str) -> Workload:
        parts = text.split(":")
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            raise ValueError(f"A workload is phase:batch:context, e.g. decode:16:2048 or prefill:1:512, got {text!r}.")
        return cls(parts[0], int(parts[1]), int(parts[2]))


# ------------------------------------------------------------------------------------------------------ variants
def attention_variants(config) -> list[int | str]:
    """The attention variants of a Llama-style decoder config: every KV-head count that divides the query heads and
    is at most the model's own (largest first), then `"no_op"`."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    return [k for k in range(kv, 0, -1) if heads % k == 0] + [NO_OP]


def mlp_variants(config, step: int = FFN_MULTIPLE) -> list[int | str]:
    """The MLP variants: widths in multiples of `step` up to the model's own (and the model's own, if not one),
    largest first, then `"no_op"`."""
    full = config.intermediate_size
    widths = sorted({full, *range(step, full + 1, step)}, reverse=True)
    return [*widths, NO_OP]


def layer_row_of(config, attention: int | str, mlp: int | str) -> dict[str, Any]:
    """The per-layer shape row (`layer_table`'s) of `config`'s decoder layer with these variants."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    no_attn = attention == NO_OP
    return {
        "num_attention_heads": 0 if no_attn else config.num_attention_heads,
        "num_key_value_heads": 0 if no_attn else int(attention),
        "head_dim": head_dim,
        "intermediate_size": 0 if mlp == NO_OP else int(mlp),
        "biases": [],
    }


def _variant_of(row: dict[str, Any]) -> tuple[int | str, int | str]:
    attention = NO_OP if row["num_attention_heads"] == 0 else int(row["num_key_value_heads"])
    mlp = NO_OP if row["intermediate_size"] == 0 else int(row["intermediate_size"])
    return attention, mlp


def assembled_model(config, rows: Sequence[dict[str, Any]], dtype: torch.dtype = torch.float32, seed: int = 0):
    """A random model of `config`'s decoder with the given per-layer shapes (optimum-prune's per-layer class), for
    timing: the weights are drawn, not meaningful."""
    base = config.model_type
    config_cls, model_cls = pruned_classes(base, "causal-lm")
    data = {k: v for k, v in config.to_dict().items() if k not in ("architectures", "auto_map")}
    data.update(
        model_type=config_cls.model_type,
        num_hidden_layers=len(rows),
        pruned_layers=[dict(r) for r in rows],
        num_key_value_heads=max(max(r["num_key_value_heads"] for r in rows), 1),
        intermediate_size=max(max(r["intermediate_size"] for r in rows), 1),
    )
    cfg = config_cls.from_dict(data)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device("meta"):
        skeleton = model_cls(cfg)
    model = skeleton.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
        for name, module in model.named_modules():
            if name.endswith("norm") and hasattr(module, "weight"):
                module.weight.fill_(1.0)
    model.tie_weights()
    return model.to(dtype).eval()


# ------------------------------------------------------------------------------------------------------- timing
def _cache_kwarg(model) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class _Step:
    """One model at one workload: `__call__()` times one prefill or decode step against a static KV cache (filled
    with random keys and values for decoding), rewound before each step."""

    def __init__(self, model, workload: Workload, device: torch.device, seed: int = 0) -> None:
        self.model, self.device = model.to(device), device
        w = workload
        length = 1 if w.phase == "decode" else w.context
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, model.config.vocab_size, (w.batch, length), generator=gen).to(device)
        self.start = w.context if w.phase == "decode" else 0
        self.cache = StaticCache(config=model.config, max_cache_len=w.context + (1 if w.phase == "decode" else 0))
        positions = (torch.arange(length, device=device) + self.start).expand(w.batch, -1)
        self.kwargs = {"input_ids": ids, "position_ids": positions, _cache_kwarg(model): self.cache,
                       "use_cache": True, "logits_to_keep": 1}  # fmt: skip
        if "cache_position" in inspect.signature(model.forward).parameters:
            self.kwargs["cache_position"] = positions[0]
        self._rewind()
        self._run()  # allocates the cache
        if w.phase == "decode":
            with torch.inference_mode():
                for layer in getattr(self.cache, "layers", []):
                    for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                        if isinstance(t, torch.Tensor):
                            t.normal_()

    def _rewind(self) -> None:
        with torch.inference_mode():
            for layer in getattr(self.cache, "layers", []):
                length = getattr(layer, "cumulative_length", None)
                if isinstance(length, torch.Tensor):
                    length.fill_(self.start)

    def _run(self) -> None:
        with torch.inference_mode():
            self.model(**self.kwargs)

    def __call__(self) -> float:
        self._rewind()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        self._run()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0


def _steps(models: dict[Any, Any], workload: Workload, device: torch.device, runtime: Any) -> dict[Any, Any]:
    """One timed step per model: `runtime` `"transformers"`, or an object whose `step(model, workload, device)`
    returns one (a callable giving seconds, with an optional `close()`; `export.LlamaCppRuntime`)."""
    if runtime == "transformers":
        return {k: _Step(m, workload, device) for k, m in models.items()}
    if isinstance(runtime, str) or not callable(getattr(runtime, "step", None)):
        raise ValueError(
            f"runtime is 'transformers' or a runtime object (e.g. optimum_prune.export.LlamaCppRuntime), got {runtime!r}."
        )
    steps: dict[Any, Any] = {}
    try:
        for k, m in models.items():
            steps[k] = runtime.step(m, workload, device)
    except BaseException:
        _close(steps)
        raise
    return steps


def _close(steps: dict[Any, Any]) -> None:
    for step in steps.values():
        if hasattr(step, "close"):
            step.close()


def _runtime_label(runtime: Any) -> str:
    if runtime == "transformers":
        return f"transformers {transformers.__version__}, static cache, eager, sdpa"
    return str(getattr(runtime, "label", type(runtime).__name__))


def _interleaved(steps: dict[Any, Any], rounds: int, warmup: int, desc: str | None = None) -> dict[Any, list[float]]:
    """Every step timed once per round, the order rotating by one per round (drift hits all alike)."""
    keys = list(steps)
    for key in keys:
        for _ in range(warmup):
            steps[key]()
    times: dict[Any, list[float]] = {k: [] for k in keys}
    for r in tqdm(range(rounds), desc=desc, leave=False, disable=desc is None):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            times[key].append(steps[key]())
    return times


def step_seconds(
    models: dict[str, torch.nn.Module],
    workload: Workload,
    *,
    rounds: int = 7,
    warmup: int = 2,
    device: str | torch.device = "cpu",
    runtime: Any = "transformers",
) -> dict[str, dict[str, Any]]:
    """The measured time of one step of each model at `workload`, interleaved: `{name: {"median_s", "samples_s"}}`
    (`runtime`: `"transformers"` or a runtime object, e.g. `export.LlamaCppRuntime`)."""
    steps = _steps(models, workload, torch.device(device), runtime)
    try:
        times = _interleaved(steps, rounds, warmup)
    finally:
        _close(steps)
    return {name: {"median_s": statistics.median(t), "samples_s": t} for name, t in times.items()}


# -------------------------------------------------------------------------------------------------- cost tables
@dataclass
class CostTable:
    """Step time per sublayer variant at one workload, on one machine and runtime.

    Args:
        workload (`Workload`): what was timed.
        attention (`dict[str, float]`): seconds per attention sublayer, keyed by KV-head count (as a string) or
            `"no_op"`.
        mlp (`dict[str, float]`): seconds per MLP sublayer, keyed by width or `"no_op"`.
        fixed_s (`float`): the rest of a step (embeddings, final norm, output head), once per step.
        per_layer_s (`float`): the part of each layer no sublayer variant removes (its residual adds).
        source (`str`): `"measured"` or `"analytic"`.
        info (`dict`): how it was made (machine, runtime, dtype, rounds, spreads).
    """

    workload: Workload
    attention: dict[str, float]
    mlp: dict[str, float]
    fixed_s: float
    per_layer_s: float = 0.0
    source: str = "measured"
    info: dict[str, Any] = field(default_factory=dict)

    def attention_s(self, variant: int | str) -> float:
        return self._lookup(self.attention, variant, "attention")

    def mlp_s(self, variant: int | str) -> float:
        return self._lookup(self.mlp, variant, "MLP")

    @staticmethod
    def _lookup(table: dict[str, float], variant: int | str, what: str) -> float:
        key = str(variant)
        if key in table:
            return table[key]
        if variant != NO_OP:  # a width between two measured ones: linear in the width
            sizes = sorted(int(k) for k in table if k != NO_OP)
            v = int(variant)
            lo = max((s for s in sizes if s <= v), default=None)
            hi = min((s for s in sizes if s >= v), default=None)
            if lo is not None and hi is not None and hi != lo:
                a, b = table[str(lo)], table[str(hi)]
                return a + (b - a) * (v - lo) / (hi - lo)
        raise KeyError(f"The cost table has no {what} variant {variant!r} (it has {sorted(table)}).")

    def predict(self, rows: Sequence[dict[str, Any]]) -> float:
        """Predicted seconds of one step of a model whose layers have the shapes `rows` (`layer_table`)."""
        total = self.fixed_s
        for row in rows:
            attention, mlp = _variant_of(row)
            total += self.per_layer_s + self.attention_s(attention) + self.mlp_s(mlp)
        return total

    # ---------------------------------------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": COST_TABLE_VERSION,
            **dataclasses.asdict(self),
            "workload": dataclasses.asdict(self.workload),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostTable:
        data = dict(data)
        version = data.pop("version", COST_TABLE_VERSION)
        if version != COST_TABLE_VERSION:
            raise ValueError(
                f"Cost table version {version} is not readable here (this version reads {COST_TABLE_VERSION})."
            )
        data["workload"] = Workload(**data["workload"])
        return cls(**data)

    def save(self, path: str | os.PathLike) -> None:
        write_text_atomic(Path(path), json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> CostTable:
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


def _dense_rows(config, attention: int | str, mlp: int | str, layers: int) -> list[dict[str, Any]]:
    return [layer_row_of(config, attention, mlp) for _ in range(layers)]


def measure_cost_table(
    config,
    workload: Workload,
    *,
    layers: int = 24,
    attention: Iterable[int | str] | None = None,
    mlp: Iterable[int | str] | None = None,
    rounds: int = 7,
    warmup: int = 2,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    runtime: Any = "transformers",
) -> CostTable:
    """Measure a `CostTable` for the decoder of `config` (a Llama-style `transformers` config) at `workload` on
    `device` (see the module docstring): one random model of `layers` identical layers per variant, timed
    interleaved with the empty model of the same depth and with the empty model of one layer (which gives the part
    of a step outside the layers). On a CPU, time with one thread unless the runtime serves with more (small GEMMs
    on several threads can be far slower on shared cores). `runtime=export.LlamaCppRuntime(tokenizer)` times in
    llama.cpp (see the module docstring for how its table is made). `layers` defaults to 24: on SmolLM2, timing
    models of 8 layers partly fit the CPU's caches and their tables missed whole models by up to 19% (llama.cpp,
    decode batch 1) and 45% (transformers, decode batch 16); with 24, within 7.5% in both runtimes on three workloads."""
    if spec_for_config(config) is None:
        raise ValueError(f"No cost model for {config.model_type!r}: it needs a decoder of the architecture table.")
    device = torch.device(device)
    attention = list(attention_variants(config) if attention is None else attention)
    mlp = list(mlp_variants(config) if mlp is None else mlp)
    llama = bool(getattr(runtime, "needs_mlp_beside_attention", False))  # (llama.cpp's deci graph)
    if llama:  # the whole first layer's own variants are timed too (its cost comes off the fixed part)
        attention += [a for a in [config.num_key_value_heads] if a not in attention]
        mlp += [m for m in [config.intermediate_size] if m not in mlp]
    models, derive = (_llamacpp_models if llama else _transformers_models)(config, attention, mlp, layers, dtype)
    steps = _steps(models, workload, device, runtime)
    t0 = time.perf_counter()
    try:
        times = _interleaved(steps, rounds, warmup, desc=f"cost table {workload.name}")
    finally:
        _close(steps)
    med = {k: statistics.median(t) for k, t in times.items()}
    table_a, table_m, fixed, per_layer = derive(med)
    spread = {(k if isinstance(k, str) else ":".join(k)): _iqr(t) for k, t in times.items()}
    info = {
        "runtime": _runtime_label(runtime),
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "layers": layers,
        "rounds": rounds,
        "warmup": warmup,
        "seconds": time.perf_counter() - t0,
        "median_s": {(k if isinstance(k, str) else ":".join(k)): v for k, v in med.items()},
        "iqr_s": spread,
        "model_type": config.model_type,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
    }
    return CostTable(workload, table_a, table_m, fixed, per_layer, "measured", info)


def _transformers_models(config, attention, mlp, layers: int, dtype):
    """The timing models of the transformers layout, and how their median times give the table: per variant `layers`
    identical layers holding that sublayer alone, beside the empty models of `layers` layers and of one."""
    models: dict[Any, Any] = {"empty": assembled_model(config, _dense_rows(config, NO_OP, NO_OP, layers), dtype),
                              "empty1": assembled_model(config, _dense_rows(config, NO_OP, NO_OP, 1), dtype)}  # fmt: skip
    for a in attention:
        if a != NO_OP:
            models["attention", str(a)] = assembled_model(config, _dense_rows(config, a, NO_OP, layers), dtype)
    for m in mlp:
        if m != NO_OP:
            models["mlp", str(m)] = assembled_model(config, _dense_rows(config, NO_OP, m, layers), dtype)

    def derive(med: dict[Any, float]):
        empty = med["empty"]
        per_layer = max((empty - med["empty1"]) / max(layers - 1, 1), 0.0)
        table_m = {str(m): (max((med["mlp", str(m)] - empty) / layers, 0.0) if m != NO_OP else 0.0) for m in mlp}
        table_a = {str(a): (max((med["attention", str(a)] - empty) / layers, 0.0) if a != NO_OP else 0.0)
                   for a in attention}  # fmt: skip
        return table_a, table_m, med["empty1"] - per_layer, per_layer

    return models, derive


def _llamacpp_models(config, attention, mlp, layers: int, dtype):
    """The timing models of a runtime that skips a layer without an MLP whole (llama.cpp's `deci` graph), and how
    their median times give the table. Every model starts with a whole layer (so that it runs in the per-layer
    graph) and holds `layers` layers of one variant: a reference of the narrowest MLP alone, the same at twice the
    depth (its cost per layer), attention variants beside that MLP, wider MLPs, and `layers` empty layers before the
    reference (what a skipped layer costs). A model of empty layers alone is not timed: llama.cpp refuses it."""
    first = [layer_row_of(config, config.num_key_value_heads, config.intermediate_size)]
    widths = [m for m in mlp if m != NO_OP]
    narrow = min(widths)

    def model(*blocks: tuple[int | str, int | str, int]):
        return assembled_model(config, first + [r for a, m, n in blocks for r in _dense_rows(config, a, m, n)], dtype)

    models: dict[Any, Any] = {"reference": model((NO_OP, narrow, layers)), "reference2": model((NO_OP, narrow, 2 * layers)),
                              "skipped": model((NO_OP, NO_OP, layers), (NO_OP, narrow, layers))}  # fmt: skip
    for a in attention:
        if a != NO_OP:
            models["attention", str(a)] = model((a, narrow, layers))
    for m in widths:
        if m != narrow:
            models["mlp", str(m)] = model((NO_OP, m, layers))

    def derive(med: dict[Any, float]):
        ref = med["reference"]
        per_layer = max((med["skipped"] - ref) / layers, 0.0)
        base = max((med["reference2"] - ref) / layers - per_layer, 0.0)  # the narrowest MLP
        table_m = {str(narrow): base, NO_OP: 0.0}
        table_m.update({str(m): max(base + (med["mlp", str(m)] - ref) / layers, 0.0) for m in widths if m != narrow})
        table_a = {str(a): (max((med["attention", str(a)] - ref) / layers, 0.0) if a != NO_OP else 0.0)
                   for a in attention}  # fmt: skip
        full = table_a[str(config.num_key_value_heads)] + table_m[str(config.intermediate_size)]
        fixed = ref - (layers + 1) * per_layer - layers * base - full
        return table_a, table_m, fixed, per_layer

    return models, derive


def _iqr(samples: Sequence[float]) -> list[float]:
    q = statistics.quantiles(samples, n=4) if len(samples) >= 2 else [samples[0]] * 3
    return [q[0], q[2]]


def analytic_cost_table(
    config,
    workload: Workload,
    *,
    bandwidth_gbs: float,
    tflops: float,
    dtype_bytes: int = 4,
    kv_dtype_bytes: int | None = None,
    sublayer_overhead_s: float = 0.0,
) -> CostTable:
    """The bytes / FLOP model (see the module docstring) of `config`'s decoder at `workload` on a machine that moves
    `bandwidth_gbs` GB/s and computes `tflops` TFLOP/s: each term is `max(bytes / bandwidth, flops / rate)` plus
    `sublayer_overhead_s`; decode reads every weight once per step and the KV cache of its context."""
    kv_bytes = dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
    bw, rate = bandwidth_gbs * 1e9, tflops * 1e12
    d, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    tokens, ctx, batch = workload.tokens, workload.context, workload.batch

    def term(weight_params: float, extra_bytes: float, extra_flops: float) -> float:
        t_bytes = (weight_params * dtype_bytes + extra_bytes) / bw
        t_flops = (2 * weight_params * tokens + extra_flops) / rate
        return max(t_bytes, t_flops) + sublayer_overhead_s

    attention = {}
    for a in attention_variants(config):
        if a == NO_OP:
            attention[NO_OP] = 0.0
            continue
        params = d * heads * head_dim * 2 + d * a * head_dim * 2  # q, o; k, v
        if workload.phase == "decode":  # one token attends over the cache: read K and V of every position
            cache = batch * ctx * a * head_dim * 2 * kv_bytes
            flops = 2 * 2 * batch * heads * head_dim * ctx
        else:  # causal attention over the prompt: ~ half the square; the cache written once
            cache = batch * ctx * a * head_dim * 2 * kv_bytes
            flops = 2 * batch * heads * head_dim * ctx * ctx
        attention[str(a)] = term(params, cache, flops)
    mlp = {}
    for m in mlp_variants(config):
        mlp[str(m)] = 0.0 if m == NO_OP else term(3 * d * int(m), 0.0, 0.0)
    vocab = config.vocab_size
    logits_tokens = batch  # logits of the last token of each sequence
    head = (vocab * d * dtype_bytes) / bw
    fixed = max(head, 2 * vocab * d * logits_tokens / rate) + sublayer_overhead_s
    info = {"bandwidth_gbs": bandwidth_gbs, "tflops": tflops, "dtype_bytes": dtype_bytes, "kv_dtype_bytes": kv_bytes,
            "sublayer_overhead_s": sublayer_overhead_s, "model_type": config.model_type}  # fmt: skip
    return CostTable(workload, attention, mlp, fixed, 0.0, "analytic", info)


def check_cost_table(
    table: CostTable,
    models: dict[str, torch.nn.Module],
    *,
    rounds: int = 7,
    warmup: int = 2,
    device: str | torch.device = "cpu",
    runtime: Any = "transformers",
) -> dict[str, dict[str, Any]]:
    """The table's predicted step time of each model against its measured one (interleaved, in `runtime`):
    `{name: {"predicted_s", "measured_s", "error"}}`, `error` = predicted / measured − 1."""
    measured = step_seconds(models, table.workload, rounds=rounds, warmup=warmup, device=device, runtime=runtime)
    out = {}
    for name, model in models.items():
        rows = layer_table(model, get_spec(model))
        predicted = table.predict(rows)
        got = measured[name]["median_s"]
        out[name] = {"predicted_s": predicted, "measured_s": got, "error": predicted / got - 1 if got else math.nan,
                     "samples_s": measured[name]["samples_s"]}  # fmt: skip
    return out


def random_assemblies(config, count: int, seed: int = 0) -> list[list[dict[str, Any]]]:
    """`count` assemblies of `config`'s full depth, each layer's attention and MLP variant drawn uniformly (layer 0
    keeps its attention; an MLP is removed only with its layer's attention, and never in the last layer: llama.cpp
    aborts on a last layer without either), for `fit_cost_table`."""
    gen = torch.Generator().manual_seed(seed)
    attention, mlp = attention_variants(config), mlp_variants(config)
    out = []
    for _ in range(count):
        rows = []
        for i in range(config.num_hidden_layers):
            a = attention[int(torch.randint(len(attention) - (1 if i == 0 else 0), (1,), generator=gen))]
            widths = mlp if a == NO_OP and i < config.num_hidden_layers - 1 else [m for m in mlp if m != NO_OP]
            rows.append(layer_row_of(config, a, widths[int(torch.randint(len(widths), (1,), generator=gen))]))
        out.append(rows)
    return out


def measure_assemblies(
    config,
    assemblies: Sequence[Sequence[dict[str, Any]]],
    workload: Workload,
    *,
    batch: int = 4,
    rounds: int = 7,
    warmup: int = 2,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    runtime: Any = "transformers",
) -> list[float]:
    """The measured step time (median) of a random model of each assembly at `workload`, `batch` of them timed
    interleaved at a time (each holds its own KV cache), in `runtime`."""
    out: list[float] = []
    for start in range(0, len(assemblies), batch):
        chunk = assemblies[start : start + batch]
        models = {str(j): assembled_model(config, rows, dtype) for j, rows in enumerate(chunk)}
        got = step_seconds(models, workload, rounds=rounds, warmup=warmup, device=device, runtime=runtime)
        out += [got[str(j)]["median_s"] for j in range(len(chunk))]
        del models
    return out


def fit_cost_table(
    table: CostTable, assemblies: Sequence[Sequence[dict[str, Any]]], measured_s: Sequence[float], prior: float = 0.1
) -> CostTable:
    """`table` refitted to the measured step times of whole assemblies (per-layer shapes, `layer_table`'s rows):
    the fixed part and every variant's cost (a `"no_op"` stays 0) minimise
    `Σ_k ((predicted_k − measured_k) / measured_k)² + prior · Σ_v ((c_v − c⁰_v) / s)²`, the relative error of each
    assembly plus a ridge towards the table's own values `c⁰` (`s`: the mean measured time over the layer count),
    costs kept ≥ 0. The assemblies must all have one depth. Returns a new table (`info["fit"]` says how)."""
    if len(assemblies) != len(measured_s) or not assemblies:
        raise ValueError("fit_cost_table needs one measured time per assembly, and at least one.")
    depth = {len(rows) for rows in assemblies}
    if len(depth) != 1:
        raise ValueError(f"The assemblies have depths {sorted(depth)}: fit on assemblies of one depth.")
    n = depth.pop()
    keys = [("attention", k) for k in table.attention if k != NO_OP] + [("mlp", k) for k in table.mlp if k != NO_OP]
    index = {key: j + 1 for j, key in enumerate(keys)}  # column 0: the fixed part (with the layers' residual adds)
    A = torch.zeros(len(assemblies), len(keys) + 1, dtype=torch.float64)
    for k, rows in enumerate(assemblies):
        A[k, 0] = 1.0
        for row in rows:
            attention, mlp = _variant_of(row)
            for kind, v in (("attention", attention), ("mlp", mlp)):
                if v == NO_OP:
                    continue
                if (kind, str(v)) not in index:
                    raise KeyError(f"The table has no {kind} variant {v!r}: fit on assemblies of its variants.")
                A[k, index[kind, str(v)]] += 1.0
    t = torch.as_tensor(list(measured_s), dtype=torch.float64)
    c0 = torch.tensor([table.fixed_s + n * table.per_layer_s]
                      + [getattr(table, kind)[v] for kind, v in keys], dtype=torch.float64)  # fmt: skip
    scale = float(t.mean()) / max(n, 1)
    rows = torch.cat([A / t[:, None], (prior**0.5 / scale) * torch.eye(len(c0), dtype=torch.float64)])
    rhs = torch.cat([torch.ones_like(t), (prior**0.5 / scale) * c0])
    c = torch.linalg.lstsq(rows, rhs[:, None]).solution[:, 0].clamp_min(0.0)
    fitted = CostTable(
        table.workload,
        {k: (0.0 if k == NO_OP else float(c[index["attention", k]])) for k in table.attention},
        {k: (0.0 if k == NO_OP else float(c[index["mlp", k]])) for k in table.mlp},
        float(c[0]) - n * table.per_layer_s,
        table.per_layer_s,
        table.source,
        dict(table.info),
    )
    residual = (A @ c - t) / t
    fitted.info["fit"] = {"assemblies": len(assemblies), "depth": n, "prior": prior,
                          "relative_residuals": [float(r) for r in residual]}  # fmt: skip
    return fitted
