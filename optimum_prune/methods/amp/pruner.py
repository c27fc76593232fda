"""AMP pruner: orchestration only (math in `functional.py`)."""

from __future__ import annotations

import logging

from torch import nn

from ...modeling.architectures import ArchitectureSpec, LayerView, get_layers, layer_view, weight_oi
from ...utils.distributed import gather_chunks
from ..base import refuse_pruned_head_dims
from ..unstructured import SequentialPruner, write_target
from .config import AMPConfig
from .functional import AttentionInputs, amp_masks, binarize, relative_attention_error

__all__ = ["AMPPruner"]

logger = logging.getLogger(__name__)


def _qk(view: LayerView):
    """(Wq, bq, Wk, bk) of a layer, `(out, in)` layout; row slices of a fused q|k|v projection."""
    roles = view.spec.role_targets()
    out = []
    for role in ("q_proj", "k_proj"):
        t = roles[role]
        mod = view.module(t.path)
        W = weight_oi(mod).detach()
        rows = t.rows(W.shape[0])
        b = getattr(mod, "bias", None)
        out += [W[rows], None if b is None else b.detach()[rows]]
    return out


class AMPPruner(SequentialPruner):
    """AMP (https://arxiv.org/abs/2410.11261).

    Lifecycle, per decoder layer (inputs: the outputs of the already-pruned layers):
      - one forward of the layer records what its attention module receives (normed hidden states, RoPE cos/sin);
      - `amp_masks` optimises the q/k masks against the dense attention probabilities of that layer;
      - each targeted matrix keeps its largest mask values (per matrix, or N:M per group), weights are zeroed;
      - the report records the relative attention error before / after binarisation, the loss, steps and time.
    """

    config_cls = AMPConfig
    config: AMPConfig

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

    def _capture(self, run, view: LayerView) -> AttentionInputs:
        xs, rope = [], []

        def hook(_mod, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            xs.append(x.detach())
            pe = kwargs.get("position_embeddings")
            rope.append(None if pe is None else tuple(t.detach() for t in pe))

        handle = view.attn.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            run.run_layer(view.index, keep_outputs=False)
        finally:
            handle.remove()
        xs, rope = gather_chunks(xs), gather_chunks(rope)  # data-parallel: every rank descends on all samples
        return AttentionInputs.from_module(view.attn, xs, rope, view.num_heads, view.num_kv_heads, view.head_dim)

    def masks(self, inp: AttentionInputs, Wq, Wk, bq=None, bk=None, roles=("q_proj", "k_proj"), desc="amp: steps"):
        """`amp_masks` with this config's settings (real-valued masks, before binarisation)."""
        cfg = self.config
        return amp_masks(
            inp,
            Wq,
            Wk,
            bq,
            bk,
            lambda_=cfg.lambda_,
            lr=cfg.lr,
            steps=cfg.steps,
            momentum=cfg.momentum,
            regularizer=cfg.regularizer,
            gradient=cfg.gradient,
            update_q="q_proj" in roles,
            update_k="k_proj" in roles,
            max_chunk_mb=cfg.max_chunk_mb,
            cache_dense=cfg.cache_dense,
            desc=desc,
        )

    def prune_layer(self, run, view: LayerView, dense: nn.Module | None) -> dict:
        cfg = self.config
        if run is None:
            raise ValueError("AMP needs calibration data: pass `calibration=`.")
        inp = self._capture(run, view)
        # the descent runs where the layer's inputs were captured (a `device=` run streams the layer there and back)
        device = inp.xs[0].device if inp.xs else None
        Wq, bq, Wk, bk = (None if w is None else w.to(device) for w in _qk(view))
        roles = {t.role for t in self.targets}
        try:
            Mq, Mk, info = self.masks(inp, Wq, Wk, bq, bk, roles, desc=f"amp: layer {view.index} steps")
        except FloatingPointError as e:
            raise FloatingPointError(
                f"AMP diverged on layer {view.index} ({e}); lower `lr` (now {cfg.lr}) or `momentum`. The model was "
                "left unchanged."
            ) from e
        new = {"q_proj": Wq, "k_proj": Wk}
        for t in self.targets:
            M, W = (Mq, Wq) if t.role == "q_proj" else (Mk, Wk)
            keep = binarize(M, W, cfg.sparsity, cfg.nm, score=cfg.score, per=cfg.per)
            new[t.role] = W * keep.to(W.dtype)
        soft = relative_attention_error(inp, Wq, Wk, Wq * Mq.to(Wq.dtype), Wk * Mk.to(Wk.dtype), bq, bk)
        hard = relative_attention_error(inp, Wq, Wk, new["q_proj"], new["k_proj"], bq, bk)
        for t in self.targets:
            write_target(view, t, new[t.role])
        entry = {
            "rel_attention_error_soft": soft,
            "rel_attention_error_binary": hard,
            "loss_initial": info["loss_initial"],
            "loss_final": info["loss_final"],
            "steps": info["steps"],
            "seconds": info["seconds"],
        }
        logger.info("amp layer %d: %s", view.index, entry)
        return entry
