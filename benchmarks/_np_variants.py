"""Allocation variants of the NP study (`benchmarks/np_allocation.py`): the library's pruners run on statistics
collected once, with the allocation swapped where a variant asks for it (separate attention / MLP pools, per-layer
budgets: outlier-weighted in the spirit of OWL, or copied from another method's plan)."""

from __future__ import annotations

import contextlib
import copy
import time
from types import SimpleNamespace
from typing import Any

import torch

import optimum_prune.methods.structured as structured_mod
from optimum_prune.calibration.sequential import LayerwiseRunner
from optimum_prune.functional.allocation import LayerUnits
from optimum_prune.methods.flap import FLAPConfig, FLAPPruner
from optimum_prune.methods.numerical import NumericalPruner
from optimum_prune.modeling.architectures import get_layers, layer_view, weight_oi
from optimum_prune.modeling.surgery import apply_layer_plan_

__all__ = ["layer_params", "owl_layer_ratios", "prune_variant"]


def layer_params(model, spec) -> list[float]:
    """Attention + MLP projection parameters of every decoder layer."""
    return [
        float(
            sum(p.numel() for path in spec.linear_paths for p in layer.get_submodule(path).parameters(recurse=False))
        )
        for layer in get_layers(model, spec)
    ]


def _pooled_allocate(attn_total: float, mlp_total: float):
    """`allocate` with attention and MLP as separate pools, each losing `ratio` of its own parameters."""
    base = structured_mod.allocate

    def allocate(units, ratio, total_cost, mode="global", head_weight=1.0):
        att = [LayerUnits(u.head_scores, u.head_cost, u.max_head_units, None, 0.0, 0) for u in units]
        mlp = [LayerUnits(None, 0.0, 0, u.channel_scores, u.channel_cost, u.max_channels) for u in units]
        heads, _ = base(att, ratio, attn_total, mode=mode)
        _, chans = base(mlp, ratio, mlp_total, mode=mode)
        return heads, chans

    return allocate


def _per_layer_allocate(layer_ratios: list[float], layer_totals: list[float]):
    """`allocate` with a budget per layer: layer l loses `layer_ratios[l]` of its parameters, its heads and channels
    ranked together by the method's scores."""
    base = structured_mod.allocate

    def allocate(units, ratio, total_cost, mode="global", head_weight=1.0):
        heads, chans = [], []
        for u, r, total in zip(units, layer_ratios, layer_totals):
            h, c = base([u], r, total, mode="global") if r > 0 else ([[]], [[]])
            heads += h
            chans += c
        return heads, chans

    return allocate


def owl_layer_ratios(model, spec, stats, ratio: float, M: float, lam: float) -> tuple[list[float], list[float]]:
    """Per-layer pruning ratios in the spirit of OWL (Yin et al., 2024): a layer's outlier fraction is the share of
    its weights whose Wanda metric `|W_ij|·‖X_j‖` exceeds `M` × the layer's mean; the fractions, rescaled to
    `[0, 2λ]`, raise the kept fraction of outlier-rich layers around `1 − ratio` (the mean ratio stays `ratio`).

    Returns `(layer ratios, outlier fractions)`."""
    fractions = []
    for i, layer in enumerate(get_layers(model, spec)):
        view, st = layer_view(layer, i, spec, model.config), stats[i]
        norms = {
            "attn_in": (st["attn_in"].sumsq.double() / st["attn_in"].count).sqrt(),
            "mlp_in": (st["mlp_in"].sumsq.double() / st["mlp_in"].count).sqrt(),
            "attn": st["attn"].gram.gram.double().diagonal().sqrt(),
            "mlp": st["mlp"].gram.gram.double().diagonal().sqrt(),
        }
        inputs = [(p, "attn_in") for p in spec.qkv_paths] + [(spec.o_path, "attn")]
        inputs += [(p, "mlp_in") for p in spec.mlp_in_paths] + [(spec.mlp_out_path, "mlp")]
        metric = torch.cat(
            [(weight_oi(view.module(p)).detach().double().abs() * norms[k][None]).flatten() for p, k in inputs]
        )
        fractions.append(float((metric > M * metric.mean()).double().mean()))
    f = torch.tensor(fractions, dtype=torch.float64)
    spread = (f - f.min()) / (f.max() - f.min()).clamp_min(1e-12) * 2 * lam
    density = spread - spread.mean() + (1 - ratio)
    return (1 - density).clamp(0.0, 0.95).tolist(), fractions


def _removed_fractions(dense, spec, model) -> list[float]:
    return [1 - after / before for before, after in zip(layer_params(dense, spec), layer_params(model, spec))]


def _make_pruner(variants, name, ratio, round_to, stats):
    cls, kwargs, opts, _ = variants[name]
    config = cls(pruning_ratio=ratio, round_to=round_to, **kwargs)
    pruner = (FLAPPruner if cls is FLAPConfig else NumericalPruner)(config)
    key = "moments" if cls is FLAPConfig else "gram"

    def own(i: int) -> dict[str, Any]:
        return {k: getattr(stats[i][k], key) for k in ("attn", "mlp")}

    def cached_collect(views, runner):  # the dense statistics, already collected: score them, keep them
        scores = {v.index: pruner.score_layer(v, own(v.index)) for v in views}
        return {v.index: own(v.index) for v in views}, scores

    pruner._collect = cached_collect
    if opts.get("centred_scores"):  # numerical scores on the covariance (the objective with an intercept)
        scores = pruner._scores

        def centred(W, st, unit_size=1):
            mu = st.mean.double()
            return scores(W, SimpleNamespace(gram=st.gram.double() - torch.outer(mu, mu)), unit_size)

        pruner._scores = centred
    return pruner


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@torch.no_grad()
def prune_variant(variants, dense, spec, name, ratio, round_to, stats, calib_ids, pool_totals):
    """A pruned copy of `dense`, the seconds its plan took, per-layer shapes, its config and extra info."""
    _, _, opts, _ = variants[name]
    info: dict[str, Any] = {}
    ctx = contextlib.nullcontext()
    if opts.get("pools"):
        ctx = _patched(structured_mod, "allocate", _pooled_allocate(*pool_totals))
    elif opts.get("owl") or opts.get("budgets_from"):
        if opts.get("owl"):
            ratios, info["outlier_fractions"] = owl_layer_ratios(dense, spec, stats, ratio, *opts["owl"])
        else:
            other = prune_variant(variants, dense, spec, opts["budgets_from"], ratio, round_to, stats, calib_ids,
                                  pool_totals)[0]  # fmt: skip
            ratios = _removed_fractions(dense, spec, other)
        info["layer_ratios"] = ratios
        ctx = _patched(structured_mod, "allocate", _per_layer_allocate(ratios, layer_params(dense, spec)))
    model = copy.deepcopy(dense)
    t0 = time.perf_counter()
    pruner = _make_pruner(variants, name, ratio, round_to, stats)
    pruner.validate(model, spec)
    runner = None
    if getattr(pruner.config, "compensation_inputs", "dense") == "sequential":
        runner = lambda: LayerwiseRunner(model, spec, calib_ids, batch_size=8)  # noqa: E731
    with ctx:
        plan = pruner.compute_plan(model, spec, runner)
    layers = get_layers(model, spec)
    for idx, lp in plan.layers.items():
        apply_layer_plan_(layer_view(layers[idx], idx, spec, model.config), lp, mode="remove")
    views = [layer_view(layer, i, spec, model.config) for i, layer in enumerate(layers)]
    shapes = {v.index: [v.num_heads, v.intermediate_size] for v in views}
    return model, time.perf_counter() - t0, shapes, pruner.config.to_dict(), info
