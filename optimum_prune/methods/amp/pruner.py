"""AMP pruner: orchestration only (math in `functional.py`)."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from ...modeling.access import qk_weights, write_target
from ...modeling.architectures import ArchitectureSpec, LayerView, get_layers, layer_view, weight_oi
from ...utils.distributed import gather_chunks
from ..base import refuse_pruned_head_dims
from ..unstructured import SequentialPruner
from . import functional
from .config import AMPConfig
from .equilibrium import MaskObjective, curvature_scales, equilibrium_masks, input_norms, refit_kept
from .functional import AttentionInputs, amp_masks, binarize, relative_attention_error

__all__ = ["AMPPruner"]

logger = logging.getLogger(__name__)

_PROBES = 8  # Hutchinson probes of the curvature's diagonal and trace (two gradients each)
_POWER_STEPS = 8  # power iterations for the largest curvature (the refit's step)


class AMPPruner(SequentialPruner):
    """AMP (https://arxiv.org/abs/2410.11261).

    Lifecycle, per decoder layer (inputs: the outputs of the already-pruned layers):
      - one forward of the layer records what its attention module receives (normed hidden states, RoPE cos/sin);
      - the q/k masks are solved against the dense attention probabilities of that layer (`solver="cg"`: the
        equilibrium at a curvature-relative λ, `equilibrium.py`; `"descent"`: the paper's descent, `amp_masks`);
      - each targeted matrix keeps its best-ranked entries (`score`, per row / matrix, or N:M per group);
      - the kept masks are refitted to the dense attention probabilities (`refit_steps`): the dense weights' on the
        same inputs, or (`refit_target="model"`) the dense model's, whose hidden states this pruner carries through
        each layer's dense copy alongside the pruned ones; the weights are written;
      - the report records the relative attention error of the soft masks, after binarisation and after the refit,
        the solver's numbers and the time.
    """

    config_cls = AMPConfig
    config: AMPConfig

    @property
    def needs_dense_layer(self) -> bool:
        return self.config.refit_target == "model" and self.config.refit_steps > 0

    @property
    def needs_dense_stream(self) -> bool:  # the refit reproduces the dense model's attention
        return self.needs_dense_layer

    def validate(self, model: nn.Module, spec: ArchitectureSpec) -> None:
        super().validate(model, spec)
        refuse_pruned_head_dims(model, spec, "AMP's attention recomputation")
        for i, layer in enumerate(get_layers(model, spec)):
            view = layer_view(layer, i, spec, model.config)
            if spec.fused_qkv:
                out = weight_oi(view.module(spec.qkv_paths[0])).shape[0]
                if out != 3 * view.num_heads * view.head_dim:
                    raise ValueError(
                        f"Layer {i}: the fused `{spec.qkv_paths[0]}` has {out} outputs, not 3 equal q|k|v blocks of "
                        f"{view.num_heads * view.head_dim}; AMP cannot separate q and k. Nothing was changed."
                    )
            AttentionInputs.from_module(view.attn, [], [], view.num_heads, view.num_kv_heads, view.head_dim)

    def capture(self, run, view: LayerView, layer: nn.Module | None = None, inputs=None):
        """What the attention module of layer `view.index` (or of `layer`, its dense copy) receives on `inputs`
        (default: the runner's hidden states), and the layer's outputs when `layer` is given."""
        xs, rope = [], []

        def hook(_mod, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            xs.append(x.detach())
            pe = kwargs.get("position_embeddings")
            rope.append(None if pe is None else tuple(t.detach() for t in pe))

        attn = view.attn if layer is None else layer.get_submodule(view.spec.attn)
        handle = attn.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            out = run.run_layer(view.index, inputs=inputs, layer=layer, keep_outputs=layer is not None)
        finally:
            handle.remove()
        xs, rope = gather_chunks(xs), gather_chunks(rope)  # data-parallel: every rank descends on all samples
        inp = AttentionInputs.from_module(attn, xs, rope, view.num_heads, view.num_kv_heads, view.head_dim)
        return inp, out

    def _dense_model_inputs(self, run, view: LayerView, dense: nn.Module, hidden) -> AttentionInputs:
        """The attention inputs of layer `view.index` in the dense model (`hidden`: the dense model's hidden states
        at the layer's input, carried by the pipeline); the dense copy's outputs go back to the pipeline."""
        inp, self._dense_stream_outputs = self.capture(run, view, layer=dense, inputs=hidden)
        return inp

    def masks(self, inp: AttentionInputs, Wq, Wk, bq=None, bk=None, roles=("q_proj", "k_proj"), desc="amp"):
        """Real-valued masks (before binarisation) with this config's solver: `(M_Q, M_K, info)`; unless the paper's
        path runs alone, `info["objective"]` is the layer's `MaskObjective` (for the refit) and
        `info["curvature_max"]` its largest curvature."""
        cfg = self.config
        update = ("q_proj" in roles, "k_proj" in roles)
        info: dict = {}
        if cfg.solver == "descent":
            Mq, Mk, info = amp_masks(
                inp, Wq, Wk, bq, bk, lambda_=cfg.lambda_, lr=cfg.lr, steps=cfg.steps, momentum=cfg.momentum,
                regularizer=cfg.regularizer, gradient=cfg.gradient, update_q=update[0], update_k=update[1],
                max_chunk_mb=cfg.max_chunk_mb, cache_dense=cfg.cache_dense, desc=f"{desc}: steps",
            )  # fmt: skip
            if not cfg.refit_steps:
                return Mq, Mk, info
        dtype = Wq.dtype if Wq.dtype == torch.float64 else torch.float32
        Wq32, Wk32 = Wq.to(dtype), Wk.to(dtype)
        bq32, bk32 = (None if b is None else b.to(dtype) for b in (bq, bk))
        literal = cfg.gradient == "algorithm1"
        data = functional.DataTerm(inp, Wq32, Wk32, bq32, bk32, cfg.max_chunk_mb, cfg.cache_dense, True, literal)
        obj = MaskObjective(data, Wq32, Wk32, update)
        t0 = time.perf_counter()
        probes = _PROBES if cfg.solver == "cg" else 0
        mean, top, diag = curvature_scales(obj, probes=probes, power_steps=_POWER_STEPS if cfg.refit_steps else 0)
        info.update(objective=obj, curvature_mean=mean, curvature_max=top)
        if cfg.solver == "cg":
            lam = cfg.lambda_rel * mean
            (Mq, Mk), cg = equilibrium_masks(
                obj, lam, cfg.cg_steps, diag if cfg.precondition else None, desc=f"{desc}: cg"
            )
            residual = cg["residuals"][-1] if cg["residuals"] else 0.0
            info.update(lambda_=lam, cg_iterations=cg["iterations"], cg_residual=residual)
            info["seconds"] = time.perf_counter() - t0
        return Mq, Mk, info

    def prune_qk(
        self, inp: AttentionInputs, Wq, Wk, bq=None, bk=None, roles=("q_proj", "k_proj"), desc="amp", target=None
    ):
        """Pruned (and refitted) `(Wq, Wk)` of one layer and the layer's report entry; `target`: the dense model's
        attention inputs, which the refit then reproduces (`refit_target="model"`)."""
        cfg = self.config
        Mq, Mk, info = self.masks(inp, Wq, Wk, bq, bk, roles, desc)
        norm = input_norms(inp).to(Wq.device) if cfg.score == "masked_weight_input" else None
        new, keep = {"q_proj": Wq, "k_proj": Wk}, {"q_proj": None, "k_proj": None}
        for role, M, W in (("q_proj", Mq, Wq), ("k_proj", Mk, Wk)):
            if role in roles:
                keep[role] = binarize(M, W, cfg.sparsity, cfg.nm, score=cfg.score, per=cfg.per, input_norm=norm)
                new[role] = W * keep[role].to(W.dtype)
        entry = {
            "rel_attention_error_soft": relative_attention_error(inp, Wq, Wk, Wq * Mq.to(Wq.dtype), Wk * Mk.to(Wk.dtype), bq, bk),
            "rel_attention_error_binary": relative_attention_error(inp, Wq, Wk, new["q_proj"], new["k_proj"], bq, bk),
        }  # fmt: skip
        for k in ("loss_initial", "loss_final", "steps", "lambda_", "cg_iterations", "cg_residual", "curvature_mean",
                  "curvature_max", "seconds"):  # fmt: skip
            if k in info:
                entry[k] = info[k]
        if cfg.refit_steps:
            t0 = time.perf_counter()
            obj = info["objective"]
            if target is not None:  # the same objective against the dense model's attention
                data = obj.data_term
                data = functional.DataTerm(
                    inp, *data.dense_w, data.bq, data.bk, cfg.max_chunk_mb, cfg.cache_dense, True, data.literal, target
                )  # fmt: skip
                obj = MaskObjective(data, *data.dense_w, obj.update)
                entry["rel_attention_error_model_binary"] = relative_attention_error(
                    inp, Wq, Wk, new["q_proj"], new["k_proj"], bq, bk, target=target
                )
            (Rq, Rk), refit = refit_kept(
                obj, [keep["q_proj"], keep["k_proj"]], cfg.refit_lr / max(info["curvature_max"], 1e-300),
                cfg.refit_steps, cfg.momentum, desc=f"{desc}: refit",
            )  # fmt: skip
            for role, R, W in (("q_proj", Rq, Wq), ("k_proj", Rk, Wk)):
                if role in roles:
                    new[role] = (W.double() * R).to(W.dtype)
            entry["rel_attention_error_refit"] = relative_attention_error(
                inp, Wq, Wk, new["q_proj"], new["k_proj"], bq, bk
            )
            if target is not None:
                entry["rel_attention_error_model_refit"] = relative_attention_error(
                    inp, Wq, Wk, new["q_proj"], new["k_proj"], bq, bk, target=target
                )
            entry.update(
                refit_loss=[refit["loss_initial"], refit["loss_final"]], refit_seconds=time.perf_counter() - t0
            )
        return new["q_proj"], new["k_proj"], entry

    def prune_layer(self, run, view: LayerView, dense: nn.Module | None, dense_inputs=None) -> dict:
        cfg = self.config
        if run is None:
            raise ValueError("AMP needs calibration data: pass `calibration=`.")
        inp = self.capture(run, view)[0]
        target = self._dense_model_inputs(run, view, dense, dense_inputs) if self.needs_dense_stream else None
        # the descent runs where the layer's inputs were captured (a `device=` run streams the layer there and back)
        device = inp.xs[0].device if inp.xs else None
        Wq, bq, Wk, bk = (None if w is None else w.to(device) for w in qk_weights(view))
        roles = {t.role for t in self.targets}
        try:
            new_q, new_k, entry = self.prune_qk(
                inp, Wq, Wk, bq, bk, roles, desc=f"amp: layer {view.index}", target=target
            )
        except FloatingPointError as e:
            raise FloatingPointError(
                f"AMP diverged on layer {view.index} ({e}); lower `lr` (now {cfg.lr}), `refit_lr` (now "
                f"{cfg.refit_lr}) or `momentum`. The model was left unchanged."
            ) from e
        new = {"q_proj": new_q, "k_proj": new_k}
        for t in self.targets:
            write_target(view, t, new[t.role])
        logger.info("amp layer %d: %s", view.index, entry)
        return entry
