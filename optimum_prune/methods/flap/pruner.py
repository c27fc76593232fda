"""FLAP pruner: orchestration only."""

from __future__ import annotations

import torch

from ...calibration.stats import MomentStats
from ...functional.fluctuation import bias_compensation, fluctuation_scores
from ...modeling.architectures import LayerView, weight_oi
from ...modeling.surgery import head_rows
from ...plan import LayerPlan
from ..structured import StructuredPruner
from .config import FLAPConfig

__all__ = ["FLAPPruner"]


class FLAPPruner(StructuredPruner):
    """FLAP (https://arxiv.org/abs/2312.11983).

    Lifecycle:
      - layer_stats: per-channel mean / variance of the o_proj and down_proj inputs (dense model, one pass);
      - score_layer: fluctuation metric, standardised per layer; head score = mean over its channels;
      - allocation: global cost-weighted threshold (AL-AM) or uniform;
      - finalize_layer: bias compensation on o_proj / down_proj.
    """

    config_cls = FLAPConfig
    requires_calibration = True
    config: FLAPConfig

    def resolve_config(self, model, spec) -> FLAPConfig:
        return super().resolve_config(model, spec).for_architecture(spec)

    def keep_stats(self) -> bool:
        return self.config.compensates_bias

    def layer_stats(self, view: LayerView):
        out = {}
        if self.config.prune_attention:
            out["attn"] = (view.o_proj, MomentStats(weight_oi(view.o_proj).shape[1]))
        if self.config.prune_mlp:
            out["mlp"] = (view.mlp_out, MomentStats(view.intermediate_size))
        return out

    def score_layer(self, view: LayerView, stats):
        cfg = self.config
        head = chan = None
        if "attn" in stats:
            s = stats["attn"]
            W = weight_oi(view.o_proj).detach().cpu()
            head = fluctuation_scores(
                W, s.mean.cpu(), s.var.cpu(), cfg.metric, cfg.square_attention_metric, cfg.standardize, view.head_dim
            )
        if "mlp" in stats:
            s = stats["mlp"]
            W = weight_oi(view.mlp_out).detach().cpu()
            chan = fluctuation_scores(W, s.mean.cpu(), s.var.cpu(), cfg.metric, standardized=cfg.standardize)
        return head, chan

    def _bias(self, module, stats: MomentStats, keep: torch.Tensor) -> torch.Tensor:
        W = weight_oi(module).detach()
        mask = torch.ones(W.shape[1], dtype=torch.bool)
        mask[keep.cpu()] = False
        b = bias_compensation(W.cpu(), stats.mean.cpu(), mask.nonzero()[:, 0])
        if getattr(module, "bias", None) is not None:
            b = b + module.bias.detach().double().cpu()
        return b.to(W.dtype)

    def finalize_layer(self, view: LayerView, stats, plan: LayerPlan) -> None:
        if not self.config.compensates_bias:
            return
        if plan.keep_heads:  # (a sublayer removed whole keeps no bias)
            keep = head_rows(plan.keep_heads, view.head_dim)
            plan.biases[view.spec.o_path] = self._bias(view.o_proj, stats["attn"], keep)
        if plan.keep_channels:
            keep = torch.as_tensor(plan.keep_channels)
            plan.biases[view.spec.mlp_out_path] = self._bias(view.mlp_out, stats["mlp"], keep)
