"""`StructuredPruner`: template shared by the head / KV-group / MLP-channel methods (NP, FLAP, magnitude).

Lifecycle:
  - one dense calibration pass, layer by layer: `layer_stats` says which module inputs to observe, the runner feeds
    them, `score_layer` turns them into per-query-head and per-channel scores (lower = removed first);
  - heads become units (whole KV groups, or query-head ranks inside groups) with parameter costs, and `allocate`,
    the allocation strategy, picks the units to remove (`functional.allocation`: global cost-weighted ranking,
    uniform, or per-layer budgets weighted by each layer's activation outliers, OWL: the same pass then also measures
    each layer's outliers; a subclass may override it);
  - a second pass over the blocks: `finalize_layer` writes the compensated weights / biases of the kept units into a
    `LayerPlan`, and the session finishes the block (a low-memory or checkpointed run writes it at once).
Both passes run through `Stage.walk` (`pipeline.stage`), the one block loop.
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..calibration.stats import SquaredNormStats, feed
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
from ..pipeline.stage import Stage
from ..pipeline.stats_cache import tensor_digest
from ..plan import LayerPlan, PruningPlan
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

    def adds_biases(self) -> bool:
        """Whether `finalize_layer` gives the pruned projections a bias. Default: no."""
        return False

    # ---------------------------------------------------------------------------------------------- framework
    calibration_digest: str | None = None

    def attach_calibration(self, data, description: dict | None = None, source=None) -> None:
        """Records a digest of the calibration ids (part of the key of a `CalibrationStatsCache`)."""
        if isinstance(data, torch.Tensor):
            h = hashlib.sha256()
            tensor_digest(h, data)
            self.calibration_digest = h.hexdigest()

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
        if self.config.allocation == "auto":
            self.config = replace(self.config, allocation=self._auto_allocation(model, spec))
        if self.config.allocation == "servable":
            problems = servable_problems(model, spec, self.config.skip_layers)
            if self.adds_biases():
                problems.append(f"{type(self.config).__name__} is set to add biases (turn its bias refit off)")
            if problems:
                raise ValueError(
                    "allocation='servable' makes shapes the DeciLM format holds (vLLM, SGLang, TensorRT-LLM, MLX, "
                    f"llama.cpp), but {'; '.join(problems)}. Use allocation='global' (optimum-prune's per-layer "
                    "format) or 'uniform' (a stock checkpoint every engine loads). Nothing was changed."
                )
        for i, layer in enumerate(get_layers(model, spec)):
            mode = resolve_gqa_mode(self.config.gqa_mode, layer_view(layer, i, spec, model.config))
            if mode == "query" and spec.fused_qkv:
                raise ValueError("gqa_mode='query' needs separate q/k/v projections.")

    def _auto_allocation(self, model: nn.Module, spec: ArchitectureSpec) -> str:
        """`allocation="auto"` resolved for `model`: `"servable"` where the DeciLM format can hold the result (a
        llama / mistral model whose MLP widths are multiples of 256, no bias asked for, the ratio reachable by MLP
        blocks alone, the cost-weighted ranking), else `"global"`; the reason is logged."""
        cfg = self.config
        why = servable_problems(model, spec, cfg.skip_layers)
        if getattr(cfg, "ranking", "cost_weighted") == "literal":
            why.append("ranking='literal' sets its own allocation")
        if not cfg.prune_mlp:
            why.append("prune_mlp=False (the format's allocation removes MLP channels only)")
        self.config = replace(cfg, allocation="servable")
        if self.adds_biases():
            why.append(f"{type(cfg).__name__} is set to add biases")
        self.config = cfg
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

    def refits_after_plan(self) -> bool:
        """Whether `compute_plan` revisits every block after the allocation pass to refit it (then that pass, not
        the allocation pass, finishes the blocks of a low-memory or checkpointed run)."""
        return False

    def _observe(self, run, view: LayerView, owl: bool = False) -> tuple[dict[str, Any], Any]:
        """Run block `view.index` once, feeding `layer_stats` (and, with `owl`, the per-channel input norms of every
        projection, as `"owl:<input>"`); returns the accumulators and the block's outputs."""
        layer_stats = self.layer_stats(view)
        if owl:
            for name, (mod, _) in owl_inputs(view).items():
                layer_stats["owl:" + name] = (mod, SquaredNormStats(weight_oi(mod).shape[1]))
        outputs = None
        accumulators = {name: a for name, (_, a) in layer_stats.items()}
        if run is not None:
            observe = {name: mod for name, (mod, _) in layer_stats.items()}
            outputs = run.run_layer(view.index, observe=observe, callback=feed(accumulators))
        return accumulators, outputs

    def collect_scores(self, stage: Stage, views: list[LayerView]) -> tuple[dict, dict, dict]:
        """The first pass: `(statistics kept per block, (head scores, channel scores) per block, OWL outlier fraction
        per block)`, from one dense calibration pass over the blocks or from the stage's `stats_cache` (never in an
        active session). Override it to score from statistics gathered elsewhere."""
        cache = stage.stats_cache
        key = None if (cache is None or stage.session.active) else cache.key(self, views)
        if key is None:
            return self._collect_pass(stage, views)
        hit = cache.get(key)
        if hit is not None:
            logger.info("%s: calibration pass reused (%d stored)", self.config.method, len(cache))
            return hit
        result = self._collect_pass(stage, views)
        cache.put(key, result)
        return result

    def _collect_pass(self, stage: Stage, views: list[LayerView]):
        """One dense pass: every block's scores (and its statistics where `keep_stats`) and, for OWL, its outlier
        fraction, on the dense model's inputs. A resumed run reads the finished blocks' scores from the checkpoint."""
        sess = stage.session
        stats, scores, outliers = {}, {}, {}
        owl = self.config.allocation == "owl"
        for v in views:
            cached = sess.cached_scores(v.index)
            if cached is not None:
                scores[v.index] = cached[:2]
                if cached[2] is not None:
                    outliers[v.index] = cached[2]
        todo = [v.index for v in views if v.index not in scores and v.index not in self.config.skip_layers]
        run = stage.runner() if (stage.runner is not None and self.requires_calibration and todo) else None

        def visit(view: LayerView):
            i = view.index
            acc, outputs = self._observe(run, view, owl)
            if owl:
                norms = {}
                for name in owl_inputs(view):
                    a = acc.pop("owl:" + name)
                    norms[name] = (a.sumsq / max(a.count, 1)).sqrt()
                outliers[i] = layer_outlier_fraction(view, norms, self.config.owl_threshold)
            scores[i] = self.score_layer(view, acc)
            sess.save_scores(i, *scores[i], outlier=outliers.get(i))
            if self.keep_stats() and sess.keep_stats(acc):
                stats[i] = {k: (a.to("cpu") if hasattr(a, "to") else a) for k, a in acc.items()}
            return outputs

        stage.walk(todo, visit, run=run, desc=f"{self.config.method}: scoring layers")
        return stats, scores, outliers

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
        ranking, uniform, or OWL's per-layer budgets), the `ranking="literal"` threshold of NP's paper. Override it
        in a subclass for another strategy; `info` goes to the report."""
        cfg = self.config
        mode = getattr(cfg, "ranking", "cost_weighted") == "literal" and "literal" or cfg.allocation
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

    def compute_plan(self, stage: Stage) -> PruningPlan:
        """Score every block (one dense pass), allocate, then finish every block: its compensation, written at once by
        a low-memory or checkpointed run."""
        views = stage.views()
        stats, scores, outliers = self.collect_scores(stage, views)
        units, members = self._units(views, scores)
        info: dict[str, Any] = {}
        removed_heads, removed_channels = self.allocate(
            views, units, outliers, attention_mlp_params(stage.model, stage.spec), info
        )
        plan = PruningPlan(info=info)
        sess = stage.session
        deferred = sess.active and self.refits_after_plan()  # the refit pass decides the weights and finishes
        decided = {
            v.index: self._layer_plan(v, units[v.index], members.get(v.index), removed_heads, removed_channels)
            for v in views
            if not sess.done(v.index)
        }
        for v in views:
            lp = decided.get(v.index) or sess.restored_plan(v.index)
            if lp.structured:
                plan.layers[v.index] = lp
        recompute = set()  # statistics not kept after the first pass (low-memory Grams, a resumed first pass)
        if self.keep_stats() and not deferred:
            recompute = {i for i, lp in decided.items() if lp.structured and i not in stats}
        run = stage.runner() if (stage.runner is not None and recompute) else None
        last = max(recompute, default=-1)

        def visit(view: LayerView):
            i, lp = view.index, decided[view.index]
            layer_stats, outputs = stats.pop(i, {}), None
            if run is not None and i <= last:
                if i in recompute:
                    layer_stats, outputs = self._observe(run, view)
                else:
                    outputs = run.run_layer(i)
            if lp.structured:
                self.finalize_layer(view, layer_stats, lp)
            sess.finish(i, lp)
            return outputs

        todo = [] if deferred else sorted(decided)
        stage.walk(todo, visit, run=run, until=last, desc=f"{self.config.method}: compensating")
        return plan
