"""Wanda pruner: orchestration only."""

from __future__ import annotations

import torch

from ...calibration.stats import SquaredNormStats
from ...functional.masks import keep_mask
from ...functional.scores import wanda_scores
from ..unstructured import SequentialPruner
from .config import WandaConfig

__all__ = ["WandaPruner"]


class WandaPruner(SequentialPruner):
    """Wanda (https://arxiv.org/abs/2306.11695).

    Lifecycle: running ‖x_j‖² per input column → scores `|W|·‖X_j‖` → keep mask per row (or N:M) → zeroed weight.
    """

    config_cls = WandaConfig
    config: WandaConfig

    def make_stats(self, dim: int) -> SquaredNormStats:
        return SquaredNormStats(dim)

    def prune_weight(self, W: torch.Tensor, stats: SquaredNormStats, path: str) -> torch.Tensor:
        scores = wanda_scores(W, stats.sumsq.to(W.device))  # (out, in)
        mask = keep_mask(scores, self.config.sparsity, self.config.nm, per=self.config.per)
        return W * mask
