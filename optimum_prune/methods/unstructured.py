"""Shared pieces of the unstructured / N:M methods (same shapes, weights zeroed and possibly updated).

Lifecycle of `SequentialPruner` (Wanda, SparseGPT, RIA, magnitude in unstructured mode):
  - for each decoder layer, one forward over the calibration chunks feeds `make_stats` accumulators with the
    inputs of every projection (q/k/v share one input, so do gate/up: one accumulator per input group);
  - `prune_weight` returns the new weight of each projection, written in place;
  - the layer is run again and its *pruned* outputs feed the next layer (the Wanda/SparseGPT convention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..config import PruningConfig, _choice
from ..functional.masks import check_pattern_fits, parse_pattern
from ..modeling.architectures import ArchitectureSpec, LayerView, get_layers, layer_view, weight_oi
from ..plan import LayerPlan, PruningPlan
from .base import BasePruner, RunnerFactory

__all__ = ["UnstructuredConfigMixin", "SequentialPruner", "input_groups", "validate_sparsity"]


def validate_sparsity(sparsity: Any, pattern: str) -> None:
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not math.isfinite(sparsity):
        raise ValueError(f"`sparsity` must be a number in [0, 1), got {sparsity!r}.")
    if not 0 <= sparsity < 1:
        raise ValueError(f"`sparsity` must be in [0, 1) (fraction of weights set to zero), got {sparsity}.")
    nm = parse_pattern(pattern)  # raises a clear ValueError for N >= M, N < 1, malformed strings
    if nm is not None and not math.isclose(sparsity, 1 - nm[0] / nm[1]):
        raise ValueError(
            f"pattern {pattern!r} keeps {nm[0]} of every {nm[1]} weights, i.e. sparsity {1 - nm[0] / nm[1]:g}, "
            f"but sparsity={sparsity} was requested. Set sparsity={1 - nm[0] / nm[1]:g} or pattern='unstructured'."
        )


@dataclass
class UnstructuredConfigMixin(PruningConfig):
    """Fields of every unstructured / N:M method.

    Args:
        sparsity (`float`, defaults to `0.5`): fraction of each projection's weights set to zero.
        pattern (`str`, defaults to `"unstructured"`): `"unstructured"` or `"N:M"` (N weights *kept* in every
            group of M consecutive inputs of a row, NVIDIA's convention; `"2:4"` is 50%).
    """

    sparsity: float = 0.5
    pattern: str = "unstructured"

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.pattern, str) and self.pattern.strip().lower() not in ("unstructured",):
            validate_sparsity(self.sparsity, self.pattern)
        else:
            validate_sparsity(self.sparsity, "unstructured")

    @property
    def nm(self) -> tuple[int, int] | None:
        return None if self.pattern == "unstructured" else parse_pattern(self.pattern)


def input_groups(spec: ArchitectureSpec) -> dict[str, tuple[str, ...]]:
    """Projections that read the same input, in forward order: one statistic serves the whole group."""
    return {
        "qkv": spec.qkv_paths,
        "o": (spec.o_path,),
        "mlp_in": spec.mlp_in_paths,
        "mlp_out": (spec.mlp_out_path,),
    }


class SequentialPruner(BasePruner):
    """Base of the unstructured methods; see the module docstring for the lifecycle."""

    structured = False

    def make_stats(self, dim: int) -> Any:
        """An accumulator with `.update(x)` for inputs of width `dim` (`None`: data-free)."""
        return None

    def prune_weight(self, W: torch.Tensor, stats: Any, path: str) -> torch.Tensor:
        """The new `(out, in)` weight of one projection."""
        raise NotImplementedError

    def validate(self, model: nn.Module, spec: ArchitectureSpec) -> None:
        super().validate(model, spec)
        nm = self.config.nm
        for i, layer in enumerate(get_layers(model, spec)):
            for path in spec.linear_paths:
                check_pattern_fits(weight_oi(layer.get_submodule(path)).shape[1], nm, f"layers.{i}.{path}")

    def _write(self, view: LayerView, path: str, W: torch.Tensor) -> None:
        with torch.no_grad():
            weight_oi(view.module(path)).copy_(W.to(view.module(path).weight.dtype))

    def compute_plan(self, model: nn.Module, spec: ArchitectureSpec, runner: RunnerFactory | None) -> PruningPlan:
        run = runner() if (runner is not None and self.needs_calibration) else None
        groups = input_groups(spec)
        plan = PruningPlan()
        for i, layer in enumerate(tqdm(get_layers(model, spec), desc=f"{self.config.method}: layers", leave=False)):
            view = layer_view(layer, i, spec, model.config)
            stats: dict[str, Any] = {}
            if run is not None:
                observe = {g: view.module(paths[0]) for g, paths in groups.items()}
                stats = {g: self.make_stats(weight_oi(m).shape[1]) for g, m in observe.items()}
                run.run_layer(i, observe=observe, callback=lambda g, x: stats[g].update(x), keep_outputs=False)  # noqa: B023
            for g, paths in groups.items():
                for path in paths:
                    W = weight_oi(view.module(path)).detach()
                    self._write(view, path, self.prune_weight(W, stats.get(g), path))
            plan.layers[i] = LayerPlan()
            if run is not None:
                run.advance(run.run_layer(i))  # pruned outputs feed the next layer
        return plan


def choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    _choice(name, value, allowed)
