"""Closed-form removal scores of a projection's input channels from the Gram of its inputs: the numerical scores
of Numerical Pruning (docs/methods/numerical.md), which the methods that rank channels this way share (NP, the
experts' channels, SPP's `channel_order="np"`). PyTorch layout: `W` is `(d_out, D)`, the module computes `y = x Wᵀ`;
`H = XᵀX / N` is the `(D, D)` Gram of the module's inputs. The solves run in float64 on `(D, D)` matrices, built in
place and factored in their own memory (`compensation.damped_cholesky_solve` with `rebuild`).
"""

from __future__ import annotations

import torch

from .compensation import damped_cholesky_solve

__all__ = ["score_matrix", "unit_score_matrix", "numerical_scores"]


def score_matrix(W: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """`A = (W_paper W_paperᵀ) ∘ (XᵀX)`: Gram of W's columns times the input Gram, elementwise. (D, D) float64, the
    only `(D, D)` matrix this allocates (`H` is read as it is, in any float dtype)."""
    W = W.double()
    A = W.T @ W  # (D, D)
    del W
    for i in range(0, A.shape[0], 256):  # a band at a time: a mixed-dtype product converts its operand first
        A[i : i + 256].mul_(H[i : i + 256])  # = A * H.double(), entry for entry
    return A


def _alive_block(A: torch.Tensor, alive: torch.Tensor | None) -> torch.Tensor:
    """`A[alive][:, alive]` in one allocation (`A` itself when every entry is alive, `alive=None`)."""
    if alive is None:
        return A
    idx = alive.nonzero()[:, 0]
    return A[idx[:, None], idx[None, :]]


def unit_score_matrix(A: torch.Tensor, unit_size: int = 1) -> torch.Tensor:
    """`B = Pᵀ A P`: the score matrix of masks shared by units of `unit_size` consecutive channels (a head: its
    `D_h` channels; a KV group: its `n_rep·D_h`), with `P` the `(D, D / unit_size)` 0/1 membership matrix.

    Sharing one mask `z_u` per unit (`z = P z_u`, the paper's "internal computation alignment") turns the objective
    `½ (z − 1)ᵀ A (z − 1)` into `½ (z_u − 1)ᵀ B (z_u − 1)`: B sums A's blocks. (n, n)."""
    if unit_size == 1:
        return A
    n = A.shape[0] // unit_size
    if n * unit_size != A.shape[0]:
        raise ValueError(f"{A.shape[0]} channels do not split into units of {unit_size}.")
    return A.reshape(n, unit_size, n, unit_size).sum((1, 3))


def numerical_scores(
    W: torch.Tensor,
    H: torch.Tensor,
    ratio: float,
    lambda_: float | None = None,
    damping: float = 1e-6,
    unit_size: int = 1,
) -> torch.Tensor:
    """Closed-form minimiser of `f(z) = ½ Σ_i ‖X W_i − X (z∘W_i)‖² + ½ λ (1ᵀz − r)²` (Eqs. 6-7).

    `z* = 1 − c·u` with `u = A⁻¹1`, `s = 1ᵀu`, `c = λ(D−r)/(1+λs)` (or `(D−r)/s` for λ → ∞). Dead channels
    (`diag A = 0`) score −∞ and are pruned first.

    With `unit_size = m > 1` the mask is shared by units of m consecutive channels, `z = P z_u` (one mask per head
    or KV group, as pruning applies it): the same objective over `z_u` has `A` replaced by `B = PᵀAP`
    ([`unit_score_matrix`]) and the count `1ᵀz = m·1ᵀz_u`, so `z_u* = 1 − c·B⁻¹1` with `c = (D−r)/(m·s)` (or
    `λm(D−r)/(1+λm²s)`), `s = 1ᵀB⁻¹1`. In the uncorrelated case a unit scores by the *sum* of its channels'
    `‖W_:,j‖²‖X_j‖²` where the mean of its channel scores weighs it by the harmonic mean (its weakest channels).

    Args:
        W (`torch.Tensor` of shape `(d_out, D)`): weight of o_proj / down_proj.
        H (`torch.Tensor` of shape `(D, D)`): input Gram (any positive scaling).
        ratio (`float`): target pruning ratio ρ; r = (1 − ρ)·D.
        lambda_ (`float | None`): dimensionless λ (× mean diag A), `None` for the exact constraint.
        damping (`float`): relative ridge on A (on B for units).
        unit_size (`int`, defaults to `1`): channels per shared mask.

    Returns:
        `torch.Tensor` of shape `(D / unit_size,)`, float64.
    """
    A = score_matrix(W, H)  # (D, D)
    d = A.diagonal()
    lam = None if lambda_ is None or not (d > 0).any() else lambda_ * d[d > 0].mean()  # absolute: live channels' A
    del d
    A = unit_score_matrix(A, unit_size)  # (n, n)
    n, m = A.shape[0], unit_size
    alive = A.diagonal() > 0  # (n,)
    z = torch.full((n,), float("-inf"), dtype=torch.float64, device=A.device)
    if not alive.any():
        return z
    live = None if bool(alive.all()) else alive
    A = _alive_block(A, live)
    ones = torch.ones(A.shape[0], 1, dtype=A.dtype, device=A.device)
    rebuild = lambda: _alive_block(unit_score_matrix(score_matrix(W, H), unit_size), live)  # noqa: E731
    u = damped_cholesky_solve(A, ones, damping, rebuild=rebuild)[:, 0]  # (n_alive,)
    s = u.sum()
    excess = ratio * m * A.shape[0]  # D − r over the live channels
    c = excess / (m * s) if lam is None else lam * m * excess / (1 + lam * m * m * s)
    z[alive] = 1 - c * u
    return z
