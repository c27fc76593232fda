"""FISTAPruner: orchestration only (math in `functional.py`)."""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn
from tqdm.auto import tqdm

from ...calibration.stats import CrossGramStats, GramStats
from ...functional.masks import keep_mask
from ...modeling.architectures import ArchitectureSpec, get_layers, layer_view, weight_oi
from ...plan import LayerPlan, PruningPlan
from ..base import RunnerFactory
from ..sparsegpt.functional import sparsegpt_prune
from ..unstructured import SequentialPruner, input_groups
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
        if not self._warned_small and Gs.count < MIN_TOKENS_PER_FEATURE * n:
            self._warned_small = True  # once per run
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

    def compute_plan(self, model: nn.Module, spec: ArchitectureSpec, runner: RunnerFactory | None) -> PruningPlan:
        cfg = self.config
        run = runner()
        plan = PruningPlan()
        self._warned_small = False
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
        for i, layer in enumerate(tqdm(get_layers(model, spec), desc="fista: layers", leave=False)):
            dense = copy.deepcopy(layer)
            view = layer_view(layer, i, spec, model.config)
            info = {}
            for gi, paths in enumerate(input_groups(spec).values()):
                G, Gs, C = self._stats(run, i, dense, layer, paths[0], first_group=gi == 0)
                eig = spectral_gram(Gs) if cfg.spectral else None  # shared by the projections of the group
                for path in paths:
                    W = weight_oi(dense.get_submodule(path)).detach().float()  # (out, in) dense target
                    W0 = self._warm_start(W, Gs)
                    W_best, res = fista_prune(
                        W, G, Gs, C, W0, cfg.sparsity if cfg.nm is None else None, cfg.nm, eig=eig, **opts
                    )
                    self._write(view, path, W_best)
                    info[path] = {k: res[k] for k in ("error_init", "error_best", "stop_reason", "outer_iterations")}
                    info[path]["spectral_steps"] = sum(res["spectral"])
            plan.layers[i] = LayerPlan(info=info)
            nxt = dense if cfg.inter_layer == "dense" else None
            run.advance(run.run_layer(i, layer=nxt))
            del dense
        return plan
