"""Dense calibration statistics of the NP allocation study, collected once per model and calibration ids and cached
on disk (`benchmarks/np_allocation.py`).

Per decoder layer: the Gram and mean of the o_proj / down_proj inputs (NP), their per-channel moments (FLAP), the
mean squared norm of the layer's residual input, and the per-channel squared norms of the attention and MLP inputs
(the q_proj / up_proj inputs, for outlier-weighted layer budgets). Accumulated through the library's classes in
`optimum_prune.calibration.stats`; the cache stores each accumulator's tensors, never code.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from optimum_prune.calibration.sequential import LayerwiseRunner
from optimum_prune.calibration.stats import GramStats, MomentStats, RunningSums, SquaredNormStats
from optimum_prune.modeling.architectures import get_layers, layer_view, weight_oi

__all__ = ["Both", "Energy", "collect"]

logger = logging.getLogger("benchmarks.np_allocation")


class Both:
    """Feeds one module input to NP's Gram and FLAP's moments."""

    def __init__(self, dim: int) -> None:
        self.gram, self.moments = GramStats(dim), MomentStats(dim)

    def update(self, x: torch.Tensor) -> None:
        self.gram.update(x)
        self.moments.update(x)


class Energy:
    """Mean squared norm of a layer's residual input."""

    def __init__(self) -> None:
        self.total, self.count = 0.0, 0

    def update(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).double()
        self.total += float((x * x).sum())
        self.count += x.shape[0]

    @property
    def value(self) -> float:
        return self.total / max(self.count, 1)


_CLASSES = {c.__name__: c for c in (GramStats, MomentStats, SquaredNormStats, Energy)}


def _state(obj) -> dict[str, Any]:
    return {"class": type(obj).__name__, **(obj.state_dict() if isinstance(obj, RunningSums) else vars(obj))}


def _restore(state: dict[str, Any]):
    cls = _CLASSES[state["class"]]
    fields = {k: v for k, v in state.items() if k not in ("class", "_synced")}  # older caches also hold `_synced`
    if issubclass(cls, RunningSums):
        return cls.from_state_dict(fields)
    obj = cls.__new__(cls)
    obj.__dict__.update(fields)
    return obj


def _save(stats: dict[int, dict[str, Any]], path: Path) -> None:
    out = {}
    for i, acc in stats.items():
        layer = {}
        for name, a in acc.items():
            if isinstance(a, Both):
                layer[name + ".gram"], layer[name + ".moments"] = _state(a.gram), _state(a.moments)
            else:
                layer[name] = _state(a)
        out[i] = layer
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(out, tmp)
    tmp.replace(path)


def _load(path: Path) -> dict[int, dict[str, Any]]:
    raw = torch.load(path, weights_only=True)
    stats = {}
    for i, layer in raw.items():
        acc: dict[str, Any] = {}
        for key, state in layer.items():
            name, _, part = key.partition(".")
            if part:
                both = acc.setdefault(name, Both.__new__(Both))
                setattr(both, part, _restore(state))
            else:
                acc[name] = _restore(state)
        stats[int(i)] = acc
    return stats


@torch.no_grad()
def collect(model, spec, ids: torch.Tensor, cache: Path | None = None, batch_size: int = 8):
    """`{layer: {"attn": Both, "mlp": Both, "resid": Energy, "attn_in": SquaredNormStats, "mlp_in": ...}}` and the
    seconds the collection took (0 when read from `cache`)."""
    if cache is not None and cache.exists():
        logger.info("statistics read from %s", cache)
        return _load(cache), 0.0
    t0 = time.perf_counter()
    run = LayerwiseRunner(model, spec, ids, batch_size=batch_size)
    stats = {}
    for i, layer in enumerate(get_layers(model, spec)):
        view = layer_view(layer, i, spec, model.config)
        hidden = model.config.hidden_size
        acc = {
            "attn": Both(weight_oi(view.o_proj).shape[1]),
            "mlp": Both(view.intermediate_size),
            "resid": Energy(),
            "attn_in": SquaredNormStats(hidden),
            "mlp_in": SquaredNormStats(hidden),
        }
        observe = {
            "attn": view.o_proj,
            "mlp": view.mlp_out,
            "resid": layer,
            "attn_in": view.module(spec.qkv_paths[0]),
            "mlp_in": view.module(spec.mlp_in_paths[0]),
        }
        run.advance(run.run_layer(i, observe=observe, callback=lambda n, x: acc[n].update(x)))  # noqa: B023
        stats[i] = acc
        logger.info("layer %d: residual energy %.3g", i, acc["resid"].value)
    seconds = time.perf_counter() - t0
    if cache is not None:
        _save(stats, cache)
    return stats, seconds
