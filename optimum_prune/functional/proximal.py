"""Proximal operators used by the convex solvers (FISTA; see docs/methods/fista.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["soft_threshold", "nonnegative_soft_threshold"]


def soft_threshold(x: torch.Tensor, tau: float | torch.Tensor) -> torch.Tensor:
    """Elementwise soft-thresholding `sign(x) * max(|x| - tau, 0)`, the proximal map of `tau * ||x||_1`.

    Entries with `|x| <= tau` become exactly `0`.

    Args:
        x (`torch.Tensor`): input of any shape.
        tau (`float` or `torch.Tensor`): non-negative threshold; a tensor must broadcast against `x`
            (e.g. one threshold per row with shape `(rows, 1)`).
    """
    if isinstance(tau, torch.Tensor):
        if (tau < 0).any():
            raise ValueError("soft_threshold needs tau >= 0.")
        return x - torch.clamp(x, min=-tau, max=tau)  # same shape as x; |x| <= tau gives x - x = 0 exactly
    if tau < 0:
        raise ValueError(f"soft_threshold needs tau >= 0, got {tau}.")
    return F.softshrink(x, float(tau))  # same shape as x


def nonnegative_soft_threshold(x: torch.Tensor, tau: float) -> torch.Tensor:
    """One-sided soft-thresholding `max(x - tau, 0)`: the proximal map of `tau * ||x||_1` plus the indicator of
    `x >= 0` (non-negative variables such as masks)."""
    if tau < 0:
        raise ValueError(f"nonnegative_soft_threshold needs tau >= 0, got {tau}.")
    return torch.clamp(x - tau, min=0)  # same shape as x
