"""SparseGPT pruner: orchestration only."""

from __future__ import annotations

import torch

from ...calibration.stats import GramStats
from ...functional.sparsegpt import sparsegpt_prune
from ..unstructured import SequentialPruner
from .config import SparseGPTConfig

__all__ = ["SparseGPTPruner"]


class SparseGPTPruner(SequentialPruner):
    """SparseGPT (https://arxiv.org/abs/2301.00774).

    Lifecycle: input Gram `H = XᵀX` per input group → OBS sweep (mask + update of the remaining columns) per
    projection → pruned outputs feed the next layer.
    """

    config_cls = SparseGPTConfig
    config: SparseGPTConfig

    def make_stats(self, dim: int) -> GramStats:
        return GramStats(dim)

    def prune_weight(self, W: torch.Tensor, stats: GramStats, path: str) -> torch.Tensor:
        cfg = self.config
        W_new, _ = sparsegpt_prune(
            W.float(),
            stats.gram.to(W.device),
            cfg.sparsity if cfg.nm is None else None,
            cfg.nm,
            blocksize=cfg.blocksize,
            percdamp=cfg.percdamp,
        )
        return W_new
