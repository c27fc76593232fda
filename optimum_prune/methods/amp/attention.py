"""One attention module's probabilities recomputed from its q/k weights (the model's own pieces: biases, q/k norms,
RoPE after masking, GQA groups, scaling, soft-capping, causal mask, sliding window); used by `functional.amp_masks`."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from .blocked import causal_blocks, interleave_heads

__all__ = ["AttentionInputs", "attention_mask", "attention_probs", "project_qk", "qk_rows", "rope_of"]


@dataclass
class AttentionInputs:
    """What one attention module sees on the calibration set, and how it computes its scores.

    Args:
        xs (`list[torch.Tensor]`): per chunk, the attention input of shape `(batch, n, d)` (after the input norm).
        rope (`list[tuple[torch.Tensor, torch.Tensor] | None]`): per chunk, the `(cos, sin)` the module received.
        num_heads / num_kv_heads / head_dim (`int`): geometry.
        scaling (`float`): factor applied to `q·k` (1/√d_h for most models).
        sliding_window (`int | None`): keys further back than this are masked (Gemma 3 local layers).
        softcap (`float | None`): logit soft-capping `cap·tanh(s/cap)`.
        q_norm / k_norm (`nn.Module | None`): per-head norms applied before RoPE.
        apply_rope (`Callable | None`): the module's `apply_rotary_pos_emb(q, k, cos, sin)`.
        causal (`bool`): causal mask.
        block_size (`int`): query positions per block; blocks skip the keys the causal mask hides (~40% less work
            at n = 512, same values).
    """

    xs: list[torch.Tensor]
    rope: list
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    sliding_window: int | None = None
    softcap: float | None = None
    q_norm: nn.Module | None = None
    k_norm: nn.Module | None = None
    apply_rope: Callable | None = None
    causal: bool = True
    block_size: int = 128
    blocks_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def num_samples(self) -> int:
        return sum(x.shape[0] for x in self.xs)

    @classmethod
    def from_module(cls, attn: nn.Module, xs, rope, num_heads: int, num_kv_heads: int, head_dim: int):
        """Read the scoring details from a transformers attention module (raises when it has no `scaling`)."""
        if not hasattr(attn, "scaling"):
            raise ValueError(
                f"{type(attn).__name__} has no `scaling` attribute: AMP cannot reproduce its attention scores. "
                "Supported: the attention modules of the architectures in `supported_model_types()`."
            )
        apply = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
        if any(r is not None for r in rope) and apply is None:
            raise ValueError(f"{type(attn).__name__} receives rotary embeddings but its module has no RoPE function.")
        return cls(
            xs=xs,
            rope=rope,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            scaling=float(attn.scaling),
            sliding_window=getattr(attn, "sliding_window", None),
            softcap=getattr(attn, "attn_logit_softcapping", None),
            q_norm=_norm_on(getattr(attn, "q_norm", None), xs),
            k_norm=_norm_on(getattr(attn, "k_norm", None), xs),
            apply_rope=apply,
            causal=getattr(attn, "is_causal", True),
        )


def _norm_on(norm: nn.Module | None, xs) -> nn.Module | None:
    """The q/k norm on the device of the captured inputs: a `device=` run captures them on the accelerator and moves
    the layer back, so the norm is copied there (it is only read)."""
    param = None if norm is None or not xs else next(norm.parameters(), None)
    if param is None or param.device == xs[0].device:
        return norm
    return copy.deepcopy(norm).to(xs[0].device)


def attention_mask(n: int, causal: bool = True, sliding_window: int | None = None, device=None) -> torch.Tensor:
    """Boolean `(n, n)` mask, True where query i may attend to key j (causal: j <= i; window: i - j < window)."""
    i = torch.arange(n, device=device).unsqueeze(1)
    j = torch.arange(n, device=device).unsqueeze(0)
    allowed = torch.ones(n, n, dtype=torch.bool, device=device)
    if causal:
        allowed &= j <= i
    if sliding_window is not None:
        allowed &= (i - j) < sliding_window
    return allowed


def attention_probs(
    inp: AttentionInputs,
    chunk: int,
    Wq: torch.Tensor,
    Wk: torch.Tensor,
    bq: torch.Tensor | None = None,
    bk: torch.Tensor | None = None,
    samples: slice = slice(None),
    groups: slice | None = None,
    dense_for_backward: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Attention probabilities of chunk `chunk` for the KV groups `groups` (default all), differentiable.

    Args:
        Wq (`torch.Tensor` of shape `(H·d_h, d)`), Wk (`(H_kv·d_h, d)`): the (masked) q/k weights, `(out, in)`.
        bq, bk: their biases (never masked).
        samples (`slice`): sequences of the chunk to use.
        groups (`slice | None`): KV groups to compute (their query heads come along).
        dense_for_backward (`list[torch.Tensor] | None`): the dense probabilities (from this function); when given,
            the softmax backward uses them in `p1 = c∘f` (Algorithm 1's printed gradient) instead of the exact `c∘f̃`.

    Returns:
        `list[torch.Tensor]`: per block of `inp.block_size` query positions, the probabilities of shape
        `(b, G, rows·g, keys)`, the query heads of KV group `G` interleaved per position (see `CausalBlocks`), over
        the keys the block can see (causal: keys up to its last row; sliding window: from its first row's window
        start). Entries outside are exactly zero in the full matrix (`assemble` rebuilds it).
    """
    q, k = project_qk(inp, chunk, Wq, Wk, bq, bk, samples, groups)
    return causal_blocks(inp, q.shape[3], q.device).probs(interleave_heads(q) * inp.scaling, k, dense_for_backward)


def project_qk(inp, chunk, Wq, Wk, bq=None, bk=None, samples=slice(None), groups=None):
    """Per-head queries `(b, G, g, n, d_h)` and keys `(b, G, n, d_h)` after biases, q/k norms and RoPE."""
    x = inp.xs[chunk][samples]
    dtype = torch.float64 if Wq.dtype == torch.float64 else torch.float32
    x = x.to(dtype)
    b, n, _ = x.shape
    hd, gs = inp.head_dim, inp.group_size
    q_rows, k_rows = qk_rows(inp, groups)
    q = x @ Wq[q_rows].T  # (b, n, Gq·hd)
    k = x @ Wk[k_rows].T  # (b, n, G·hd)
    if bq is not None:
        q = q + bq[q_rows].to(dtype)
    if bk is not None:
        k = k + bk[k_rows].to(dtype)
    q = q.view(b, n, -1, hd).transpose(1, 2)  # (b, Gq, n, hd)
    k = k.view(b, n, -1, hd).transpose(1, 2)  # (b, G, n, hd)
    if inp.q_norm is not None:
        q = inp.q_norm(q).to(dtype)
    if inp.k_norm is not None:
        k = inp.k_norm(k).to(dtype)
    rope = rope_of(inp, chunk, samples, dtype)
    if rope is not None:
        q, k = inp.apply_rope(q, k, *rope)
    return q.view(b, k.shape[1], gs, n, hd), k


def qk_rows(inp: AttentionInputs, groups: slice | None = None) -> tuple[slice, slice]:
    """Rows of W_Q and W_K (`(out, in)` layout) that make the KV groups `groups` (default all) and their queries."""
    hd, gs = inp.head_dim, inp.group_size
    g0, g1 = (0, inp.num_kv_heads) if groups is None else (groups.start, groups.stop)
    return slice(g0 * gs * hd, g1 * gs * hd), slice(g0 * hd, g1 * hd)


def rope_of(inp: AttentionInputs, chunk: int, samples: slice, dtype: torch.dtype):
    """The `(cos, sin)` chunk `chunk` received, for the sequences `samples`, in `dtype` (None without RoPE)."""
    rope = inp.rope[chunk]
    if rope is None:
        return None
    return tuple(t[samples].to(dtype) if t.shape[0] > 1 else t.to(dtype) for t in rope)
