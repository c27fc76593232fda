"""The paper's closed-form gradients and its fused-W descent (Theorem D.5), kept as float64 references for the
tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .attention import attention_mask

__all__ = ["fused_amp_masks", "fused_mask_gradient", "separate_mask_gradients", "softmax_causal"]


def softmax_causal(S: torch.Tensor) -> torch.Tensor:
    """Row softmax of `S` over the causal (lower-triangular) entries; `diag((exp(S)∘M_c)1)⁻¹(exp(S)∘M_c)`."""
    n = S.shape[-1]
    return torch.softmax(S.masked_fill(~attention_mask(n, device=S.device), float("-inf")), dim=-1)


def _p(S: torch.Tensor, f: torch.Tensor, dense_in_p1: bool = False) -> torch.Tensor:
    ft = softmax_causal(S)
    c = ft - f
    p1 = c * (f if dense_in_p1 else ft)
    return p1 - p1.sum(-1, keepdim=True) * ft


def fused_mask_gradient(
    M: torch.Tensor,
    W: torch.Tensor,
    Xs: Sequence[torch.Tensor],
    lambda_: float,
    dense_in_p1: bool = False,
    dense: torch.Tensor | None = None,
) -> torch.Tensor:
    """∇_M of `Σ_j ½‖softmax_c(X_j(M∘W)X_jᵀ) − softmax_c(X_jWX_jᵀ)‖² + ½λ‖M‖²` in the paper's closed form:
    `W ∘ Σ_j X_jᵀ p_j X_j + λM` (Theorem 5.3 / D.5; `dense_in_p1` gives Algorithm 1's printed variant; `dense`:
    the precomputed `softmax_c(X_jWX_jᵀ)`, stacked)."""
    X = torch.stack(list(Xs))
    Xt = X.transpose(-1, -2)
    f = softmax_causal(X @ W @ Xt) if dense is None else dense
    return W * (Xt @ _p(X @ (M * W) @ Xt, f, dense_in_p1) @ X).sum(0) + lambda_ * M


def fused_amp_masks(
    W: torch.Tensor,
    Xs: Sequence[torch.Tensor],
    *,
    lambda_: float,
    lr: float,
    steps: int = 100,
    momentum: float = 0.9,
    regularizer: str = "unscaled",
) -> torch.Tensor:
    """The paper's fused-W form (Algorithm 1; the theory and synthetic experiments): a single mask on
    `W = W_Q W_Kᵀ` (`d × d`, right-multiplied, no scaling, causal), heavy-ball descent from ones with the closed-form
    gradient averaged over the `k` samples; `regularizer="divided_by_k"` divides λM by k as printed."""
    k = len(Xs)
    reg = lambda_ if regularizer == "unscaled" else lambda_ / k
    X = torch.stack(list(Xs))
    dense = softmax_causal(X @ W @ X.transpose(-1, -2))
    M, V = torch.ones_like(W), torch.zeros_like(W)
    for _ in range(steps):
        V = momentum * V + fused_mask_gradient(M, W, X, 0.0, dense=dense) / k + reg * M
        M = M - lr * V
        if not torch.isfinite(M).all():
            raise FloatingPointError("the fused AMP descent diverged; lower lr.")
    return M


def separate_mask_gradients(
    MQ: torch.Tensor, MK: torch.Tensor, WQ: torch.Tensor, WK: torch.Tensor, Xs: Sequence[torch.Tensor], lambda_: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed-form gradients of the separate-mask loss (paper convention: `W_Q, W_K` are `d × d'`, right-multiplied):
    `∇M_Q = W_Q ∘ Σ Xᵀ p X (M_K∘W_K) + λM_Q`, `∇M_K = W_K ∘ Σ Xᵀ pᵀ X (M_Q∘W_Q) + λM_K`."""
    gq, gk = torch.zeros_like(MQ), torch.zeros_like(MK)
    Qm, Km = MQ * WQ, MK * WK
    for X in Xs:
        f = softmax_causal(X @ WQ @ WK.T @ X.T)
        p = _p(X @ Qm @ Km.T @ X.T, f)
        gq += X.T @ p @ X @ Km
        gk += X.T @ p.T @ X @ Qm
    return WQ * gq + lambda_ * MQ, WK * gk + lambda_ * MK
