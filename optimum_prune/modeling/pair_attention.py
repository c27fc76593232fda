"""Attention whose q/k and v/o head dimensions were pruned (SPP's QK and VO pairs), on the stock modules.

A pruned attention module keeps its class's weights, cache and attention backends (eager, sdpa, ...); only its
`forward` changes, through a subclass created once per base class (`PairLlamaAttention`, ...), so that `q`/`k` are
viewed with `qk_head_dim` and `v` with `vo_head_dim`:

- the softmax scale stays `attn.scaling` (that of the original head dimension), unless the pruner set another one;
- rotary embeddings: the kept `rotate_half` pairs (j, j + d/2) are listed in `attn.rope_pairs` (indices into the
  original `d/2` pairs); cos/sin are sliced to `[pairs, pairs + d/2]`, so every kept dimension rotates with its own
  frequency and partner;
- per-head q/k norms (Qwen 3, Gemma 3) normalise over the original width: pruned dimensions count as zeros, exactly
  as in the masked model (`_norm_like_full`).

`set_pair_geometry_` installs it; `modeling.surgery` calls it when it removes head dimensions and when it rebuilds a
saved model's skeleton. Only the dynamic cache (the default of `generate`) can hold keys and values of different
widths.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

__all__ = ["set_pair_geometry_", "is_pair_attention", "rope_index"]

_CLASSES: dict[tuple[type, str], type] = {}


def rope_index(pairs: Sequence[int] | torch.Tensor, head_dim: int) -> torch.Tensor:
    """Indices of the kept dimensions in the original rotary layout: `[pairs, pairs + head_dim / 2]`."""
    p = torch.as_tensor(list(pairs) if not isinstance(pairs, torch.Tensor) else pairs, dtype=torch.long)
    return torch.cat([p, p + head_dim // 2])


def is_pair_attention(attn: nn.Module) -> bool:
    return hasattr(attn, "qk_head_dim")


def _modeling(attn: nn.Module):
    """The modeling module of the attention's stock class (its `apply_rotary_pos_emb`, `eager_attention_forward`)."""
    return sys.modules[getattr(type(attn), "_pair_base", type(attn)).__module__]


def _interface(attn: nn.Module):
    return ALL_ATTENTION_FUNCTIONS.get_interface(
        attn.config._attn_implementation, _modeling(attn).eager_attention_forward
    )


def _cached_rope_index(attn: nn.Module, device: torch.device) -> torch.Tensor:
    index = attn._rope_index.get(device)
    if index is None:
        index = attn._rope_index[device] = rope_index(attn.rope_pairs, attn.head_dim).to(device)
    return index


def _norm_like_full(norm: nn.Module, x: torch.Tensor, full: int) -> torch.Tensor:
    """An RMS norm over `full` dimensions of which only `x.shape[-1]` are present (the others are zeros):
    `norm(c·x)/c` with `c² = kept / full` turns the mean over the kept dimensions into the mean over `full`."""
    kept = x.shape[-1]
    if kept == full:
        return norm(x)
    c = math.sqrt(kept / full)
    return norm(x * c) / c


def _pop_cache(past_key_values, kwargs: dict):
    """The key/value cache a decoder layer passed: transformers >= 5.2x names it `cache`, earlier releases
    `past_key_values`. Popped from `kwargs` so that it never reaches the attention function, where it would be
    ignored: the new keys and values would then never be cached and every decoding step would attend to itself
    only."""
    cache = kwargs.pop("cache", None)
    kwargs.pop("past_key_value", None)
    return cache if cache is not None else past_key_values


def _rope_forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
    """Llama / Mistral / Qwen 2 / Qwen 3 / Gemma 3 attention with q/k of width `qk_head_dim`, v of `vo_head_dim`."""
    past_key_values = _pop_cache(past_key_values, kwargs)
    input_shape = hidden_states.shape[:-1]
    q = self.q_proj(hidden_states).view(*input_shape, -1, self.qk_head_dim)
    k = self.k_proj(hidden_states).view(*input_shape, -1, self.qk_head_dim)
    v = self.v_proj(hidden_states).view(*input_shape, -1, self.vo_head_dim).transpose(1, 2)
    if hasattr(self, "q_norm"):
        q, k = _norm_like_full(self.q_norm, q, self.head_dim), _norm_like_full(self.k_norm, k, self.head_dim)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = position_embeddings
    if self.rope_pairs is not None:
        index = _cached_rope_index(self, cos.device)
        cos, sin = cos[..., index], sin[..., index]
    q, k = _modeling(self).apply_rotary_pos_emb(q, k, cos, sin)
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, self.layer_idx)
    extra = {}
    if hasattr(self, "sliding_window"):  # Qwen 2 / 3, Gemma 3: per layer
        extra["sliding_window"] = self.sliding_window
    elif hasattr(self.config, "sliding_window"):  # Mistral: from the config
        extra["sliding_window"] = self.config.sliding_window
    out, weights = _interface(self)(
        self, q, k, v, attention_mask, dropout=self.attention_dropout if self.training else 0.0,
        scaling=self.scaling, **extra, **kwargs,
    )  # fmt: skip
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def _opt_forward(self, hidden_states, past_key_values=None, attention_mask=None, output_attentions=False, **kwargs):
    past_key_values = _pop_cache(past_key_values, kwargs)
    bsz, tgt_len, _ = hidden_states.size()
    q = (self.q_proj(hidden_states) * self.scaling).view(bsz, -1, self.num_heads, self.qk_head_dim).transpose(1, 2)
    k = self.k_proj(hidden_states).view(bsz, -1, self.num_heads, self.qk_head_dim).transpose(1, 2)
    v = self.v_proj(hidden_states).view(bsz, -1, self.num_heads, self.vo_head_dim).transpose(1, 2)
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, self.layer_idx)
    out, weights = _interface(self)(
        self, q, k, v, attention_mask, dropout=0.0 if not self.training else self.dropout, scaling=1.0, **kwargs
    )
    return self.out_proj(out.reshape(bsz, tgt_len, -1).contiguous()), weights


def _gpt2_forward(self, hidden_states, past_key_values=None, attention_mask=None, encoder_hidden_states=None,
                  encoder_attention_mask=None, output_attentions=False, **kwargs):  # fmt: skip
    if encoder_hidden_states is not None:
        raise NotImplementedError("Cross-attention with pruned head dimensions is not supported.")
    past_key_values = _pop_cache(past_key_values, kwargs)
    qk, vo = self.num_heads * self.qk_head_dim, self.num_heads * self.vo_head_dim
    q, k, v = self.c_attn(hidden_states).split([qk, qk, vo], dim=2)
    q = q.view(*q.shape[:-1], -1, self.qk_head_dim).transpose(1, 2)
    k = k.view(*k.shape[:-1], -1, self.qk_head_dim).transpose(1, 2)
    v = v.view(*v.shape[:-1], -1, self.vo_head_dim).transpose(1, 2)
    if past_key_values is not None:
        cache = getattr(past_key_values, "self_attention_cache", past_key_values)
        k, v = cache.update(k, v, self.layer_idx)
    if self.config._attn_implementation == "eager" and self.reorder_and_upcast_attn:
        out, weights = self._upcast_and_reordered_attn(q, k, v, attention_mask)
    else:
        out, weights = _interface(self)(
            self, q, k, v, attention_mask, dropout=self.attn_dropout.p if self.training else 0.0,
            scaling=self.scaling, **kwargs,
        )  # fmt: skip
    out = self.c_proj(out.reshape(*out.shape[:-2], -1).contiguous())
    return self.resid_dropout(out), weights


def _vit_forward(self, hidden_states, attention_mask=None, **kwargs):
    """ViT / DeiT / Dinov2 attention (non-causal, no rotary embedding, no cache)."""
    input_shape = hidden_states.shape[:-1]
    q = self.q_proj(hidden_states).view(*input_shape, -1, self.qk_head_dim).transpose(1, 2)
    k = self.k_proj(hidden_states).view(*input_shape, -1, self.qk_head_dim).transpose(1, 2)
    v = self.v_proj(hidden_states).view(*input_shape, -1, self.vo_head_dim).transpose(1, 2)
    out, weights = _interface(self)(
        self, q, k, v, attention_mask, dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling, **kwargs,
    )  # fmt: skip
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


_FORWARDS = {"rope": _rope_forward, "opt": _opt_forward, "gpt2": _gpt2_forward, "vit": _vit_forward}


def _pair_class(base: type, layout: str) -> type:
    key = (base, layout)
    if key not in _CLASSES:
        _CLASSES[key] = type(
            f"Pair{base.__name__}", (base,), {"forward": _FORWARDS[layout], "_pair_base": base, "__module__": __name__}
        )
    return _CLASSES[key]


def set_pair_geometry_(
    attn: nn.Module,
    layout: str,
    qk_head_dim: int,
    vo_head_dim: int,
    rope_pairs: Sequence[int] | None = None,
    scaling: float | None = None,
) -> None:
    """Make `attn` run with per-head q/k width `qk_head_dim` and v/o width `vo_head_dim` (weights already sliced).

    Args:
        attn (`nn.Module`): a stock attention module (or one already made a pair attention).
        layout (`str`): `ArchitectureSpec.pair_attention` (`"rope"`, `"opt"`, `"gpt2"`, `"vit"`).
        qk_head_dim / vo_head_dim (`int`): the new widths.
        rope_pairs (`Sequence[int] | None`): for `"rope"`, the kept rotary pairs as indices into the original
            `head_dim / 2` pairs (`None`: all).
        scaling (`float | None`): a new softmax scale (`None`: keep the module's, that of the original head dim).
    """
    if layout not in _FORWARDS:
        raise ValueError(f"No pair-attention forward for layout {layout!r}; known: {sorted(_FORWARDS)}.")
    base = getattr(type(attn), "_pair_base", type(attn))
    attn.__class__ = _pair_class(base, layout)
    attn.qk_head_dim, attn.vo_head_dim = int(qk_head_dim), int(vo_head_dim)
    if layout == "rope":
        full = attn.head_dim // 2
        pairs = None if rope_pairs is None or list(rope_pairs) == list(range(full)) else [int(p) for p in rope_pairs]
        if pairs is not None and 2 * len(pairs) != qk_head_dim:
            raise ValueError(f"{len(pairs)} rotary pairs do not make a q/k head of width {qk_head_dim}.")
        attn.rope_pairs = pairs
        attn._rope_index = {}  # device -> index tensor, built on first use (works on a meta-device skeleton too)
    if scaling is not None:
        attn.scaling = float(scaling)
