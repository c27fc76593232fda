"""Shared pieces of the unstructured / N:M methods (same shapes, weights zeroed and possibly updated).

Lifecycle of `SequentialPruner` (Wanda, SparseGPT, RIA, magnitude in unstructured mode), per decoder layer:
  - one forward over the calibration chunks feeds `make_stats` accumulators with the inputs of every targeted
    projection (q/k/v share one input, so do gate/up: one accumulator per input group);
  - `prune_weight` returns the new weight of each targeted projection (or row slice of a fused q|k|v), written in
    place;
  - the layer is run again and its *pruned* outputs feed the next layer (the Wanda/SparseGPT convention).

`layerwise_pass` drives several such pruners at once (a recipe): on each layer every pruner prunes its own targets,
in list order, then the layer's pruned output feeds the next layer. One calibration pass for all of them.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..calibration.stats import feed
from ..functional.masks import check_pattern_fits
from ..modeling.access import read_target, write_target
from ..modeling.architectures import ArchitectureSpec, LayerView, get_layers, weight_oi
from ..modeling.targets import Target, resolve_targets
from ..pipeline.stage import Stage
from ..plan import LayerPlan, PruningPlan
from .base import BasePruner, refuse_pruned_head_dims

__all__ = ["SequentialPruner", "input_groups", "layerwise_pass"]


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

    Per-layer hooks for the driver `layerwise_pass`:
        needs_dense_layer (`bool`): the driver hands `prune_layer` an unpruned copy of the layer.
        dense_inter_layer (`bool`): the next layer should see the *dense* outputs (honoured when every pruner of the
            pass asks for it).
        take_dense_outputs(): the dense layer's outputs over every chunk when `prune_layer` already ran it (the driver
            then does not run it again).
    """

    structured = False
    needs_dense_layer = False
    _dense_outputs: Sequence[torch.Tensor] | None = None

    @property
    def dense_inter_layer(self) -> bool:
        return False

    def take_dense_outputs(self) -> Sequence[torch.Tensor] | None:
        """The outputs of this layer's dense copy that `prune_layer` kept, handed over once (`None`: none kept)."""
        outputs, self._dense_outputs = self._dense_outputs, None
        return outputs

    def pass_info(self) -> dict:
        """What the pruner reports about the whole pass, e.g. its own timings (FISTA: the seconds of its solves in
        this process); `layerwise_pass` puts it into `plan.info` (under `"pruners"`, by position, in a recipe)."""
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

    def begin(self, stage: Stage) -> None:
        """Called once before the first layer."""
        self.targets = self.resolve(stage.model, stage.spec)

    def prune_layer(self, run: Any, view: LayerView, dense: nn.Module | None) -> dict:
        """Prune this config's targets in layer `view.index`; returns the layer's report entries."""
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

    def compute_plan(self, stage: Stage) -> PruningPlan:
        return layerwise_pass([self], stage)


def layerwise_pass(pruners: Sequence[SequentialPruner], stage: Stage) -> PruningPlan:
    """One layer-by-layer calibration pass in which every pruner prunes its targets of each layer, in list order.

    The next layer receives the pruned outputs, unless every pruner asks for the dense ones (FISTA's default).
    If anything fails (e.g. AMP's loss becomes NaN), every weight written so far is restored before the error
    propagates: the model is left unchanged (this keeps a copy of the targeted weights while the pass runs).
    `plan.layers[i].info` holds each pruner's per-layer entries (keyed by its position when there are several);
    `plan.info["seconds"]` the time each pruner spent.
    """
    sess = stage.session
    needs_data = any(p.requires_calibration for p in pruners)
    todo = [i for i in range(len(stage.layers())) if not sess.done(i)]
    run = stage.runner() if (stage.runner is not None and needs_data and todo) else None
    for p in pruners:
        p.begin(stage)
    dense_next = all(p.dense_inter_layer for p in pruners)
    want_copy = dense_next or any(p.needs_dense_layer for p in pruners)
    seconds = [0.0] * len(pruners)
    plan = PruningPlan()
    for i in range(len(stage.layers())):
        if sess.done(i):  # finished by an earlier run: only its outputs are needed
            plan.layers[i] = sess.restored_plan(i)
    backup: list[tuple[nn.Module, torch.Tensor]] = []  # original weights of what was written, to undo a failure

    def visit(view: LayerView):
        paths = {t.path for p in pruners for t in p.targets}
        if not sess.streaming:  # a low-memory block is written elsewhere: its source needs no undo
            backup.extend((view.module(path), view.module(path).weight.detach().clone()) for path in sorted(paths))
        dense = copy.deepcopy(view.layer) if (want_copy and run is not None) else None
        info: dict = {}
        for k, p in enumerate(pruners):
            t0 = time.perf_counter()
            entry = p.prune_layer(run, view, dense)
            seconds[k] += time.perf_counter() - t0
            if len(pruners) == 1:
                info = entry
            elif entry:
                info[str(k)] = entry
        plan.layers[view.index] = LayerPlan(info=info)
        kept = [o for p in pruners if (o := p.take_dense_outputs()) is not None]
        outputs = None
        if run is not None:  # the outputs feed the next layer
            if dense_next and kept:  # a pruner already ran the dense copy over every chunk
                outputs = kept[0]
            else:
                outputs = run.run_layer(view.index, layer=dense if dense_next else None)
        del dense
        sess.finish(view.index, info=info)
        return outputs

    desc = "+".join(p.config.method for p in pruners)
    try:
        stage.walk(todo, visit, run=run, skip_as="input" if dense_next else "current", desc=f"{desc}: layers")
    except BaseException:
        with torch.no_grad():
            for module, weight in backup:
                module.weight.copy_(weight)
        raise
    plan.layers = dict(sorted(plan.layers.items()))
    plan.info["seconds"] = seconds
    for k, p in enumerate(pruners):
        extra = p.pass_info()
        if extra and len(pruners) == 1:
            plan.info.update(extra)
        elif extra:
            plan.info.setdefault("pruners", {})[str(k)] = extra
    return plan
