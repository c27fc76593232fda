"""Numerical Pruning pruner: orchestration only (math in `functional.py`)."""

from __future__ import annotations

import torch

from ...calibration.stats import CrossGramStats, GramStats
from ...functional.compensation import compensate, compensate_with_bias, damped_cholesky_solve
from ...functional.fluctuation import fluctuation_scores
from ...modeling.access import plus_bias
from ...modeling.architectures import LayerView, weight_oi
from ...modeling.shapes import head_costs, mlp_channel_cost
from ...modeling.surgery import head_rows
from ...plan import LayerPlan
from ..structured import StructuredPruner, resolve_gqa_mode
from .config import NumericalConfig
from .functional import numerical_scores, numerical_scores_newton, removal_losses

__all__ = ["NumericalPruner"]


def _head_means(z: torch.Tensor) -> torch.Tensor:
    """`(H, D_h)` channel scores → `(H,)` head scores: the mean over the head's live channels (a dead channel,
    scored −∞, costs nothing to remove and says nothing about its head); −∞ only when every channel is dead."""
    finite = torch.isfinite(z)
    total = torch.where(finite, z, torch.zeros_like(z)).sum(1)  # (H,)
    n = finite.sum(1)  # (H,)
    return torch.where(n > 0, total / n.clamp_min(1), torch.full_like(total, float("-inf")))


def _standardize(x: torch.Tensor, ref: torch.Tensor | None = None) -> torch.Tensor:
    """`(x − mean) / std` with the mean / std of the finite entries of `ref` (default `x`); −∞ stays."""
    ref = x if ref is None else ref
    finite = torch.isfinite(ref)
    m, s = ref[finite].mean(), ref[finite].std().clamp_min(1e-12)
    return torch.where(torch.isfinite(x), (x - m) / s, x)


class NumericalPruner(StructuredPruner):
    """Numerical Pruning (https://arxiv.org/abs/2412.12441).

    Lifecycle:
      - layer_stats: Grams of the o_proj and down_proj inputs, from the dense model (one pass);
      - score_layer: closed-form (or Newton) numerical scores, head score = mean over its D_h channels; or, with
        `ranking="loss"`, each unit's optimal removal loss L* per parameter;
      - allocation: global cost-weighted ranking, α = 4·D_h/3 (GQA groups: (2·n_rep+2)·D_h/3);
      - finalize_layer: least-squares compensation of o_proj / down_proj on the kept channels.
    """

    config_cls = NumericalConfig
    requires_calibration = True
    config: NumericalConfig

    def resolve_config(self, model, spec) -> NumericalConfig:
        return super().resolve_config(model, spec).for_architecture(spec)

    def keep_stats(self) -> bool:
        return self.config.compensate

    def layer_stats(self, view: LayerView):
        out = {}  # the Grams are only read normalised: held once
        if self.config.prune_attention:
            out["attn"] = (view.o_proj, GramStats(weight_oi(view.o_proj).shape[1], normalize_in_place=True))
        if self.config.prune_mlp:
            out["mlp"] = (view.mlp_out, GramStats(view.intermediate_size, normalize_in_place=True))
        return out

    def channel_scores(self, W: torch.Tensor, stats: GramStats, unit_size: int = 1) -> torch.Tensor:
        """The numerical scores of the input channels of `W` (or of its units of `unit_size` channels), from the
        Gram of its inputs (`stats.gram`)."""
        cfg, H = self.config, stats.gram.to(W.device)
        if not cfg.score_correlations:  # independent inputs: A = diag(‖W_:,j‖²·E[x_j²])
            H = torch.diag(H.diagonal())
        if cfg.solver == "newton":
            return numerical_scores_newton(
                W, H, cfg.pruning_ratio, cfg.lambda_, cfg.newton_iters, damping=cfg.score_damping, unit_size=unit_size
            )
        return numerical_scores(W, H, cfg.pruning_ratio, cfg.lambda_, damping=cfg.score_damping, unit_size=unit_size)

    def _head_scores(self, view: LayerView, stats: GramStats) -> torch.Tensor:
        """`(H,)` per-query-head scores (the heads of a KV group share the group's score in group mode)."""
        cfg = self.config
        W = weight_oi(view.o_proj).detach()
        z = self.channel_scores(W, stats)  # (H·D_h,) channel scores
        if cfg.head_score == "channel_mean":  # the paper's: the mean of the head's channel scores
            return _head_means((_standardize(z) if cfg.resolved_standardize else z).view(view.num_heads, -1))
        heads_per_unit = view.group_size if resolve_gqa_mode(cfg.gqa_mode, view) == "group" else 1
        zu = self.channel_scores(W, stats, unit_size=heads_per_unit * view.head_dim)  # (units,) one mask per unit
        if cfg.resolved_standardize:  # in the module's channel-score units, as MLP channels are
            zu = _standardize(zu, ref=z)
        return zu.repeat_interleave(heads_per_unit)

    def score_layer(self, view: LayerView, stats):
        if self.config.ranking == "loss":
            return self._loss_scores(view, stats)
        if self.config.resolved_scores == "fluctuation":
            return self._fluctuation_scores(view, stats)
        head = chan = None
        if "attn" in stats:
            head = self._head_scores(view, stats["attn"])  # (H,)
        if "mlp" in stats:
            chan = self.channel_scores(weight_oi(view.mlp_out).detach(), stats["mlp"])  # (I,)
            chan = _standardize(chan) if self.config.resolved_standardize else chan
        return head, chan

    def _fluctuation_scores(self, view: LayerView, stats):
        """`scores="fluctuation"`: FLAP's metric, from the Gram's diagonal and the mean (Var = E[x²] − E[x]²)."""
        std = self.config.resolved_standardize
        head = chan = None
        if "attn" in stats:
            W = weight_oi(view.o_proj).detach().cpu()
            head = fluctuation_scores(
                W, *stats["attn"].moments(), square=True, standardized=std, head_dim=view.head_dim
            )
        if "mlp" in stats:
            chan = fluctuation_scores(
                weight_oi(view.mlp_out).detach().cpu(), *stats["mlp"].moments(), standardized=std
            )
        return head, chan

    def _losses(self, W: torch.Tensor, stats: GramStats, groups: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        H = stats.gram.to(W.device)
        if cfg.refit_bias:  # the refit with an intercept acts on the covariance
            mu = stats.mean.to(W.device)
            H = H.double() - torch.outer(mu, mu)
        if not cfg.score_correlations:  # independent inputs: no refit can help, L*(P) = Σ_{j∈P} ‖W_:,j‖²·H_jj
            return removal_losses(W, torch.diag(H.diagonal()), groups, compensated=False)
        return removal_losses(W, H, groups, cfg.compensation_damping, compensated=cfg.compensate)

    def _loss_scores(self, view: LayerView, stats):
        """`ranking="loss"`: each unit's removal loss (Thm. 3's L*), per parameter it removes, or standardised per
        module with a head / KV group in channel units (its loss over its channel count, against the module's
        single-channel losses), as the numerical scores are (see the config)."""
        head = chan = None
        std = self.config.resolved_standardize
        if "attn" in stats:
            W = weight_oi(view.o_proj).detach()
            group_mode = resolve_gqa_mode(self.config.gqa_mode, view) == "group"
            heads_per_unit = view.group_size if group_mode else 1  # a KV group's query heads go together
            m = heads_per_unit * view.head_dim
            channels = torch.arange(view.num_heads * view.head_dim)
            loss = self._losses(W, stats["attn"], channels.view(-1, m))  # (units,)
            if std:
                head = _standardize(loss / m, ref=self._losses(W, stats["attn"], channels[:, None]))
            else:
                head = loss / head_costs(view)[1 if group_mode else 0]
            head = head.repeat_interleave(heads_per_unit)  # (H,)
        if "mlp" in stats:
            W = weight_oi(view.mlp_out).detach()
            chan = self._losses(W, stats["mlp"], torch.arange(view.intermediate_size)[:, None])  # (I,)
            chan = _standardize(chan) if std else chan / mlp_channel_cost(view)
        return head, chan

    def finalize_layer(self, view: LayerView, stats, plan: LayerPlan) -> None:
        if not self.config.compensate:
            return
        targets = []  # (a sublayer removed whole has nothing to refit)
        if plan.keep_heads:
            targets.append(("attn", view.spec.o_path, head_rows(plan.keep_heads, view.head_dim)))
        if plan.keep_channels:
            targets.append(("mlp", view.spec.mlp_out_path, torch.as_tensor(plan.keep_channels)))
        damp, s = self.config.compensation_damping, self.config.refit_strength
        for name, path, keep in targets:
            mod = view.module(path)
            W = weight_oi(mod).detach()
            H, keep = stats[name].gram.to(W.device), keep.to(W.device)
            if self.config.refit_bias:
                plan.weights[path], b, res = compensate_with_bias(W, H, stats[name].mean, keep, damp, s)
                plan.biases[path] = plus_bias(b, mod)
            else:
                plan.weights[path], res = compensate(W, H, keep, damp, s)
            plan.info[f"{name}_residual"] = res

    # ------------------------------------------------------------------ compensation_inputs="sequential"
    @property
    def refit_inputs(self) -> str:
        sequential = self.config.compensate and self.config.compensation_inputs == "sequential"
        return "sequential" if sequential else "dense"

    def refit_targets(self, view: LayerView, plan: LayerPlan) -> list[tuple[str, torch.Tensor]]:
        """`(projection path, kept input columns)` to refit on the pruned network's inputs, attention first (the MLP's
        refit then sees the refitted attention)."""
        targets = []
        if plan.keep_heads:
            targets.append((view.spec.o_path, head_rows(plan.keep_heads, view.head_dim)))
        if plan.keep_channels:
            targets.append((view.spec.mlp_out_path, torch.as_tensor(plan.keep_channels)))
        return targets

    def refit_stats(self, dim: int) -> PairedGramStats:
        """The accumulator of `(dense input, pruned input)` pairs of one projection with `dim` inputs."""
        return PairedGramStats(dim)

    def refit_projection(self, view: LayerView, path: str, W: torch.Tensor, stats: PairedGramStats, keep):
        """The refitted `(d_out, D)` weight of projection `path` (dense weight `W`, kept input columns `keep`) that
        maps the pruned network's inputs to the dense outputs, and its bias (`refit_bias`) or `None`."""
        Wd = W.double()
        Cg, Gg = stats.cross.gram.to(W.device), stats.pruned.gram.to(W.device)  # (D, D) each
        b = None
        if self.config.refit_bias:  # intercept: centre both sides (see `compensate_with_bias`)
            mx, mxs = (m.to(W.device) for m in stats.cross.means)
            Cg, Gg = Cg - torch.outer(mx, mxs), Gg - torch.outer(mxs, mxs)
        G_kk = Gg[keep][:, keep]  # (k, k)
        # Ridge around the current weights, W'_K = W_K + Δ: identical to the dense refit when X* = X (damping too)
        rhs = (Wd @ Cg[:, keep] - Wd[:, keep] @ G_kk).T  # (k, d_out)
        W_new = torch.zeros_like(Wd)
        delta = damped_cholesky_solve(G_kk, rhs, self.config.compensation_damping).T
        W_new[:, keep] = Wd[:, keep] + self.config.refit_strength * delta
        if self.config.refit_bias:
            b = (Wd @ mx - W_new @ mxs).to(W.dtype)  # (d_out,) mean dense output minus mean refitted output
        return W_new.to(W.dtype), b


class PairedGramStats:
    """The statistics of NP's sequential refit of one projection: the cross-Gram of (dense, pruned) inputs and the
    Gram of the pruned ones, in float64."""

    def __init__(self, dim: int) -> None:
        self.cross, self.pruned = CrossGramStats(dim, torch.float64), GramStats(dim, torch.float64)

    def update(self, x: torch.Tensor, xs: torch.Tensor) -> None:
        self.cross.update(x, xs)
        self.pruned.update(xs)
