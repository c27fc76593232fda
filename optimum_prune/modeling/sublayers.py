"""Whole sublayers removed from a decoder layer: the attention (with its input norm) or the MLP (with its norm).

A removed sublayer adds nothing to the residual stream, as DeciLM's `no_op` blocks (`modeling.decilm`): the layer
computes `h + 0`. Its modules are replaced by parameter-free stand-ins, so the state dict has no tensor for it.
Only Llama-style layers (`input_layernorm` before the attention, `post_attention_layernorm` before the MLP) have
their sublayers removed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .architectures import ArchitectureSpec

__all__ = [
    "ATTENTION_NORM",
    "MLP_NORM",
    "RemovedAttention",
    "RemovedMLP",
    "attention_removed",
    "mlp_removed",
    "remove_attention_",
    "remove_mlp_",
    "removed_sublayers",
]

ATTENTION_NORM = "input_layernorm"  # the norm whose only reader is the attention
MLP_NORM = "post_attention_layernorm"  # the norm whose only reader is the MLP


class RemovedAttention(nn.Module):
    """Stands for a removed attention sublayer: its output is zero (and it keeps no KV cache)."""

    removed_sublayer = True  # read by `architectures.layer_view` (which cannot import this module)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        return torch.zeros_like(hidden_states), None


class RemovedMLP(nn.Module):
    """Stands for a removed MLP sublayer: its output is zero."""

    removed_sublayer = True

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros_like(hidden_states)


def attention_removed(layer: nn.Module, spec: ArchitectureSpec) -> bool:
    return isinstance(layer.get_submodule(spec.attn), RemovedAttention)


def mlp_removed(layer: nn.Module, spec: ArchitectureSpec) -> bool:
    return bool(spec.mlp) and isinstance(layer.get_submodule(spec.mlp), RemovedMLP)


def _check(layer: nn.Module, norm: str) -> None:
    if not isinstance(getattr(layer, norm, None), nn.Module):
        raise ValueError(
            f"{type(layer).__name__} has no `{norm}`: only Llama-style layers can lose a whole sublayer "
            "(allocation='servable' takes llama / mistral models)."
        )


def remove_attention_(layer: nn.Module, spec: ArchitectureSpec) -> None:
    """Replace the layer's attention and its input norm by parameter-free stand-ins (output zero)."""
    _check(layer, ATTENTION_NORM)
    setattr(layer, spec.attn, RemovedAttention())
    setattr(layer, ATTENTION_NORM, nn.Identity())


def remove_mlp_(layer: nn.Module, spec: ArchitectureSpec) -> None:
    """Replace the layer's MLP and its norm by parameter-free stand-ins (output zero)."""
    _check(layer, MLP_NORM)
    if not spec.mlp:
        raise ValueError(f"{type(layer).__name__}'s MLP is part of the layer itself; it cannot be removed whole.")
    setattr(layer, spec.mlp, RemovedMLP())
    setattr(layer, MLP_NORM, nn.Identity())


def removed_sublayers(layer: nn.Module, spec: ArchitectureSpec) -> list[str]:
    """`"attention"` / `"mlp"`: the sublayers of `layer` that were removed."""
    return [name for name, gone in (("attention", attention_removed), ("mlp", mlp_removed)) if gone(layer, spec)]
