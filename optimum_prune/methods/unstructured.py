"""Shared pieces of the unstructured / N:M methods (same shapes, weights zeroed and possibly updated), which plug
into the pipeline's sequential-prune pass kind (`pipeline.passes.layerwise`).

Lifecycle of `SequentialPruner` (Wanda, SparseGPT, RIA, magnitude in unstructured mode), per decoder layer, in
`prune_layer` (the pipeline calls it on each block in order; several pruners of a recipe in list order):
  - one forward over the calibration chunks feeds `make_stats` accumulators with the inputs of every targeted
    projection (q/k/v share one input, so do gate/up: one accumulator per input group);
  - `prune_weight` returns the new weight of each targeted projection (or row slice of a fused q|k|v), written in
    place;
  - the pipeline runs the layer again and its *pruned* outputs feed the next layer (the Wanda/SparseGPT convention).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..calibration.stats import feed
from ..functional.masks import check_pattern_fits
from ..modeling.access import read_target, write_target
from ..modeling.architectures import ArchitectureSpec, LayerView, get_layers, weight_oi
from ..modeling.targets import Target, resolve_targets
from .base import BasePruner, refuse_pruned_head_dims

__all__ = ["SequentialPruner", "input_groups"]


def input_groups(spec: ArchitectureSpec) -> dict[str, tuple[str, ...]]:
    """Projections that read the same input, in forward order: one statistic serves the whole group."""
    return {
        "qkv": spec.qkv_paths,
        "o": (spec.o_path,),
        "mlp_in": spec.mlp_in_paths,
        "mlp_out": (spec.mlp_out_path,) if spec.mlp_out_path else (),
    }


class SequentialPruner(BasePruner):
    """Base of the unstructured methods; see the module docstring for the lifecycle.

    Flags and hooks the pipeline's layer-wise pass reads:
        needs_dense_layer (`bool`): the pass hands `prune_layer` an unpruned copy of the layer.
        needs_dense_stream (`bool`): the pass hands `prune_layer` a fourth argument, the dense model's hidden states
            at the layer's input (`dense_inputs`), carried alongside the pruned ones; `prune_layer` then runs the dense copy on them
            and hands its outputs back (`take_dense_stream_outputs`).
        dense_inter_layer (`bool`): the next layer should see the *dense* outputs (honoured when every pruner of the
            pass asks for it).
        take_dense_outputs(): the dense layer's outputs over every chunk when `prune_layer` already ran it (the pass
            then does not run it again).
    """

    structured = False
    pass_kind = "layerwise"
    needs_dense_layer = False
    needs_dense_stream = False
    _dense_outputs: Sequence[torch.Tensor] | None = None
    _dense_stream_outputs: Sequence[torch.Tensor] | None = None

    @property
    def dense_inter_layer(self) -> bool:
        return False

    def take_dense_outputs(self) -> Sequence[torch.Tensor] | None:
        """The outputs of this layer's dense copy that `prune_layer` kept, handed over once (`None`: none kept)."""
        outputs, self._dense_outputs = self._dense_outputs, None
        return outputs

    def take_dense_stream_outputs(self) -> Sequence[torch.Tensor] | None:
        """(`needs_dense_stream`) the dense copy's outputs on the `dense_inputs` of the last `prune_layer`, once."""
        outputs, self._dense_stream_outputs = self._dense_stream_outputs, None
        return outputs

    def pass_info(self) -> dict:
        """What the pruner reports about the whole pass, e.g. its own timings (FISTA: the seconds of its solves in
        this process); the pipeline puts it into `plan.info` (under `"pruners"`, by position, in a recipe)."""
        return {}

    def make_stats(self, dim: int) -> Any:
        """An accumulator with `.update(x)` for inputs of width `dim` (`None`: data-free)."""
        return None

    def prune_weight(self, W: torch.Tensor, stats: Any, path: str) -> torch.Tensor:
        """The new `(out, in)` weight of one projection."""
        raise NotImplementedError

    def prune_target(self, view: LayerView, target: Target, W: torch.Tensor, stats: Any) -> torch.Tensor:
        """The new weight of one target of layer `view.index` (default: `prune_weight`; override to know which layer
        and which slice of a fused projection it is)."""
        return self.prune_weight(W, stats, target.path)

    def resolve(self, model: nn.Module, spec: ArchitectureSpec) -> list[Target]:
        """The targets of this config on `model` (raises for roles the architecture lacks)."""
        return resolve_targets(spec, getattr(self.config, "targets", None), getattr(model.config, "model_type", ""))

    def validate(self, model: nn.Module, spec: ArchitectureSpec) -> None:
        super().validate(model, spec)
        nm = self.config.nm
        if spec.moe is not None and getattr(self.config, "targets", None) is None:
            raise ValueError(
                f"{type(model).__name__} is a mixture-of-experts model: its experts are pruned by ExpertConfig "
                "(whole experts and channels inside them), not by unstructured methods. To sparsify its attention, "
                "pass targets='attention'. Nothing was changed."
            )
        targets = self.resolve(model, spec)
        if any(t.part is not None for t in targets):  # thirds of a fused q|k|v: equal-width heads only
            refuse_pruned_head_dims(model, spec, "targeting part of a fused q|k|v projection")
        for i, layer in enumerate(get_layers(model, spec)):
            for t in targets:
                check_pattern_fits(weight_oi(layer.get_submodule(t.path)).shape[1], nm, f"layers.{i}.{t.key}")

    def _write(self, view: LayerView, path: str, W: torch.Tensor) -> None:
        with torch.no_grad():
            weight_oi(view.module(path)).copy_(W.to(view.module(path).weight.dtype))

    def begin(self, model: nn.Module, spec: ArchitectureSpec) -> None:
        """Called once before the first layer."""
        self.targets = self.resolve(model, spec)

    def prune_layer(self, run: Any, view: LayerView, dense: nn.Module | None) -> dict:
        """Prune this config's targets in layer `view.index` (`run`: the calibration runner, at the layer's inputs;
        `dense`: see the flags); returns the layer's report entries."""
        by_group: dict[str, list[Target]] = {}
        for g, paths in input_groups(view.spec).items():
            ts = [t for t in self.targets if t.path in paths]
            if ts:
                by_group[g] = ts
        stats: dict[str, Any] = {}
        if run is not None and self.requires_calibration:
            observe = {g: view.module(ts[0].path) for g, ts in by_group.items()}
            stats = {g: self.make_stats(weight_oi(m).shape[1]) for g, m in observe.items()}
            if any(s is not None for s in stats.values()):
                run.run_layer(view.index, observe=observe, callback=feed(stats), keep_outputs=False)
        for g, ts in by_group.items():
            for t in ts:
                write_target(view, t, self.prune_target(view, t, read_target(view, t), stats.get(g)))
        return {}
