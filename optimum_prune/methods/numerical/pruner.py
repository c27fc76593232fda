"""Numerical Pruning pruner: orchestration only (math in `functional.py`)."""

from __future__ import annotations

import torch

from ...calibration.stats import GramStats
from ...modeling.architectures import LayerView, weight_oi
from ...modeling.surgery import head_rows
from ...plan import LayerPlan
from ..structured import StructuredPruner
from .config import NumericalPruningConfig
from .functional import compensate, numerical_scores, numerical_scores_newton

__all__ = ["NumericalPruner"]


def _standardize(x: torch.Tensor) -> torch.Tensor:
    finite = torch.isfinite(x)
    m, s = x[finite].mean(), x[finite].std().clamp_min(1e-12)
    return torch.where(finite, (x - m) / s, x)


class NumericalPruner(StructuredPruner):
    """Numerical Pruning (https://arxiv.org/abs/2412.12441).

    Lifecycle:
      - layer_stats: Grams of the o_proj and down_proj inputs, from the dense model (one pass);
      - score_layer: closed-form (or Newton) numerical scores; head score = mean over its D_h channels;
      - allocation: global cost-weighted ranking, α = 4·D_h/3 (GQA groups: (2·n_rep+2)·D_h/3);
      - finalize_layer: least-squares compensation of o_proj / down_proj on the kept channels.
    """

    config_cls = NumericalPruningConfig
    requires_calibration = True
    config: NumericalPruningConfig

    def keep_stats(self) -> bool:
        return self.config.compensate

    def layer_stats(self, view: LayerView):
        out = {}
        if self.config.prune_attention:
            out["attn"] = (view.o_proj, GramStats(weight_oi(view.o_proj).shape[1]))
        if self.config.prune_mlp:
            out["mlp"] = (view.mlp_out, GramStats(view.intermediate_size))
        return out

    def _scores(self, W: torch.Tensor, stats: GramStats) -> torch.Tensor:
        cfg, H = self.config, stats.gram.to(W.device)
        if cfg.solver == "newton":
            z = numerical_scores_newton(
                W, H, cfg.pruning_ratio, cfg.lambda_, cfg.newton_iters, damping=cfg.score_damping
            )
        else:
            z = numerical_scores(W, H, cfg.pruning_ratio, cfg.lambda_, damping=cfg.score_damping)
        return _standardize(z) if cfg.standardize_per_layer else z

    def score_layer(self, view: LayerView, stats):
        head = chan = None
        if "attn" in stats:
            z = self._scores(weight_oi(view.o_proj).detach(), stats["attn"])  # (H·D_h,)
            head = z.view(view.num_heads, view.head_dim).mean(1)  # (H,)
        if "mlp" in stats:
            chan = self._scores(weight_oi(view.mlp_out).detach(), stats["mlp"])  # (I,)
        return head, chan

    def finalize_layer(self, view: LayerView, stats, plan: LayerPlan) -> None:
        if not self.config.compensate:
            return
        damp = self.config.compensation_damping
        if plan.keep_heads is not None:
            W = weight_oi(view.o_proj).detach()
            keep = head_rows(plan.keep_heads, view.head_dim).to(W.device)
            plan.weights[view.spec.o_path], res = compensate(W, stats["attn"].gram.to(W.device), keep, damp)
            plan.info["attn_residual"] = res
        if plan.keep_channels is not None:
            W = weight_oi(view.mlp_out).detach()
            keep = torch.as_tensor(plan.keep_channels, device=W.device)
            plan.weights[view.spec.mlp_out_path], res = compensate(W, stats["mlp"].gram.to(W.device), keep, damp)
            plan.info["mlp_residual"] = res
