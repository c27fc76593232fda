"""Numerical Pruning math (docs/methods/numerical.md), in PyTorch layout: `W` is `(d_out, D)`, the module computes
`y = x Wᵀ`; `H = XᵀX / N` is the `(D, D)` Gram of the module's inputs. Paper layout is `W_paper = Wᵀ`.

The score solves run in float64 on `(D, D)` matrices (D up to the MLP width): the score matrix is built in place and
factored in its own memory (`functional.compensation.damped_cholesky_solve` with `rebuild`), so the scores are the
same numbers as the direct formulas while one such matrix is held. The refit is `functional.compensation`'s.
"""

from __future__ import annotations

import torch

from ...functional.compensation import damped_cholesky_solve
from ...functional.gram_scores import numerical_scores, score_matrix, unit_score_matrix

__all__ = [
    "score_matrix",
    "unit_score_matrix",
    "numerical_scores",
    "numerical_scores_newton",
    "removal_losses",
]


def numerical_scores_newton(
    W: torch.Tensor,
    H: torch.Tensor,
    ratio: float,
    lambda_: float,
    iters: int = 50,
    z0: torch.Tensor | None = None,
    damping: float = 1e-6,
    unit_size: int = 1,
) -> torch.Tensor:
    """The paper's Algorithm 1: `z ← z − H_z⁻¹ g(z)` with `g = A(z−1) + λ(1ᵀz − r)1`, `H_z = A + λ11ᵀ`; with
    `unit_size = m`, over one mask per unit: `g = B(z−1) + λm(m·1ᵀz − r)1`, `H_z = B + λm²11ᵀ` (see
    [`numerical_scores`])."""
    A = score_matrix(W, H)  # (D, D)
    lam = lambda_ * A.diagonal()[A.diagonal() > 0].mean()
    A = unit_score_matrix(A, unit_size)  # (n, n)
    m = unit_size
    alive = A.diagonal() > 0
    out = torch.full((A.shape[0],), float("-inf"), dtype=torch.float64, device=A.device)
    A = A[alive][:, alive]
    Da = A.shape[0]
    A = A + damping * A.diagonal().mean() * torch.eye(Da, dtype=A.dtype, device=A.device)
    r = (1 - ratio) * m * Da
    ones = torch.ones(Da, dtype=A.dtype, device=A.device)
    Hz = A + lam * m * m * torch.outer(ones, ones)  # (Da, Da)
    L = torch.linalg.cholesky(Hz)
    z = torch.full((Da,), 0.5, dtype=A.dtype, device=A.device) if z0 is None else z0.double()[alive].clone()
    for _ in range(iters):
        g = A @ (z - 1) + lam * m * (m * z.sum() - r) * ones  # (Da,)
        z = z - torch.cholesky_solve(g[:, None], L)[:, 0]
    out[alive] = z
    return out


def removal_losses(
    W: torch.Tensor, H: torch.Tensor, groups: torch.Tensor, damping: float = 0.01, compensated: bool = True
) -> torch.Tensor:
    """Per-token output loss of removing each group of input channels on its own (the `"loss"` ranking).

    With compensation it is Thm. 3's optimum `L*(P) = tr(W_P ((H⁻¹)_PP)⁻¹ W_Pᵀ)`, `W_P = W[:, P]`: the loss left
    after the kept channels are refitted (the quantity [`compensate`] minimises), on `H + γI` with
    `γ = damping · mean(diag H)` as in the refit. Without compensation it is the plain `tr(W_P H_PP W_Pᵀ)`. The
    loss is `E‖δy‖²` in the units of the module's output, so groups of different modules and layers compare.

    Args:
        W (`torch.Tensor` of shape `(d_out, D)`): weight of o_proj / down_proj.
        H (`torch.Tensor` of shape `(D, D)`): input Gram normalised by the token count (or covariance).
        groups (`torch.LongTensor` of shape `(n, m)`): `n` groups of `m` input channels (a head: its `D_h` channels;
            an MLP channel: `m = 1`).
        damping (`float`): relative ridge, as in the refit.
        compensated (`bool`): the loss after the optimal refit (True) or of the bare removal (False).

    Returns:
        `torch.Tensor` of shape `(n,)`, float64, ≥ 0.
    """
    Wd, Hd = W.double(), H.double()
    groups = groups.to(Wd.device)
    if compensated:
        eye = torch.eye(Hd.shape[0], dtype=Hd.dtype, device=Hd.device)
        Hd = damped_cholesky_solve(Hd, eye, damping)  # (D, D) = (H + γI)⁻¹
    M = Hd[groups[:, :, None], groups[:, None, :]]  # (n, m, m)
    Wp = Wd.T[groups]  # (n, m, d_out) = W_Pᵀ per group
    if compensated:
        M = 0.5 * (M + M.transpose(1, 2))
        Wp_solved = torch.linalg.solve(M, Wp)  # (n, m, d_out) = ((H⁻¹)_PP)⁻¹ W_Pᵀ
    else:
        Wp_solved = M @ Wp  # (n, m, d_out) = H_PP W_Pᵀ
    return (Wp * Wp_solved).sum((1, 2)).clamp_min(0)
