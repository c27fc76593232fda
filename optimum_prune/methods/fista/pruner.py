"""FISTAPruner: orchestration only (math in `functional.py`)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from ...calibration.stats import CrossGramStats, GramStats
from ...functional.masks import keep_mask
from ...modeling.architectures import LayerView, weight_oi
from ..sparsegpt.functional import sparsegpt_prune
from ..unstructured import SequentialPruner, input_groups, write_target
from ..wanda.functional import wanda_scores
from .config import FistaConfig
from .functional import fista_prune, spectral_gram

__all__ = ["FistaPruner"]

logger = logging.getLogger(__name__)

# Below this many calibration tokens per input feature the Grams are nearly rank-deficient: FISTA runs more outer steps
# and overfits the calibration windows (FistaConfig.eps; benchmarks/results/fista_calibration_size.md).
MIN_TOKENS_PER_FEATURE = 10


class FistaPruner(SequentialPruner):
    """FISTAPruner (https://arxiv.org/abs/2404.09773).

    Lifecycle, per decoder layer (its input is the dense model's hidden state by default):
      - keep a dense copy of the layer;
      - for each input group in forward order (q/k/v, o, gate/up, down): run the dense copy and the partially
        pruned layer on the same chunks and accumulate `G = XXᵀ`, `G* = X*X*ᵀ` and `C = XX*ᵀ` (normalised by
        the token count), so that every later projection reconstructs the dense output from the inputs produced
        by the already-pruned earlier ones (intra-layer error correction);
      - per projection: warm start (Wanda or SparseGPT on `G*`), then `fista_prune` in Gram form;
      - the next layer receives the dense (paper) or the pruned outputs.
    """

    config_cls = FistaConfig
    config: FistaConfig

    def _stats(self, run, i: int, dense: nn.Module, layer: nn.Module, dpath: str, first_group: bool):
        n = weight_oi(dense.get_submodule(dpath)).shape[1]
        G, Gs, C = GramStats(n), GramStats(n), CrossGramStats(n)
        paired = self.config.intra_layer_correction and not first_group
        for x, xs in run.paired_inputs(i, dpath, dense, layer if paired else None):
            x, xs = x.float(), xs.float()
            G.update(x)
            Gs.update(xs)
            C.update(x, xs)
        if not getattr(self, "_warned_small", False) and Gs.count < MIN_TOKENS_PER_FEATURE * n:
            self._warned_small = True  # once per pruner (one run)
            logger.warning(
                "FISTA: %d calibration tokens for the %d inputs of %s (fewer than %d per input): FISTA will run more "
                "outer steps, not fewer, and fit these tokens at the expense of held-out text. Use more calibration "
                "tokens (e.g. 32 x 512), or eps=1e-2 (see FistaConfig.eps).",
                Gs.count, n, dpath, MIN_TOKENS_PER_FEATURE,
            )  # fmt: skip
        return G.gram, Gs.gram, C.gram

    def _warm_start(self, W: torch.Tensor, Gs: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        if cfg.warm_start == "sparsegpt":
            return sparsegpt_prune(W, Gs, cfg.sparsity if cfg.nm is None else None, cfg.nm)[0]
        scores = wanda_scores(W, Gs.diagonal().clamp_min(0))  # ‖X*_j‖ up to a common factor
        return W * keep_mask(scores, cfg.sparsity, cfg.nm, per="row")

    needs_dense_layer = True

    @property
    def dense_inter_layer(self) -> bool:
        return self.config.inter_layer == "dense"

    def prune_layer(self, run, view: LayerView, dense: nn.Module) -> dict:
        cfg = self.config
        opts = {
            "lam0": cfg.lam0,
            "xi": cfg.xi,
            "K": cfg.K,
            "tol": cfg.tol,
            "T": cfg.T,
            "eps": cfg.eps,
            "lambda_search": cfg.lambda_search,
            "momentum": cfg.momentum,
            "rounding_per": cfg.rounding_per,
            "reset_bad_counter": cfg.reset_bad_counter,
            "max_outer": cfg.max_outer,
            "spectral": cfg.spectral,
        }
        info = {}
        for gi, paths in enumerate(input_groups(view.spec).values()):
            targets = [t for t in self.targets if t.path in paths]
            if not targets:
                continue
            G, Gs, C = self._stats(run, view.index, dense, view.layer, paths[0], first_group=gi == 0)
            eig = spectral_gram(Gs) if cfg.spectral else None  # shared by the projections of the group
            for t in targets:
                W = weight_oi(dense.get_submodule(t.path)).detach().float()  # (out, in) dense target
                W = W[t.rows(W.shape[0])]
                W0 = self._warm_start(W, Gs)
                W_best, res = fista_prune(
                    W, G, Gs, C, W0, cfg.sparsity if cfg.nm is None else None, cfg.nm, eig=eig, **opts
                )
                write_target(view, t, W_best)
                info[t.key] = {k: res[k] for k in ("error_init", "error_best", "stop_reason", "outer_iterations")}
                info[t.key]["spectral_steps"] = sum(res["spectral"])
        return info
