"""FISTAPruner: orchestration only (math in `functional.py`)."""

from __future__ import annotations

import functools
import logging
import time

import torch
from torch import nn

from ...calibration.stats import CrossGramStats, GramStats
from ...distributed import assign_ranks, broadcast_, broadcast_object, rank
from ...functional.masks import keep_mask
from ...modeling.architectures import LayerView, weight_oi
from ..sparsegpt.functional import sparsegpt_prune
from ..unstructured import SequentialPruner, input_groups, write_target
from ..wanda.functional import wanda_scores
from .config import FistaConfig
from .functional import fista_prune, lipschitz_constant, spectral_gram

__all__ = ["FistaPruner"]

logger = logging.getLogger(__name__)

# Below this many calibration tokens per input feature the Grams are nearly rank-deficient: FISTA runs more outer steps
# and overfits the calibration windows (FistaConfig.eps; benchmarks/results/fista_calibration_size.md).
MIN_TOKENS_PER_FEATURE = 10


class FistaPruner(SequentialPruner):
    """FISTAPruner (https://arxiv.org/abs/2404.09773).

    Lifecycle, per decoder layer (its input is the dense model's hidden state by default):
      - keep a dense copy of the layer and run it once over the calibration chunks: the dense-input Gram `G = XXᵀ`
        of every input group (q/k/v, o, gate/up, down), keeping the dense inputs of the groups after the first;
      - for each input group in forward order: run the partially pruned layer up to the group's input (the rest of
        the forward is skipped) and accumulate `G* = X*X*ᵀ` and `C = XX*ᵀ` (all normalised by the token count), so
        that every later projection reconstructs the dense output from the inputs produced by the already-pruned
        earlier ones (intra-layer error correction); the first group has `X* = X`;
      - per group: `L = λ_max(G*)`, and the eigendecomposition of `G*` once a projection's λ first allows spectral
        iterations (shared by the group's projections);
      - per projection: warm start (Wanda or SparseGPT on `G*`), then `fista_prune` in Gram form; its record in
        `report.info["layers"]` has the errors, steps, stop reason and time (`seconds`, `stats_seconds`);
      - the next layer receives the dense (paper) or the pruned outputs.
    """

    config_cls = FistaConfig
    config: FistaConfig

    def _dense_pass(self, run, i: int, dense: nn.Module, paths: list[str], keep: set[str]):
        """One pass of the dense layer copy: the dense-input Gram of every input group, and the dense inputs of the
        groups in `keep` (per chunk), kept for their cross Grams with the pruned-layer inputs."""
        grams = {p: GramStats(weight_oi(dense.get_submodule(p)).shape[1], device=run.device) for p in paths}
        kept: dict[str, list[torch.Tensor]] = {p: [] for p in keep}

        def record(path: str, x: torch.Tensor) -> None:
            x = x.float()
            grams[path].update(x)
            if path in kept:
                kept[path].append(x)

        run.run_layer(i, layer=dense, observe={p: dense.get_submodule(p) for p in paths}, callback=record,
                      keep_outputs=False)  # fmt: skip
        return grams, kept

    def _pruned_stats(self, run, i: int, layer: nn.Module, path: str, dense_x: list[torch.Tensor]):
        """`X* X*ᵀ` and `X X*ᵀ` from the inputs of `path` in the partially pruned layer; each chunk's forward stops at
        `path` (nothing after it is needed)."""
        n = dense_x[0].shape[-1]
        Gs, C = GramStats(n, device=run.device), CrossGramStats(n, device=run.device)  # on the calibration device

        def record(_name: str, xs: torch.Tensor) -> None:
            xs = xs.float()
            Gs.update(xs)
            C.update(dense_x[c], xs)
            raise _StopForward

        for c in range(len(dense_x)):
            try:
                run.run_layer(i, chunks=[c], inputs=[run.hidden[c]], observe={path: layer.get_submodule(path)},
                              callback=record, keep_outputs=False)  # fmt: skip
            except _StopForward:
                pass
        return Gs.gram, C.gram

    def _warn_if_small(self, count: int, n: int, path: str) -> None:
        if not getattr(self, "_warned_small", False) and count < MIN_TOKENS_PER_FEATURE * n:
            self._warned_small = True  # once per pruner (one run)
            logger.warning(
                "FISTA: %d calibration tokens for the %d inputs of %s (fewer than %d per input): FISTA will run more "
                "outer steps, not fewer, and fit these tokens at the expense of held-out text. Use more calibration "
                "tokens (e.g. 32 x 512), and keep the default eps=1e-2 rather than the paper's 1e-3 (see FistaConfig.eps).",
                count, n, path, MIN_TOKENS_PER_FEATURE,
            )  # fmt: skip

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

    def solver_options(self) -> dict:
        """Keyword arguments of `fista_prune` from the config."""
        cfg = self.config
        names = ("lam0", "xi", "K", "tol", "T", "eps", "lambda_search", "momentum", "rounding_per")
        names += ("reset_bad_counter", "max_outer", "spectral", "ridge")
        return {name: getattr(cfg, name) for name in names}

    def prune_layer(self, run, view: LayerView, dense: nn.Module) -> dict:
        cfg = self.config
        opts = self.solver_options()
        groups = []  # (group name, first path, targets), in forward order
        for name, paths in input_groups(view.spec).items():
            targets = [t for t in self.targets if t.path in paths]
            if targets:
                groups.append((name, paths[0], targets))
        # the first group reads the layer input itself (X* = X); later groups see the already-pruned projections
        paired = {path for k, (_, path, _) in enumerate(groups) if k > 0 and cfg.intra_layer_correction}
        t0 = time.perf_counter()
        dense_grams, dense_x = self._dense_pass(run, view.index, dense, [path for _, path, _ in groups], paired)
        dense_s = time.perf_counter() - t0
        info = {}
        for gname, path, targets in groups:
            t0 = time.perf_counter()
            dense_stats = dense_grams.pop(path)
            G = dense_stats.gram  # (n, n)
            if path in paired:
                Gs, C = self._pruned_stats(run, view.index, view.layer, path, dense_x.pop(path))
            else:
                Gs, C = G, G  # X* = X
            self._warn_if_small(dense_stats.count, G.shape[0], path)
            L = lipschitz_constant(Gs, dtype=torch.float32)  # shared by the projections of the group
            eig = functools.cache(lambda Gs=Gs: spectral_gram(Gs))  # computed once, on the first spectral step
            stats_s = time.perf_counter() - t0 + dense_s / len(groups)
            dense_w = []
            for t in targets:
                W = weight_oi(dense.get_submodule(t.path)).detach()
                dense_w.append(W[t.rows(W.shape[0])].to(G.device, torch.float32))  # (out, in) dense target
            # the group's projections are independent given its statistics: with several processes, each solves
            # some of them (balanced by rows) and sends its results to the others
            owners = assign_ranks([W.shape[0] for W in dense_w])
            solved = []
            for W, owner in zip(dense_w, owners, strict=True):
                if owner != rank():
                    solved.append((torch.empty_like(W), None))
                    continue
                t0 = time.perf_counter()
                W0 = self._warm_start(W, Gs)
                W_best, res = fista_prune(
                    W, G, Gs, C, W0, cfg.sparsity if cfg.nm is None else None, cfg.nm, L=L, eig=eig, **opts
                )
                rec = {k: res[k] for k in ("error_init", "error_best", "stop_reason", "outer_iterations")}
                rec.update(spectral_steps=sum(res["spectral"]), seconds=time.perf_counter() - t0)
                rec.update(input_group=gname, stats_seconds=stats_s)
                solved.append((W_best.to(torch.float32).contiguous(), rec))
            for t, (W_best, rec), owner in zip(targets, solved, owners, strict=True):
                write_target(view, t, broadcast_(W_best, owner))
                info[t.key] = broadcast_object(rec, owner)
        return info


class _StopForward(Exception):
    """Raised by a capture hook once the input it needs is recorded: the rest of the layer's forward is skipped."""
