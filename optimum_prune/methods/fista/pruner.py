"""FISTAPruner: orchestration only (math in `functional.py`)."""

from __future__ import annotations

import functools
import logging
import time

import torch
from torch import nn

from ...calibration.hooks import capture_inputs
from ...calibration.stats import CrossGramStats, GramStats, SquaredNormStats
from ...functional.masks import keep_mask
from ...functional.scores import wanda_scores
from ...functional.sparsegpt import sparsegpt_prune
from ...modeling.access import write_target
from ...modeling.architectures import LayerView, weight_oi
from ...utils.distributed import assign_ranks, broadcast_, broadcast_object, rank
from ..unstructured import SequentialPruner, input_groups
from .config import FISTAConfig
from .functional import fista_prune, lipschitz_constant, shrink_refit, spectral_gram

__all__ = ["FISTAPruner"]

logger = logging.getLogger(__name__)

# Below this many calibration tokens per input feature FISTA fits the calibration text at the expense of other text
# (docs/methods/fista.md, "The paper's setting and our defaults").
MIN_TOKENS_PER_FEATURE = 40


class FISTAPruner(SequentialPruner):
    """FISTAPruner (https://arxiv.org/abs/2404.09773).

    Lifecycle, per decoder layer (its input is the dense model's hidden state by default):
      - keep a dense copy of the layer and run it once over the calibration chunks: the dense-input Gram `G = XXᵀ`
        of every input group (q/k/v, o, gate/up, down), keeping the dense inputs of the groups after the first, and
        the layer's outputs (the next layer's inputs). A group with fewer target rows than inputs (down_proj) keeps
        its dense outputs `W X` instead, and `Σ (W x)²` instead of `G`: the error needs only `tr(W G Wᵀ)` of `G` and
        the gradient only `W C` of `C`, and both cost O(m·n) per token from the outputs against O(n²) from Grams;
      - for each input group in forward order: run the partially pruned layer up to the group's input (the rest of
        the forward is skipped) and accumulate `G* = X*X*ᵀ` and `C = XX*ᵀ` (all normalised by the token count), so
        that every later projection reconstructs the dense output from the inputs produced by the already-pruned
        earlier ones (intra-layer error correction); the first group has `X* = X`. When the next group sits in the
        same submodule as this one (down_proj after gate/up, in the MLP), this pass records that submodule's inputs
        and the next pass runs only the submodule;
      - per group: `L = λ_max(G*)`, and the eigendecomposition of `G*` once a projection's λ first allows spectral
        iterations (shared by the group's projections);
      - per projection: warm start (Wanda or SparseGPT on `G*`), then `fista_prune` in Gram form; its record in
        `report.info["layers"]` has the errors, steps, stop reason and time (`seconds`, `stats_seconds`);
      - with `refit_strength < 1`, once every projection of the layer is solved, each one's kept weights are moved
        back toward the dense ones: `W + s·(W* − W)` on W*'s support;
      - the next layer receives the dense (paper) or the pruned outputs.
    """

    config_cls = FISTAConfig
    config: FISTAConfig

    def _dense_pass(self, run, i: int, dense: nn.Module, paths: list[str], keep: set[str], energy: dict):
        """One pass of the dense layer copy over every chunk: the dense-input Gram of every input group, and the
        dense inputs `x` of the groups in `keep` (per chunk), kept for their cross Grams with the pruned-layer inputs.
        For the groups in `energy` (path -> their targets' stacked dense rows `W`), the per-row `Σ (W x)²` replaces
        the Gram and `W x` replaces `x`: FISTA needs only `tr(W G Wᵀ)` of `G` and `W C` of `C`, and both are cheaper
        from the outputs when `W` has fewer rows than columns. The layer's outputs are kept for the next layer when
        it reads the dense ones."""
        stats = {
            p: SquaredNormStats(energy[p].shape[0]) if p in energy
            else GramStats(weight_oi(dense.get_submodule(p)).shape[1], device=run.device)
            for p in paths
        }  # fmt: skip
        kept: dict[str, list[torch.Tensor]] = {p: [] for p in keep}

        def record(path: str, x: torch.Tensor) -> None:
            x = x.float()
            if path in energy:
                x = x @ energy[path].T  # (..., m) the dense outputs W x
            stats[path].update(x)
            if path in kept:
                kept[path].append(x)

        outputs = run.run_layer(i, layer=dense, observe={p: dense.get_submodule(p) for p in paths}, callback=record,
                                keep_outputs=self.dense_inter_layer)  # fmt: skip
        if self.dense_inter_layer:
            self._dense_outputs = outputs
        return stats, kept

    def _pruned_stats(self, run, i: int, layer: nn.Module, path: str, dense_x: list[torch.Tensor], resume, save):
        """`X* X*ᵀ` and `X X*ᵀ` from the inputs `X*` of `path` in the partially pruned layer and the dense `X` (per
        chunk in `dense_x`; outputs `W X` give `W X X*ᵀ`); each chunk's forward stops at `path` (nothing after it is
        needed).

        `resume = (module, inputs)` runs only `module`, a submodule of the layer, on its inputs recorded per chunk
        by the previous group's pass (nothing before it has changed since). `save` names a submodule whose inputs
        (args, kwargs) this pass records per chunk, returned as the next pass's `resume` (`None` when not asked, or
        when `save` does not run before `path`)."""
        n = weight_oi(layer.get_submodule(path)).shape[1]
        Gs = GramStats(n, device=run.device)  # on the calibration device
        C = CrossGramStats(dense_x[0].shape[-1], device=run.device, dim_star=n)
        saved: list | None = [] if save is not None else None

        def record(_name: str, xs: torch.Tensor) -> None:
            xs = xs.float()
            Gs.update(xs)
            C.update(dense_x[c], xs)
            raise _StopForward

        def save_inputs(_module, args, kwargs) -> None:
            if saved is not None and len(saved) == c:  # the first call of this chunk
                saved.append((args, kwargs))

        handle = layer.get_submodule(save).register_forward_pre_hook(save_inputs, with_kwargs=True) if save else None
        try:
            for c in range(len(dense_x)):
                try:
                    if resume is not None:
                        module, inputs = resume
                        with run.on_device(layer), capture_inputs({path: layer.get_submodule(path)}, record):
                            module(*inputs[c][0], **inputs[c][1])
                    else:
                        run.run_layer(i, chunks=[c], inputs=[run.hidden[c]], observe={path: layer.get_submodule(path)},
                                      callback=record, keep_outputs=False)  # fmt: skip
                except _StopForward:
                    pass
                if saved is not None and len(saved) != c + 1:  # `save` does not run before `path`: nothing to reuse
                    saved = None
        finally:
            if handle is not None:
                handle.remove()
        return Gs.gram, C.gram, (None if saved is None else (layer.get_submodule(save), saved))

    def _warn_if_small(self, count: int, n: int, path: str) -> None:
        if not getattr(self, "_warned_small", False) and count < MIN_TOKENS_PER_FEATURE * n:
            self._warned_small = True  # once per pruner (one run)
            logger.warning(
                "FISTA: %d calibration tokens for the %d inputs of %s (fewer than %d per input): FISTA will fit these "
                "tokens at the expense of text of other kinds. Use more calibration tokens (the default "
                "CalibrationConfig is 128 x 2048), and keep the default eps=1e-2 rather than the paper's 1e-3 (see "
                "FISTAConfig.eps and the FISTA page of the documentation).",
                count, n, path, MIN_TOKENS_PER_FEATURE,
            )  # fmt: skip

    def _warm_start(self, W: torch.Tensor, Gs: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        if cfg.warm_start == "sparsegpt":
            return sparsegpt_prune(W, Gs, cfg.sparsity if cfg.nm is None else None, cfg.nm)[0]
        scores = wanda_scores(W, Gs.diagonal().clamp_min(0))  # ‖X*_j‖ up to a common factor
        return W * keep_mask(scores, cfg.sparsity, cfg.nm, per="row")

    needs_dense_layer = True
    solve_seconds = 0.0  # this process's time in the per-projection solves (warm start, eigendecomposition, FISTA)
    reuse_passes = True  # a pruned pass may start from a submodule's inputs recorded by the previous one

    @property
    def dense_inter_layer(self) -> bool:
        return self.config.inter_layer == "dense"

    def begin(self, model: nn.Module, spec) -> None:
        super().begin(model, spec)
        self.solve_seconds = 0.0

    def pass_info(self) -> dict:
        return {"solve_seconds": self.solve_seconds}

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
        dense_w = {}  # the (out, in) dense rows of every target, in float32 on the calibration device
        for _, _, targets in groups:
            for t in targets:
                W = weight_oi(dense.get_submodule(t.path)).detach()
                dense_w[t.key] = W[t.rows(W.shape[0])].to(run.device, torch.float32)
        # the first group reads the layer input itself (X* = X); later groups see the already-pruned projections
        paired = [path for k, (_, path, _) in enumerate(groups) if k > 0 and cfg.intra_layer_correction]
        energy = {}  # paired groups with fewer target rows than inputs: tr(W G Wᵀ) from ||W X||², not from G
        for _, path, targets in groups:
            rows = torch.cat([dense_w[t.key] for t in targets])  # (m, n)
            if path in paired and rows.shape[0] < rows.shape[1]:
                energy[path] = rows
        t0 = time.perf_counter()
        dense_stats, dense_x = self._dense_pass(run, view.index, dense, [p for _, p, _ in groups], set(paired), energy)
        dense_s = time.perf_counter() - t0
        info, resume, fitted = {}, None, []
        for k, (gname, path, targets) in enumerate(groups):
            t0 = time.perf_counter()
            stats = dense_stats.pop(path)
            if path in paired:
                # the next pass may start from the inputs of the module holding the next group when that module also
                # holds this one (e.g. the MLP: down_proj's pass after gate/up's)
                home = _parent(groups[k + 1][1]) if k + 1 < len(groups) else ""
                save = home if (self.reuse_passes and home and path.startswith(home + ".")) else None
                Gs, C, resume = self._pruned_stats(run, view.index, view.layer, path, dense_x.pop(path), resume, save)
            else:
                Gs = C = stats.gram  # X* = X
            n = Gs.shape[0]
            self._warn_if_small(stats.count, n, path)
            L = lipschitz_constant(Gs, dtype=torch.float32)  # shared by the projections of the group
            if cfg.rounding_score == "wanda":
                opts["rounding_scale"] = Gs.diagonal().clamp_min(0).sqrt()  # (n,) ||X*_j|| up to a common factor
            eig = functools.cache(lambda Gs=Gs: spectral_gram(Gs))  # computed once, on the first spectral step
            stats_s = time.perf_counter() - t0 + dense_s / len(groups)
            W_group = [dense_w[t.key] for t in targets]
            if path in energy:  # per target, tr(W G Wᵀ) and W C from the dense outputs (C holds W X X*ᵀ here)
                sizes = [W.shape[0] for W in W_group]
                sumsq = stats.sumsq.double() / max(stats.count, 1)  # (m,) per-row Σ (W x)²
                dense_side = [
                    {"G": None, "C": None, "dense_energy": float(e.sum().item()), "WC": wc}
                    for e, wc in zip(sumsq.split(sizes), C.split(sizes), strict=True)
                ]
            else:
                dense_side = [{"G": stats.gram, "C": C}] * len(W_group)
            # the group's projections are independent given its statistics: with several processes, each solves
            # some of them (balanced by rows) and sends its results to the others
            owners = assign_ranks([W.shape[0] for W in W_group])
            solved = []
            for W, side, owner in zip(W_group, dense_side, owners, strict=True):
                if owner != rank():
                    solved.append((torch.empty_like(W), None))
                    continue
                t0 = time.perf_counter()
                W0 = self._warm_start(W, Gs)
                sparsity = cfg.sparsity if cfg.nm is None else None
                W_best, res = fista_prune(W, Gs=Gs, W0=W0, sparsity=sparsity, nm=cfg.nm, L=L, eig=eig, **side, **opts)
                rec = {k: res[k] for k in ("error_init", "error_best", "stop_reason", "outer_iterations")}
                rec.update(spectral_steps=sum(res["spectral"]), seconds=time.perf_counter() - t0)
                self.solve_seconds += rec["seconds"]
                rec.update(input_group=gname, stats_seconds=stats_s)
                solved.append((W_best.to(torch.float32).contiguous(), rec))
            for t, (W_best, rec), owner in zip(targets, solved, owners, strict=True):
                W_best = broadcast_(W_best, owner)
                write_target(view, t, W_best)
                fitted.append((t, W_best))
                info[t.key] = broadcast_object(rec, owner)
        if cfg.refit_strength != 1:  # once the layer is done: every projection was fitted with the full re-fits
            for t, W_best in fitted:
                write_target(view, t, shrink_refit(dense_w[t.key], W_best, cfg.refit_strength))
        return info


def _parent(path: str) -> str:
    """The submodule holding `path` (`""`: the decoder layer itself)."""
    return path.rpartition(".")[0]


class _StopForward(Exception):
    """Raised by a capture hook once the input it needs is recorded: the rest of the layer's forward is skipped."""
