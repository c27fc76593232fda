"""Numerical Pruning pruner: orchestration only (math in `functional.py`)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ...calibration.stats import CrossGramStats, GramStats
from ...modeling.architectures import ArchitectureSpec, LayerView, get_layers, layer_view, weight_oi
from ...modeling.surgery import apply_layer_plan_, head_rows
from ...plan import LayerPlan, PruningPlan
from ...session import current_session
from ..base import RunnerFactory
from ..structured import StructuredPruner, head_costs, mlp_channel_cost, resolve_gqa_mode
from .config import NumericalPruningConfig
from .functional import (
    compensate,
    compensate_with_bias,
    damped_cholesky_solve,
    numerical_scores,
    numerical_scores_newton,
    removal_losses,
)

__all__ = ["NumericalPruner"]


def _plus_bias(b: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """`b` plus the module's existing bias (a plan's bias replaces the module's)."""
    old = getattr(module, "bias", None)
    return b if old is None else b + old.detach().to(b)


def _head_means(z: torch.Tensor) -> torch.Tensor:
    """`(H, D_h)` channel scores → `(H,)` head scores: the mean over the head's live channels (a dead channel,
    scored −∞, costs nothing to remove and says nothing about its head); −∞ only when every channel is dead."""
    finite = torch.isfinite(z)
    total = torch.where(finite, z, torch.zeros_like(z)).sum(1)  # (H,)
    n = finite.sum(1)  # (H,)
    return torch.where(n > 0, total / n.clamp_min(1), torch.full_like(total, float("-inf")))


def _standardize(x: torch.Tensor) -> torch.Tensor:
    finite = torch.isfinite(x)
    m, s = x[finite].mean(), x[finite].std().clamp_min(1e-12)
    return torch.where(finite, (x - m) / s, x)


class NumericalPruner(StructuredPruner):
    """Numerical Pruning (https://arxiv.org/abs/2412.12441).

    Lifecycle:
      - layer_stats: Grams of the o_proj and down_proj inputs, from the dense model (one pass);
      - score_layer: closed-form (or Newton) numerical scores, head score = mean over its D_h channels; or, with
        `ranking="loss"`, each unit's optimal removal loss L* per parameter;
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
        if self.config.ranking == "loss":
            return self._loss_scores(view, stats)
        head = chan = None
        if "attn" in stats:
            z = self._scores(weight_oi(view.o_proj).detach(), stats["attn"])  # (H·D_h,)
            head = _head_means(z.view(view.num_heads, view.head_dim))  # (H,)
        if "mlp" in stats:
            chan = self._scores(weight_oi(view.mlp_out).detach(), stats["mlp"])  # (I,)
        return head, chan

    def _losses(self, W: torch.Tensor, stats: GramStats, groups: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        H = stats.gram.to(W.device)
        if cfg.compensation_bias:  # the refit with an intercept acts on the covariance
            mu = stats.mean.to(W.device)
            H = H.double() - torch.outer(mu, mu)
        return removal_losses(W, H, groups, cfg.compensation_damping, compensated=cfg.compensate)

    def _loss_scores(self, view: LayerView, stats):
        """`ranking="loss"`: each unit's removal loss (Thm. 3's L*) per parameter it removes (see the config)."""
        head = chan = None
        if "attn" in stats:
            W = weight_oi(view.o_proj).detach()
            h, g, d = view.num_heads, view.group_size, view.head_dim
            per_q_head, per_group = head_costs(view)
            channels = torch.arange(h * d).view(h, d)
            if resolve_gqa_mode(self.config.gqa_mode, view) == "group":  # the group's query heads go together
                loss = self._losses(W, stats["attn"], channels.view(view.num_kv_heads, g * d)) / per_group
                head = loss.repeat_interleave(g)  # (H,): the unit score is the mean over the group
            else:
                head = self._losses(W, stats["attn"], channels) / per_q_head  # (H,)
        if "mlp" in stats:
            W = weight_oi(view.mlp_out).detach()
            groups = torch.arange(view.intermediate_size)[:, None]
            chan = self._losses(W, stats["mlp"], groups) / mlp_channel_cost(view)  # (I,)
        return head, chan

    def finalize_layer(self, view: LayerView, stats, plan: LayerPlan) -> None:
        if not self.config.compensate:
            return
        targets = []
        if plan.keep_heads is not None:
            targets.append(("attn", view.spec.o_path, head_rows(plan.keep_heads, view.head_dim)))
        if plan.keep_channels is not None:
            targets.append(("mlp", view.spec.mlp_out_path, torch.as_tensor(plan.keep_channels)))
        damp = self.config.compensation_damping
        for name, path, keep in targets:
            mod = view.module(path)
            W = weight_oi(mod).detach()
            H, keep = stats[name].gram.to(W.device), keep.to(W.device)
            if self.config.compensation_bias:
                plan.weights[path], b, res = compensate_with_bias(W, H, stats[name].mean, keep, damp)
                plan.biases[path] = _plus_bias(b, mod)
            else:
                plan.weights[path], res = compensate(W, H, keep, damp)
            plan.info[f"{name}_residual"] = res

    # ------------------------------------------------------------------ compensation_inputs="sequential"
    def compute_plan(self, model: nn.Module, spec: ArchitectureSpec, runner: RunnerFactory | None) -> PruningPlan:
        plan = super().compute_plan(model, spec, runner)
        if self.config.compensate and self.config.compensation_inputs == "sequential":
            self._sequential_refit(model, spec, runner, plan)
        return plan

    def refits_after_plan(self) -> bool:
        return self.config.compensate and self.config.compensation_inputs == "sequential"

    def _sequential_refit(self, model: nn.Module, spec: ArchitectureSpec, runner: RunnerFactory, plan: PruningPlan):
        """Refit o_proj / down_proj layer by layer on the pruned network's inputs; the model is restored after (a
        low-memory or checkpointed run finishes each block here instead: see `session`)."""
        run, sess = runner(), current_session()
        dense_h, pruned_h = run.hidden, run.hidden
        for i, layer in enumerate(get_layers(model, spec)):
            if sess.done(i):
                dense_h = sess.forward(run, i, "input", dense_h)
                pruned_h = sess.forward(run, i, "current", pruned_h)
                continue
            with sess.resident(i, "input"):
                dense_h, pruned_h = self._refit_layer(run, i, layer, spec, model.config, plan, dense_h, pruned_h)
                sess.finish(i, plan.layers.get(i) or LayerPlan())

    def _refit_layer(self, run, i, layer, spec, config, plan, dense_h, pruned_h):
        """`_sequential_refit` of block `i`: its plan gets the refitted weights; returns the next inputs."""
        dense = copy.deepcopy(layer)
        lp = plan.layers.get(i)
        if lp is not None:
            view = layer_view(layer, i, spec, config)
            removal = LayerPlan(
                keep_heads=lp.keep_heads, keep_kv_heads=lp.keep_kv_heads, keep_channels=lp.keep_channels
            )
            apply_layer_plan_(view, removal, mode="zero")
            targets = []
            if lp.keep_heads is not None:
                targets.append((spec.o_path, head_rows(lp.keep_heads, view.head_dim)))
            if lp.keep_channels is not None:
                targets.append((spec.mlp_out_path, torch.as_tensor(lp.keep_channels)))
            for path, keep in targets:  # attention first: the MLP refit sees the refitted attention
                W_new, b = self._refit(run, i, dense, layer, path, keep, dense_h, pruned_h)
                lp.weights[path] = W_new
                mod = layer.get_submodule(path)
                with torch.no_grad():
                    weight_oi(mod).copy_(W_new)
                    if b is not None:
                        lp.biases[path] = _plus_bias(b, dense.get_submodule(path))
                        if getattr(mod, "bias", None) is None:
                            mod.bias = nn.Parameter(torch.zeros_like(b))
                        mod.bias.copy_(lp.biases[path])
        dense_h = run.run_layer(i, inputs=dense_h, layer=dense)
        pruned_h = run.run_layer(i, inputs=pruned_h)
        for path in spec.linear_paths:  # deciding changes nothing: prune_ applies the plan
            if getattr(dense.get_submodule(path), "bias", None) is None:
                layer.get_submodule(path).bias = None
        layer.load_state_dict(dense.state_dict())
        return dense_h, pruned_h

    def _refit(self, run, i, dense, layer, path, keep, dense_h, pruned_h) -> tuple[torch.Tensor, torch.Tensor | None]:
        W = weight_oi(dense.get_submodule(path)).detach()  # (d_out, D) dense weight
        D = W.shape[1]
        C, Gs = CrossGramStats(D, torch.float64), GramStats(D, torch.float64)
        for x, xs in run.paired_inputs(i, path, dense, layer, dense_h, pruned_h):
            C.update(x, xs)
            Gs.update(xs)
        keep = keep.to(W.device)
        Wd = W.double()
        Cg, Gg = C.gram.to(W.device), Gs.gram.to(W.device)  # (D, D) each
        b = None
        if self.config.compensation_bias:  # intercept: centre both sides (see `compensate_with_bias`)
            mx, mxs = (m.to(W.device) for m in C.means)
            Cg, Gg = Cg - torch.outer(mx, mxs), Gg - torch.outer(mxs, mxs)
        G_kk = Gg[keep][:, keep]  # (k, k)
        # Ridge around the current weights, W'_K = W_K + Δ: identical to the dense refit when X* = X (damping too)
        rhs = (Wd @ Cg[:, keep] - Wd[:, keep] @ G_kk).T  # (k, d_out)
        W_new = torch.zeros_like(Wd)
        W_new[:, keep] = Wd[:, keep] + damped_cholesky_solve(G_kk, rhs, self.config.compensation_damping).T
        if self.config.compensation_bias:
            b = (Wd @ mx - W_new @ mxs).to(W.dtype)  # (d_out,) mean dense output minus mean refitted output
        return W_new.to(W.dtype), b
