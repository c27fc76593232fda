"""Allocation variants of the NP study (`benchmarks/np_allocation.py`): the library's pruners run on statistics
collected once, with the allocation swapped where a variant asks for it (separate attention / MLP pools, per-layer
budgets copied from another method's plan); OWL budgets are the library's `allocation="owl"`. Each variant is a
subclass of the library's pruner overriding its public hooks: `given_scores` (score the cached statistics instead of
running a calibration pass), `allocate` (the allocation strategy), `score_layer` / `channel_scores` (the scores)."""

from __future__ import annotations

import copy
import dataclasses
import time
from types import SimpleNamespace
from typing import Any

import torch

from optimum_prune.calibration.sequential import LayerwiseRunner
from optimum_prune.functional.allocation import LayerUnits, allocate_channel_blocks, allocate_per_layer
from optimum_prune.functional.allocation import allocate as global_allocate
from optimum_prune.methods.flap import FLAPConfig, FLAPPruner
from optimum_prune.methods.numerical import NumericalPruner
from optimum_prune.methods.structured import layer_outlier_fraction
from optimum_prune.modeling.architectures import get_layers, layer_view
from optimum_prune.modeling.shapes import layer_params
from optimum_prune.modeling.surgery import apply_layer_plan_
from optimum_prune.pipeline.passes import run_pass
from optimum_prune.pipeline.stage import Stage

__all__ = ["owl_norms", "prune_variant"]


def _layer_sizes(model, spec) -> list[float]:
    return [layer_params(layer_view(layer, i, spec, model.config)) for i, layer in enumerate(get_layers(model, spec))]


def _pooled_allocate(attn_total: float, mlp_total: float):
    """Allocation with attention and MLP as separate pools, each losing `ratio` of its own parameters."""
    base = global_allocate

    def allocate(units, ratio, total_cost, mode="global", head_weight=1.0):
        att = [LayerUnits(u.head_scores, u.head_cost, u.max_head_units, None, 0.0, 0) for u in units]
        mlp = [LayerUnits(None, 0.0, 0, u.channel_scores, u.channel_cost, u.max_channels) for u in units]
        heads, _ = base(att, ratio, attn_total, mode=mode)
        _, chans = base(mlp, ratio, mlp_total, mode=mode)
        return heads, chans

    return allocate


def _lowest(scores: torch.Tensor | None, k: int) -> list[int]:
    if scores is None or k <= 0:
        return []
    return sorted(torch.sort(scores.detach().double().cpu(), stable=True).indices[:k].tolist())


def _split_allocate(attn_mode: str, mlp_mode: str):
    """Allocation with the attention / MLP budget split of the global allocation at the same ratio, each part then
    spread per layer (the global ranking within the part) or uniformly (the same number of KV groups / channels in
    every layer, the weakest by score); the MLP takes whatever the attention part leaves of the total."""
    base = global_allocate

    def allocate(units, ratio, total_cost, mode="global", head_weight=1.0):
        heads, chans = base(units, ratio, total_cost, mode="global")
        attn = sum(len(h) * u.head_cost for h, u in zip(heads, units))
        if attn_mode == "uniform":
            live = [u for u in units if u.head_scores is not None]
            k = round(attn / sum(u.head_cost for u in live)) if live else 0
            heads = [_lowest(u.head_scores, min(k, u.max_head_units)) for u in units]
            attn = sum(len(h) * u.head_cost for h, u in zip(heads, units))
        mlp_budget = ratio * total_cost - attn
        if mlp_mode == "uniform":
            live = [u for u in units if u.channel_scores is not None]
            n = round(mlp_budget / sum(u.channel_cost for u in live)) if live else 0
            chans = [_lowest(u.channel_scores, min(n, u.max_channels)) for u in units]
        else:
            mlp = [LayerUnits(None, 0.0, 0, u.channel_scores, u.channel_cost, u.max_channels) for u in units]
            _, chans = base(mlp, max(mlp_budget, 0.0) / total_cost, total_cost, mode="global")
        return heads, chans

    return allocate


def _block_allocate(block: int):
    """Allocation with MLP channels removed in blocks (`allocate_channel_blocks`; attention not pruned)."""

    def allocate(units, ratio, total_cost, mode="global", head_weight=1.0):
        scores = [u.channel_scores for u in units]
        chans = allocate_channel_blocks(scores, [u.channel_cost for u in units], ratio * total_cost, block)
        return [[] for _ in units], chans

    return allocate


_INFLUENCE: dict[int, list[float]] = {}


@torch.no_grad()
def attention_influence(model, spec, ids: torch.Tensor, windows: int = 8) -> list[float]:
    """Per layer, `1 − mean_t cos(h_t, h_t + a_t)`: how much the attention sublayer turns the residual stream (the
    block influence of ShortGPT, on the attention alone), over the first `windows` calibration windows."""
    key = id(model)
    if key in _INFLUENCE:
        return _INFLUENCE[key]
    layers = get_layers(model, spec)
    seen: dict[int, torch.Tensor] = {}
    sums = [0.0] * len(layers)
    count = 0

    def before(i):
        return lambda mod, args: seen.__setitem__(i, args[0].double())

    def after(i):
        def hook(mod, args):
            sums[i] += float((1 - torch.nn.functional.cosine_similarity(seen[i], args[0].double(), dim=-1)).sum())

        return hook

    handles = [layer.input_layernorm.register_forward_pre_hook(before(i)) for i, layer in enumerate(layers)]
    handles += [layer.post_attention_layernorm.register_forward_pre_hook(after(i)) for i, layer in enumerate(layers)]
    try:
        for row in ids[:windows]:
            model(input_ids=row[None], use_cache=False)
            count += row.numel()
    finally:
        for h in handles:
            h.remove()
    _INFLUENCE[key] = [x / count for x in sums]
    return _INFLUENCE[key]


def _noop_allocate(k: int, influence: list[float], block: int):
    """Allocation removing the attention of the `k` layers (never layer 0) whose attention turns the residual stream
    least (`attention_influence`), and MLP channels in blocks for the rest of the budget."""

    def allocate(units, ratio, total_cost, mode="global", head_weight=1.0):
        order = sorted(range(1, len(units)), key=lambda i: influence[i])[:k]
        heads = [list(range(u.head_scores.numel())) if i in order else [] for i, u in enumerate(units)]
        attn = sum(u.head_cost * u.head_scores.numel() for i, u in enumerate(units) if i in order)
        scores = [u.channel_scores for u in units]
        costs = [u.channel_cost for u in units]
        chans = allocate_channel_blocks(scores, costs, max(ratio * total_cost - attn, 0.0), block)
        return heads, chans

    return allocate


def _budget_allocate(layer_ratios: list[float], layer_totals: list[float]):
    """Allocation by the library's per-layer budgets (`allocate_per_layer`) with the given ratios."""

    def allocate(units, ratio, total_cost, mode="global", head_weight=1.0):
        return allocate_per_layer(units, layer_ratios, layer_totals)

    return allocate


def owl_norms(st: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Per-channel input norms `‖X_j‖` (root mean square over the tokens) of `owl_inputs` from the cached statistics."""
    return {
        "attn_in": (st["attn_in"].sumsq.double() / st["attn_in"].count).sqrt(),
        "mlp_in": (st["mlp_in"].sumsq.double() / st["mlp_in"].count).sqrt(),
        "attn_out": st["attn"].gram.gram.double().diagonal().sqrt(),
        "mlp_out": st["mlp"].gram.gram.double().diagonal().sqrt(),
    }


def _removed_fractions(dense, spec, model) -> list[float]:
    return [1 - after / before for before, after in zip(_layer_sizes(dense, spec), _layer_sizes(model, spec))]


class _Variant:
    """A structured pruner that scores the cached dense statistics and allocates with `strategy` (default: its own):
    `strategy(units, ratio, total_cost, mode=..., head_weight=...)` takes the place of the global / uniform allocation
    of `functional.allocation.allocate` (OWL's per-layer budgets are left as they are)."""

    def __init__(self, config, stats, opts, strategy=None) -> None:
        super().__init__(config)
        self.stats, self.opts, self.strategy = stats, opts, strategy
        self.key = "moments" if isinstance(config, FLAPConfig) else "gram"

    def own(self, i: int) -> dict[str, Any]:
        return {k: getattr(self.stats[i][k], self.key) for k in ("attn", "mlp")}

    def given_scores(self, views):  # the dense statistics, already collected: score them, keep them
        scores = {v.index: self.score_layer(v, self.own(v.index)) for v in views}
        outliers = {}
        if self.config.allocation == "owl":
            outliers = {
                v.index: layer_outlier_fraction(v, owl_norms(self.stats[v.index]), self.config.owl_threshold)
                for v in views
            }
        return {v.index: self.own(v.index) for v in views}, scores, outliers

    def allocate(self, views, units, outliers, total, info):
        if self.strategy is None or self.config.allocation == "owl":
            return super().allocate(views, units, outliers, total, info)
        mode = "literal" if getattr(self.config, "ranking", "cost_weighted") == "literal" else self.config.allocation
        info["allocation"] = mode
        head_weight = 4.0 * views[0].head_dim / 3.0
        return self.strategy(units, self.config.pruning_ratio, total, mode=mode, head_weight=head_weight)


class _FLAPVariant(_Variant, FLAPPruner):
    pass


class _NPVariant(_Variant, NumericalPruner):
    def score_layer(self, view, stats):
        if "mix" in self.opts:  # (1 − w)·FLAP's metric + w·the numerical scores, both standardised per module
            w = self.opts["mix"]
            fluct = NumericalPruner(dataclasses.replace(self.config, scores="fluctuation"))
            numer = NumericalPruner(dataclasses.replace(self.config, scores="numerical"))
            pairs = zip(fluct.score_layer(view, stats), numer.score_layer(view, stats))
            return tuple(None if a is None else (1 - w) * a.double().cpu() + w * b.double().cpu() for a, b in pairs)
        if self.opts.get("scores_from") == "flap":  # FLAP's scores (its config's defaults), this method's compensation
            flap = FLAPPruner(FLAPConfig(pruning_ratio=self.config.pruning_ratio))
            return flap.score_layer(view, {k: self.stats[view.index][k].moments for k in ("attn", "mlp")})
        return super().score_layer(view, stats)

    def channel_scores(self, W, st, unit_size=1):
        if self.opts.get("centred_scores"):  # numerical scores on the covariance (the objective with an intercept)
            mu = st.mean.double()
            st = SimpleNamespace(gram=st.gram.double() - torch.outer(mu, mu))
        return super().channel_scores(W, st, unit_size)


def _make_pruner(variants, name, ratio, round_to, stats, strategy):
    cls, kwargs, opts, _ = variants[name]
    # the study's variants are per-layer unless they name an allocation (NP's own default is "auto")
    config = cls(**{"pruning_ratio": ratio, "round_to": round_to, "allocation": "global", **kwargs})
    return (_FLAPVariant if cls is FLAPConfig else _NPVariant)(config, stats, opts, strategy)


@torch.no_grad()
def prune_variant(variants, dense, spec, name, ratio, round_to, stats, calib_ids, pool_totals):
    """A pruned copy of `dense`, the seconds its plan took, per-layer shapes, its config and extra info."""
    _, _, opts, _ = variants[name]
    info: dict[str, Any] = {}
    strategy = None
    if opts.get("pools"):
        strategy = _pooled_allocate(*pool_totals)
    elif opts.get("split"):
        strategy = _split_allocate(*opts["split"])
    elif opts.get("noop_attention") is not None:
        influence = attention_influence(dense, spec, calib_ids)
        info["attention_influence"] = influence
        strategy = _noop_allocate(opts["noop_attention"], influence, 256)
    elif opts.get("mlp_blocks"):
        strategy = _block_allocate(opts["mlp_blocks"])
    elif opts.get("budgets_from"):
        other = prune_variant(
            variants, dense, spec, opts["budgets_from"], ratio, round_to, stats, calib_ids, pool_totals
        )[0]
        info["layer_ratios"] = ratios = _removed_fractions(dense, spec, other)
        strategy = _budget_allocate(ratios, _layer_sizes(dense, spec))
    model = copy.deepcopy(dense)
    t0 = time.perf_counter()
    pruner = _make_pruner(variants, name, ratio, round_to, stats, strategy)
    pruner.validate(model, spec)
    runner = None
    if getattr(pruner.config, "compensation_inputs", "dense") == "sequential":
        runner = lambda: LayerwiseRunner(model, spec, calib_ids, batch_size=8)  # noqa: E731
    plan = run_pass([pruner], Stage(model, spec, runner))
    info.update({k: plan.info[k] for k in ("layer_ratios", "outlier_fractions") if k in plan.info})
    layers = get_layers(model, spec)
    for idx, lp in plan.layers.items():
        apply_layer_plan_(layer_view(layers[idx], idx, spec, model.config), lp, mode="remove")
    views = [layer_view(layer, i, spec, model.config) for i, layer in enumerate(layers)]
    shapes = {v.index: [v.num_heads, v.intermediate_size] for v in views}
    return model, time.perf_counter() - t0, shapes, pruner.config.to_dict(), info
