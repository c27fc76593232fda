"""Least-squares refit of the kept input channels of a module after some are removed (the closed form of Numerical
Pruning's Thm. 3, shared by the structured methods that compensate), in PyTorch layout: `W` is `(d_out, D)`, the
module computes `y = x Wᵀ`; `H = XᵀX / N` is the `(D, D)` Gram of the module's inputs.
"""

from __future__ import annotations

import torch

__all__ = ["compensate", "compensate_with_bias", "obs_compensation", "damped_cholesky_solve"]


def damped_cholesky_solve(A: torch.Tensor, B: torch.Tensor, damping: float, retries: int = 4) -> torch.Tensor:
    """Solve `(A + damping·mean(diag A)·I) X = B` by Cholesky, multiplying the damping by 10 on failure."""
    mean_diag = A.diagonal().mean().clamp_min(1e-30)
    eye = torch.eye(A.shape[0], dtype=A.dtype, device=A.device)
    damp = damping
    for _ in range(retries + 1):
        L, info = torch.linalg.cholesky_ex(A + damp * mean_diag * eye)  # (D, D)
        if int(info) == 0:
            return torch.cholesky_solve(B, L)
        damp = max(damp * 10, 1e-8)
    raise torch.linalg.LinAlgError(f"Cholesky failed even with damping {damp / 10:g}; the statistics are degenerate.")


def compensate(
    W: torch.Tensor, H: torch.Tensor, keep: torch.Tensor, damping: float = 0.01, strength: float = 1.0
) -> tuple[torch.Tensor, float]:
    """Least-squares refit of the kept input channels (Thm. 3, cheap form).

    `W[:, K] += s · W[:, P] · H[P, K] · (H[K, K] + γI)⁻¹`, then columns P are zero; γ = damping · mean(diag H),
    s = `strength` (1: the refit; 0: the kept weights unchanged; between: shrunk toward them).

    Args:
        W (`torch.Tensor` of shape `(d_out, D)`): weight.
        H (`torch.Tensor` of shape `(D, D)`): input Gram normalised by the token count.
        keep (`torch.LongTensor` of shape `(k,)`): kept input channels K.
        damping (`float`): relative ridge.
        strength (`float`): the fraction of the refit's change applied.

    Returns:
        `(W_new, residual)`: the full-size new weight (pruned columns zero) in W's dtype, and the per-token
        reconstruction loss `tr(δW H δWᵀ)` (= L* of Thm. 3) in float64.
    """
    Wd, Hd = W.double(), H.double()
    D = Wd.shape[1]
    mask = torch.zeros(D, dtype=torch.bool, device=W.device)
    mask[keep] = True
    K, P = mask.nonzero()[:, 0], (~mask).nonzero()[:, 0]
    W_new = torch.zeros_like(Wd)
    if K.numel():
        rhs = Hd[K][:, P] @ Wd[:, P].T  # (k, d_out)  = H_KP W_Pᵀ
        delta = damped_cholesky_solve(Hd[K][:, K], rhs, damping).T  # (d_out, k)
        W_new[:, K] = Wd[:, K] + strength * delta
    dW = W_new - Wd  # (d_out, D)
    residual = float(torch.einsum("od,de,oe->", dW, Hd, dW))
    return W_new.to(W.dtype), residual


def compensate_with_bias(
    W: torch.Tensor,
    H: torch.Tensor,
    mean: torch.Tensor,
    keep: torch.Tensor,
    damping: float = 0.01,
    strength: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Least-squares refit of the kept input channels *and* a bias: `min E‖W'_K x_K + b − W x‖²` (an extension).

    An intercept makes the refit act on centred inputs: [`compensate`] on the covariance `Σ = H − μμᵀ` gives `W'`,
    and `b = (W − W') μ` restores the mean output (so the removed channels' mean contribution, FLAP's bias
    compensation, is part of it). The ridge `damping · mean(diag Σ[K, K])` applies to the weights, not to `b`.
    With `strength` s < 1 the weights take the fraction s of the refit's change and `b` restores the mean output of
    those weights: s = 0 is FLAP's bias compensation exactly, `b = W[:, P] μ_P`.

    Args:
        W (`torch.Tensor` of shape `(d_out, D)`): weight.
        H (`torch.Tensor` of shape `(D, D)`): input Gram normalised by the token count.
        mean (`torch.Tensor` of shape `(D,)`): per-channel input mean.
        keep (`torch.LongTensor` of shape `(k,)`): kept input channels K.
        damping (`float`): relative ridge.

    Returns:
        `(W_new, bias, residual)`: the full-size new weight (pruned columns zero) and the bias to *add* to the
        module's existing bias, both in W's dtype, and the per-token loss `E‖(W' − W) x + b‖²` in float64.
    """
    mu = mean.double().to(W.device)  # (D,)
    cov = H.double() - torch.outer(mu, mu)  # (D, D)
    W_new, residual = compensate(W, cov, keep, damping, strength)
    bias = (W.double() - W_new.double()) @ mu  # (d_out,)
    return W_new, bias.to(W.dtype), residual


def obs_compensation(W: torch.Tensor, H: torch.Tensor, prune: torch.Tensor) -> torch.Tensor:
    """Reference OBS form of Thm. 3 (paper layout transposed): `δW_paper = −H⁻¹[:,P] (H⁻¹[P,P])⁻¹ W_paper[P,:]`.

    Slow (full inverse), used by the tests to check `compensate`.
    """
    Wp = W.double().T  # (D, d_out) paper layout
    Hinv = torch.linalg.inv(H.double())  # (D, D)
    delta = -Hinv[:, prune] @ torch.linalg.inv(Hinv[prune][:, prune]) @ Wp[prune, :]  # (D, d_out)
    return (Wp + delta).T  # (d_out, D)
