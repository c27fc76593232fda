"""RIA pruner: orchestration only."""

from __future__ import annotations

import torch

from ...calibration.stats import GramStats, SquaredNormStats
from ...functional.masks import keep_mask
from ...functional.scores import ria_scores
from ...functional.sparsegpt import sparsegpt_prune
from ..unstructured import SequentialPruner
from .config import RIAConfig

__all__ = ["RIAPruner"]


class RIAPruner(SequentialPruner):
    """RIA (Zhang et al., ICLR 2024).

    Lifecycle: running ‖x_j‖² (or the Gram, with reconstruction) → RIA scores → keep mask → zeroed weight
    (optionally OBS-reconstructed on the fixed mask).
    """

    config_cls = RIAConfig
    config: RIAConfig

    def make_stats(self, dim: int):
        return GramStats(dim) if self.config.reconstruction else SquaredNormStats(dim)

    def prune_weight(self, W: torch.Tensor, stats, path: str) -> torch.Tensor:
        cfg = self.config
        sumsq = stats.sum.diagonal() if isinstance(stats, GramStats) else stats.sumsq
        scores = ria_scores(W, sumsq.to(W.device), a=cfg.a)  # (out, in)
        mask = keep_mask(scores, cfg.sparsity, cfg.nm, per=cfg.per)
        if not cfg.reconstruction:
            return W * mask
        W_new, _ = sparsegpt_prune(W.float(), stats.gram.to(W.device), mask=mask)
        return W_new
