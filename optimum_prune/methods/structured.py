"""`StructuredPruner`: the hooks shared by the head / KV-group / MLP-channel methods (NP, FLAP, magnitude), which
plug into the pipeline's score → allocate → apply pass kind (`pipeline.passes.structured`):

  - score: `block_stats(view)` names the module inputs to observe (`layer_stats`, and OWL's per-channel input norms
    where the allocation is OWL); `score_block` turns what the pipeline fed them into per-query-head and per-channel
    scores (lower = removed first) and OWL's outlier fraction;
  - allocate: `decide` groups heads into units (whole KV groups, or query-head ranks inside groups) with parameter
    costs, and the allocation strategy (`allocate`: global cost-weighted ranking, uniform, OWL's per-layer budgets,
    the servable MLP blocks; `functional.allocation`) picks the units to remove: one `LayerPlan` per block;
  - apply: `finalize_layer` writes the compensated weights / biases of the kept units into the block's plan.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..calibration.stats import SquaredNormStats
from ..config import StructuredPruningConfig
from ..functional.allocation import (
    LayerUnits,
    allocate,
    allocate_per_layer,
    allocate_servable,
    outlier_fraction,
    owl_layer_ratios,
    round_kept_channels,
)
from ..modeling.architectures import ArchitectureSpec, LayerView, get_layers, layer_view, weight_oi
from ..modeling.decilm import FFN_MULTIPLE, servable_problems
from ..modeling.shapes import attention_mlp_params, head_costs, layer_params, mlp_channel_cost
from ..plan import LayerPlan
from .base import BasePruner, refuse_pruned_head_dims

__all__ = [
    "StructuredPruner",
    "resolve_gqa_mode",
    "layer_outlier_fraction",
    "owl_inputs",
]

logger = logging.getLogger(__name__)


def owl_inputs(view: LayerView) -> dict[str, tuple[nn.Module, tuple[str, ...]]]:
    """`{name: (module whose input is observed, projections reading that input)}` for OWL's outlier ratio."""
    spec = view.spec
    return {
        "attn_in": (view.module(spec.qkv_paths[0]), tuple(dict.fromkeys(spec.qkv_paths))),
        "attn_out": (view.o_proj, (spec.o_path,)),
        "mlp_in": (view.module(spec.mlp_in_paths[0]), tuple(spec.mlp_in_paths)),
        "mlp_out": (view.mlp_out, (spec.mlp_out_path,)),
    }


def layer_outlier_fraction(view: LayerView, norms: dict[str, torch.Tensor], threshold: float) -> float:
    """OWL's outlier ratio of one layer from the per-channel input norms `‖X_j‖` of `owl_inputs`."""
    metrics = []
    for name, (_, paths) in owl_inputs(view).items():
        for path in paths:
            W = weight_oi(view.module(path)).detach().double()  # (d_out, D)
            metrics.append(W.abs() * norms[name].to(W)[None])  # Wanda's |W_ij|·‖X_j‖
    return outlier_fraction(metrics, threshold)


def resolve_gqa_mode(mode: str, view: LayerView) -> str:
    if view.num_kv_heads == view.num_heads:
        return "group"  # MHA: a group is one head
    if mode == "auto":
        return "query" if view.num_kv_heads == 1 else "group"
    if mode == "group" and view.num_kv_heads == 1:
        raise ValueError(
            f"Layer {view.index} has a single KV head: removing a whole KV group would remove all of its attention. "
            "Use gqa_mode='query' (or 'auto') to prune query heads inside the group."
        )
    return mode


class StructuredPruner(BasePruner):
    """Base of the structured methods; see the module docstring for the lifecycle."""

    structured = True
    config: StructuredPruningConfig

    # -------------------------------------------------------------------------------------------- method hooks
    def layer_stats(self, view: LayerView) -> dict[str, tuple[nn.Module, Any]]:
        """`{name: (module, accumulator)}`: accumulators with `.update(x)` fed with the module's inputs."""
        return {}

    def score_layer(self, view: LayerView, stats: dict[str, Any]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`(head_scores (H,), channel_scores (I,))`, lower = pruned first."""
        raise NotImplementedError

    def finalize_layer(self, view: LayerView, stats: dict[str, Any], plan: LayerPlan) -> None:
        """Fill `plan.weights` / `plan.biases` (compensation). Default: nothing."""

    def keep_stats(self) -> bool:
        """Whether `finalize_layer` needs the statistics (else they are freed after scoring)."""
        return False

    # ---------------------------------------------------------------------------------------------- pipeline
    pass_kind = "structured"

    def validate(self, model: nn.Module, spec: ArchitectureSpec) -> None:
        super().validate(model, spec)
        n = len(get_layers(model, spec))
        if self.config.allocation == "owl" and not self.requires_calibration:
            raise ValueError(
                f"allocation='owl' sets each layer's budget from its activation outliers, which needs calibration "
                f"data; {type(self.config).__name__} is data-free. Use allocation='global' or 'uniform'."
            )
        bad = [i for i in self.config.skip_layers if not 0 <= i < n]
        if bad:
            raise ValueError(f"skip_layers {bad} out of range: the model has {n} layers (0..{n - 1}).")
        if spec.moe is not None and self.config.prune_mlp:
            raise ValueError(
                f"{type(model).__name__} is a mixture-of-experts model: its MLP is its experts, which ExpertConfig "
                "prunes (whole experts and channels inside them). Set prune_mlp=False to prune only the attention "
                "here (in a recipe with ExpertConfig for the experts). Nothing was changed."
            )
        if self.config.prune_attention and not spec.heads_prunable:
            raise ValueError(
                f"The heads of {model.config.model_type} cannot be removed exactly (q/k norms spanning every head, or "
                "per-head attention sinks): set prune_attention=False. Nothing was changed."
            )
        if self.config.prune_attention:
            refuse_pruned_head_dims(model, spec, "removing attention heads")
        if self.config.allocation == "servable":
            problems = servable_problems(model, spec, self.config.skip_layers)
            if self.config.adds_biases:
                problems.append(f"{type(self.config).__name__} is set to add biases (turn its bias refit off)")
            if problems:
                own = getattr(self.config, "own_allocation", None)  # (ServingConfig: servable shapes only)
                what = type(self.config).__name__ if own else "allocation='servable'"
                fix = (
                    f"{what} writes nothing else: prune this model with NumericalConfig(allocation='global') "
                    "(optimum-prune's per-layer format) or allocation='uniform' (a stock checkpoint every engine loads)"
                    if own
                    else "Use allocation='global' (optimum-prune's per-layer format) or 'uniform' (a stock checkpoint "
                    "every engine loads)"
                )
                raise ValueError(
                    f"{what} makes shapes the DeciLM format holds (vLLM, SGLang, TensorRT-LLM, MLX, llama.cpp), but "
                    f"{'; '.join(problems)}. {fix}. Nothing was changed."
                )
        for i, layer in enumerate(get_layers(model, spec)):
            mode = resolve_gqa_mode(self.config.gqa_mode, layer_view(layer, i, spec, model.config))
            if mode == "query" and spec.fused_qkv:
                raise ValueError("gqa_mode='query' needs separate q/k/v projections.")

    def resolve_config(self, model: nn.Module, spec: ArchitectureSpec) -> StructuredPruningConfig:
        """`allocation="auto"` resolved for `model` (`_auto_allocation`)."""
        cfg = self.config
        if cfg.allocation == "auto":
            cfg = replace(cfg, allocation=self._auto_allocation(cfg, model, spec))
        return cfg

    def _auto_allocation(self, cfg: StructuredPruningConfig, model: nn.Module, spec: ArchitectureSpec) -> str:
        """`allocation="auto"` resolved for `model`: `"servable"` where the DeciLM format can hold the result (a
        llama / mistral model whose MLP widths are multiples of 256, no bias asked for, the ratio reachable by MLP
        blocks alone, an allocation the method leaves to the config), else `"global"`; the reason is logged."""
        why = servable_problems(model, spec, cfg.skip_layers)
        servable = replace(cfg, allocation="servable")
        if servable.allocation_mode != "servable":
            why.append(servable.own_allocation)
        if not cfg.prune_mlp:
            why.append("prune_mlp=False (the format's allocation removes MLP channels only)")
        if servable.adds_biases:
            why.append(f"{type(cfg).__name__} is set to add biases")
        if not why:
            block = math.lcm(cfg.round_to, FFN_MULTIPLE)
            views = [layer_view(layer, i, spec, model.config) for i, layer in enumerate(get_layers(model, spec))]
            reachable = sum((v.intermediate_size - block) * mlp_channel_cost(v) for v in views
                            if v.index not in cfg.skip_layers and v.intermediate_size > block)  # fmt: skip
            if cfg.pruning_ratio * attention_mlp_params(model, spec) > reachable:
                why.append(f"pruning_ratio={cfg.pruning_ratio} needs more than the MLP channels above one block")
        if why:
            logger.info("allocation='auto': per-layer shapes ('global'), since %s", "; ".join(why))
            return "global"
        logger.info("allocation='auto': shapes the DeciLM format holds ('servable'; vLLM, SGLang, llama.cpp, MLX)")
        return "servable"

    @property
    def refit_inputs(self) -> str:
        """On which inputs the kept weights are refitted: `"dense"` (the dense model's, in the apply pass) or
        `"sequential"` (the pruned network's, in the pipeline's sequential refit pass, whose hooks the pruner then
        implements: `refit_targets`, `refit_stats`, `refit_projection`)."""
        return "dense"

    def given_scores(self, views: list[LayerView]) -> tuple[dict, dict, dict] | None:
        """`(statistics per block, (head scores, channel scores) per block, OWL outlier fraction per block)` to use
        instead of the pipeline's scoring pass, e.g. scored from statistics gathered elsewhere. Default: `None` (the
        pass runs)."""
        return None

    def block_stats(self, view: LayerView, scoring: bool = True) -> dict[str, tuple[nn.Module, Any]]:
        """`{name: (module, accumulator)}` the pipeline feeds with the module's inputs on one block: `layer_stats`,
        and (`scoring`, OWL allocation) the per-channel input norms of every projection, as `"owl:<input>"`."""
        stats = self.layer_stats(view)
        if scoring and self.config.allocation == "owl":
            for name, (mod, _) in owl_inputs(view).items():
                stats["owl:" + name] = (mod, SquaredNormStats(weight_oi(mod).shape[1]))
        return stats

    def score_block(self, view: LayerView, acc: dict[str, Any]):
        """`(head scores, channel scores, OWL outlier fraction or None)` of one block from its fed accumulators
        (`block_stats`); the OWL accumulators are removed from `acc`."""
        outlier = None
        if self.config.allocation == "owl":
            norms = {}
            for name in owl_inputs(view):
                a = acc.pop("owl:" + name)
                norms[name] = (a.sumsq / max(a.count, 1)).sqrt()
            outlier = layer_outlier_fraction(view, norms, self.config.owl_threshold)
        head, chan = self.score_layer(view, acc)
        return head, chan, outlier

    def _head_units(self, view: LayerView, head_scores: torch.Tensor):
        """Group per-query-head scores into removable units; returns (unit scores, unit cost, members, max units)."""
        mode = resolve_gqa_mode(self.config.gqa_mode, view)
        h, kv, g = view.num_heads, view.num_kv_heads, view.group_size
        per_q_head, cost = head_costs(view)
        scores = head_scores.detach().double().cpu().view(kv, g)
        if mode == "group":
            members = [list(range(j * g, (j + 1) * g)) for j in range(kv)]
            max_units = min(kv - 1, (h - self.config.min_heads_per_layer) // g)
            return scores.mean(1), cost, members, max(max_units, 0)
        order = torch.sort(scores, dim=1, stable=True).indices  # (kv, g) heads of each group, ascending
        members = [[int(grp * g + order[grp, r]) for grp in range(kv)] for r in range(g)]
        unit_scores = torch.sort(scores, dim=1, stable=True).values.mean(0)  # (g,) nondecreasing
        max_units = min(g - 1, (h - self.config.min_heads_per_layer) // kv)
        return unit_scores, kv * per_q_head, members, max(max_units, 0)

    def _units(self, views: list[LayerView], scores: dict) -> tuple[list[LayerUnits], dict[int, list]]:
        """Every layer's removable units (heads or KV groups, MLP channels) with their scores and costs, and the query
        heads of each head unit."""
        cfg = self.config
        units, members = [], {}
        for view in views:
            if view.index not in scores:
                units.append(LayerUnits(None, 0.0, 0, None, 0.0, 0))
                continue
            head_s, chan_s = scores[view.index]
            hu = (None, 0.0, [], 0)
            if cfg.prune_attention and head_s is not None:
                hu = self._head_units(view, head_s)
                members[view.index] = hu[2]
            cc = 0.0
            if cfg.prune_mlp and chan_s is not None:
                cc = mlp_channel_cost(view)
            units.append(
                LayerUnits(
                    hu[0],
                    float(hu[1]),
                    hu[3],
                    chan_s if cfg.prune_mlp else None,
                    cc,
                    max(view.intermediate_size - cfg.min_mlp_channels_per_layer, 0),
                )
            )
        return units, members

    def allocate(self, views: list[LayerView], units: list[LayerUnits], outliers: dict[int, float], total: float,
                 info: dict) -> tuple[list[list[int]], list[int]]:  # fmt: skip
        """The allocation strategy: which units of every layer go, as `(removed head units per layer, removed channel
        count per layer)` (`functional.allocation`). Default: the config's `allocation` (global cost-weighted
        ranking, uniform, or OWL's per-layer budgets, or the config's own, `allocation_mode`: e.g. the
        `ranking="literal"` threshold of NP's paper). Override it in a subclass for another strategy; `info` goes to
        the report."""
        cfg = self.config
        mode = cfg.allocation_mode
        info["allocation"] = mode
        if mode == "owl":
            return self._owl_allocate(views, units, outliers, total, info)
        if mode == "servable":
            return allocate_servable(units, cfg.pruning_ratio, total, math.lcm(cfg.round_to, FFN_MULTIPLE))
        head_weight = 4.0 * views[0].head_dim / 3.0
        return allocate(units, cfg.pruning_ratio, total, mode=mode, head_weight=head_weight)

    def _owl_allocate(self, views, units, outliers, total, info):
        """Per-layer budgets around the ratio of the prunable layers, shifted by OWL's outlier fractions."""
        cfg = self.config
        pruned = [v.index for v in views if v.index in outliers]
        sizes = [layer_params(v) for v in views]
        mean_ratio = cfg.pruning_ratio * total / sum(sizes[i] for i in pruned)  # skipped layers keep everything
        layer_ratio = dict(zip(pruned, owl_layer_ratios([outliers[i] for i in pruned], mean_ratio, cfg.owl_lambda)))
        ratios = [layer_ratio.get(v.index, 0.0) for v in views]
        info["layer_ratios"], info["outlier_fractions"] = ratios, [outliers.get(v.index) for v in views]
        logger.info("OWL layer ratios: %s", [round(r, 3) for r in ratios])
        return allocate_per_layer(units, ratios, sizes)

    def _layer_plan(self, view: LayerView, units: LayerUnits, members, removed_heads, removed_channels) -> LayerPlan:
        """The kept heads / KV heads / channels of one block, from the allocation (no weights read)."""
        lp, i = LayerPlan(), view.index
        if members is not None and removed_heads[i]:
            gone = {h for u in removed_heads[i] for h in members[u]}
            lp.keep_heads = [h for h in range(view.num_heads) if h not in gone]
            kv_alive = sorted({h // view.group_size for h in lp.keep_heads})
            groups_intact = all(
                all(h in lp.keep_heads for h in range(j * view.group_size, (j + 1) * view.group_size))
                for j in kv_alive
            )
            lp.keep_kv_heads = kv_alive if (groups_intact and len(kv_alive) < view.num_kv_heads) else None
            if lp.keep_kv_heads is None and len(lp.keep_heads) % view.num_kv_heads:
                raise RuntimeError("internal error: uneven query heads per KV group")
        if units.channel_scores is not None and removed_channels[i]:
            drop = set(removed_channels[i])
            if self.config.allocation != "servable":  # (servable: whole blocks already)
                drop = set(round_kept_channels(units.channel_scores, removed_channels[i], self.config.round_to,
                                               units.max_channels))  # fmt: skip
            lp.keep_channels = [c for c in range(view.intermediate_size) if c not in drop]
        return lp

    def decide(self, views: list[LayerView], scores: dict, outliers: dict, total: float, info: dict):
        """Allocate: `{block index: LayerPlan}` of every block from the scores of the first pass (no weight read);
        `info` goes to the report."""
        units, members = self._units(views, scores)
        removed_heads, removed_channels = self.allocate(views, units, outliers, total, info)
        return {
            v.index: self._layer_plan(v, units[v.index], members.get(v.index), removed_heads, removed_channels)
            for v in views
        }
