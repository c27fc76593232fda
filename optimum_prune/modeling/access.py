"""Reading and writing a decoder layer's weights by role (`Target`), whole modules or row slices of a fused q|k|v
projection alike."""

from __future__ import annotations

import torch

from .architectures import LayerView, Target, weight_oi

__all__ = ["read_target", "write_target", "qk_weights", "plus_bias"]


def read_target(view: LayerView, t: Target) -> torch.Tensor:
    """The `(out, in)` weight of a target (a row slice for part of a fused projection), detached."""
    W = weight_oi(view.module(t.path)).detach()
    return W[t.rows(W.shape[0])]


def write_target(view: LayerView, t: Target, W: torch.Tensor) -> None:
    """Write `W` into a target's rows, in place (in the module's device and dtype)."""
    with torch.no_grad():
        full = weight_oi(view.module(t.path))
        full[t.rows(full.shape[0])] = W.to(full.device, full.dtype)


def plus_bias(b: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """`b` plus the module's existing bias: a plan's bias replaces the module's, so a refit's bias adds to it."""
    old = getattr(module, "bias", None)
    return b if old is None else b + old.detach().to(b)


def qk_weights(view: LayerView) -> list[torch.Tensor | None]:
    """`[Wq, bq, Wk, bk]` of a layer, `(out, in)` layout, detached; row slices of a fused q|k|v projection (a bias
    is `None` where the projection has none)."""
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
