"""Expert pruner: orchestration only (math in `functional.py`, surgery in `modeling.experts`)."""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn

from ...calibration.expert_stats import ExpertGramStats, RoutingStats
from ...modeling.architectures import ArchitectureSpec, LayerView, get_layers, layer_view
from ...modeling.experts import check_top_k, remove_experts_, routed_experts
from ...plan import LayerPlan
from ..base import BasePruner
from .config import ExpertConfig
from .functional import expert_saliency, kept_experts, kept_experts_global, kept_width, prune_expert_channels

__all__ = ["ExpertPruner"]

logger = logging.getLogger(__name__)


class ExpertPruner(BasePruner):
    """Expert pruning of mixture-of-experts models: REAP (https://arxiv.org/abs/2510.13999) and baselines for
    whole experts, Numerical Pruning's scores and refit (https://arxiv.org/abs/2412.12441) for channels inside them.

    Lifecycle:
      - one layer-wise pass over the dense model: on each MoE layer, the router's decisions and every routed expert's
        output are recorded (`RoutingStats`), and the experts ranked by `criterion`;
      - `allocation="uniform"`: each layer drops its lowest experts at once; `"global"`: after the pass, the lowest
        of all layers (then a second pass for the channels);
      - with `channel_ratio > 0`: the layer with its experts removed runs again on the same inputs, collecting each
        kept expert's Gram on the tokens now routed to it (`ExpertGramStats`), which ranks its channels and refits
        its down projection.
    """

    config_cls = ExpertConfig
    structured = True
    config: ExpertConfig

    @property
    def requires_calibration(self) -> bool:
        return self.config.criterion != "random" or self.config.channel_ratio > 0

    # ----------------------------------------------------------------------------------------------- validation
    def moe_views(self, model: nn.Module, spec: ArchitectureSpec) -> list[LayerView]:
        views = [layer_view(layer, i, spec, model.config) for i, layer in enumerate(get_layers(model, spec))]
        return [v for v in views if v.is_moe and v.index not in self.config.skip_layers]

    def _removed(self, view: LayerView) -> int:
        return round(self.config.expert_ratio * view.num_experts)

    def _channels_kept(self, view: LayerView) -> int:
        return kept_width(view.intermediate_size, self.config.channel_ratio, self.config.round_to)

    def validate(self, model: nn.Module, spec: ArchitectureSpec) -> None:
        if spec.moe is None:
            raise ValueError(
                f"ExpertConfig prunes mixture-of-experts models; {model.config.model_type} has no experts. Use a "
                "structured method (e.g. NumericalConfig) for its MLP channels."
            )
        super().validate(model, spec)
        cfg, n = self.config, len(get_layers(model, spec))
        bad = [i for i in cfg.skip_layers if not 0 <= i < n]
        if bad:
            raise ValueError(f"skip_layers {bad} out of range: the model has {n} layers (0..{n - 1}).")
        views = self.moe_views(model, spec)
        if not views:
            raise ValueError("No mixture-of-experts layer is left to prune (every one is in skip_layers).")
        for view in views:
            if cfg.allocation == "uniform":
                check_top_k(view, view.num_experts - self._removed(view))
            elif (cfg.min_experts_per_layer or 0) > view.num_experts:
                raise ValueError(f"min_experts_per_layer={cfg.min_experts_per_layer} exceeds layer {view.index}'s "
                                 f"{view.num_experts} experts.")  # fmt: skip
            if cfg.channel_ratio > 0:
                self._check_width(model, view)

    def _check_width(self, model: nn.Module, view: LayerView) -> None:
        kept = self._channels_kept(view)
        if kept < 1:
            raise ValueError(
                f"channel_ratio={self.config.channel_ratio} leaves layer {view.index}'s experts no channel."
            )
        # transformers' default experts kernel (grouped_mm) needs rows of a multiple of 16 bytes
        align = 16 // view.experts.down_proj.element_size()
        if getattr(model.config, "_experts_implementation", None) == "grouped_mm" and kept % align:
            raise ValueError(
                f"Experts of {kept} channels cannot run in transformers' grouped_mm experts kernel, which needs a "
                f"multiple of {align} channels in {view.experts.down_proj.dtype}: set round_to to a multiple of {align} "
                "(the default, 32, is one). Nothing was changed."
            )

    # ----------------------------------------------------------------------------------------------- decisions
    def observe(self, run, view: LayerView, layer: nn.Module | None = None, grams: bool = False):
        """Run block `view.index` (or `layer`, a copy with experts removed) over the calibration chunks, recording
        routing (or, with `grams`, each expert's Gram); returns `(stats, outputs)`."""
        if grams:
            stats = ExpertGramStats(view.num_experts, view.intermediate_size)
        else:
            stats = RoutingStats(view.num_experts)
        weighted = self.config.weighted_refit

        def record(_name: str, x: torch.Tensor) -> None:
            if not grams:
                stats.add_tokens(x)
            for j, _, prob, weight, h, out in routed_experts(view, x):
                if grams:
                    stats.update(j, h, weight if weighted else None)
                else:
                    stats.update(j, prob, weight, out.norm(dim=-1))

        block = view.module(view.spec.mlp)
        outputs = run.run_layer(view.index, layer=layer, observe={"moe": block}, callback=record,
                                keep_outputs=layer is None)  # fmt: skip
        return stats, outputs

    def saliency(self, view: LayerView, stats: RoutingStats | None) -> torch.Tensor:
        sums = stats.sums() if stats is not None else {"routed": torch.zeros(view.num_experts)}
        seed = self.config.seed * 100_003 + view.index
        return expert_saliency(sums, self.config.criterion, self.config.gate, seed)

    def channels(self, run, view: LayerView, plan: LayerPlan, config) -> None:
        """Channels of the kept experts: run the layer with its experts removed, rank and refit per expert."""
        cfg = self.config
        layer = copy.deepcopy(view.layer)
        pruned = layer_view(layer, view.index, view.spec, config)
        if plan.keep_experts is not None:
            remove_experts_(pruned, plan.keep_experts)
        grams, _ = self.observe(run, pruned, layer=layer, grams=True)
        moe = view.spec.moe
        down = view.experts.down_proj.detach()
        new_down = down.clone()
        keep_k, kept, residuals = self._channels_kept(view), [], []
        seen = grams.weight_sum() > 0
        for e, j in enumerate(plan.keep_experts or range(view.num_experts)):
            W = down[j].T if moe.transposed else down[j]  # (H, I)
            gram, mean = (grams.gram(e), grams.mean(e)) if seen[e] else (None, None)
            keep, W_new, res = prune_expert_channels(W, gram, mean, keep_k, cfg.channel_ratio, cfg.channel_scores,
                                                     cfg.compensation_damping, cfg.compensate)  # fmt: skip
            new_down[j] = (W_new.T if moe.transposed else W_new).to(down.dtype)
            kept.append(keep)
            residuals.append(res)
        plan.keep_expert_channels = kept
        if cfg.compensate:
            plan.weights[view.spec.moe_path(f"{moe.experts}.down_proj")] = new_down
        plan.info["channel_residuals"] = residuals

    # ------------------------------------------------------------------------------- hooks of the experts pass
    pass_kind = "experts"

    @property
    def scores_experts(self) -> bool:
        return self.config.expert_ratio > 0

    @property
    def observes_routing(self) -> bool:
        return self.config.criterion != "random"

    @property
    def allocates_globally(self) -> bool:
        return self.config.allocation == "global" and self.config.expert_ratio > 0

    @property
    def prunes_channels(self) -> bool:
        return self.config.channel_ratio > 0

    def plan_info(self) -> dict:
        return {"criterion": self.config.criterion, "allocation": self.config.allocation}

    def global_keep(self, views: list[LayerView], saliency: dict[int, torch.Tensor]) -> dict[int, list[int]]:
        """The experts every block keeps, ranked across all blocks at once."""
        min_keep = self.config.min_experts_per_layer or max(int(v.router.top_k) for v in views)
        return kept_experts_global(saliency, sum(self._removed(v) for v in views), min_keep)

    def layer_keep(self, view: LayerView, saliency: torch.Tensor) -> list[int]:
        return kept_experts(saliency, self._removed(view))
