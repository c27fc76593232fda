"""Least-squares refit of the kept input channels of a module after some are removed (the closed form of Numerical
Pruning's Thm. 3, shared by the structured methods that compensate), in PyTorch layout: `W` is `(d_out, D)`, the
module computes `y = x Wᵀ`; `H = XᵀX / N` is the `(D, D)` Gram of the module's inputs.

The solves run in float64 on `(D, D)` matrices (D up to the MLP width), so they hold as few of them as the arithmetic
allows: the damping is added to the diagonal and the Cholesky factor overwrites its matrix, and the refit reads only
the blocks of `H` it needs, converted as it reads them. The refit's solve (many right-hand sides, without the copy of
the factor `torch.cholesky_solve` makes) equals the direct formulas to float64 rounding (see tests/test_memory.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["compensate", "compensate_with_bias", "obs_compensation", "damped_cholesky_solve"]


def _symmetric(A: torch.Tensor, step: int = 256) -> bool:
    """Whether `A` equals its transpose exactly (checked a band of rows at a time)."""
    return all(torch.equal(A[i : i + step], A[:, i : i + step].mT) for i in range(0, A.shape[0], step))


def damped_cholesky_solve(
    A: torch.Tensor,
    B: torch.Tensor,
    damping: float,
    retries: int = 4,
    rebuild: Callable[[], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Solve `(A + damping·mean(diag A)·I) X = B` by Cholesky, multiplying the damping by 10 on failure.

    The factor is computed in a column-major buffer (LAPACK's layout: no hidden copy) and `X` by two triangular solves
    in a column-major copy of `B` (the operations of `torch.cholesky_solve`, without its copy of the factor).
    Without `rebuild`, `A` is unchanged and one copy of it holds the factor. With `rebuild` (a function returning `A`
    again) and an exactly symmetric `A`, the factor overwrites `A`'s own memory (read column-major, it is the same
    matrix) and a retry calls `rebuild()` for a fresh `A`: no copy of `A` at all."""
    X = _column_major(B)
    L, _ = _damped_cholesky(A, damping, retries, rebuild)
    torch.linalg.solve_triangular(L, X, upper=False, out=X)
    return torch.linalg.solve_triangular(L.mT, X, upper=True, out=X)


def _column_major(B: torch.Tensor) -> torch.Tensor:
    """A copy of `B` laid out column by column (what LAPACK's solves work in, in place)."""
    X = torch.empty_like(B.mT).mT
    return X.copy_(B)


def _squared_norm(X: torch.Tensor) -> float:
    """`‖X‖²` without a temporary as large as `X`: a dot product of its memory with itself."""
    v = (X if X.is_contiguous() else X.mT).reshape(-1)  # a view where X is laid out by rows or by columns
    return float(torch.dot(v, v))


def _damped_cholesky(A, damping, retries=4, rebuild=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The lower Cholesky factor `L` (column-major) of `A + γI`, `γ = damping·mean(diag A)` (the damping ×10 on a
    failure), and `γ`; see [`damped_cholesky_solve`] for where `L` lives."""
    mean_diag = A.diagonal().mean().clamp_min(1e-30)
    diag = A.diagonal().clone()  # (D,) the undamped diagonal
    in_place = rebuild is not None and _symmetric(A)
    L = A.mT if in_place else torch.empty_like(A).mT  # column-major
    if not in_place:
        L.copy_(A)
    info = torch.zeros((), dtype=torch.int32, device=A.device)
    damp = damping
    for attempt in range(retries + 1):
        if attempt:
            L.copy_(rebuild() if in_place else A)
        L.diagonal().copy_(diag + damp * mean_diag)  # = A + damp·mean·I, entry for entry
        torch.linalg.cholesky_ex(L, out=(L, info))  # in place: L's lower triangle becomes the factor
        if int(info) == 0:
            return L, damp * mean_diag
        damp = max(damp * 10, 1e-8)
    raise torch.linalg.LinAlgError(f"Cholesky failed even with damping {damp / 10:g}; the statistics are degenerate.")


def _gram_block(
    H: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, mu: torch.Tensor | None, step: int = 1024
) -> torch.Tensor:
    """`(H − μμᵀ)[rows][:, cols]` in float64 (`μ = 0` when `mu` is None), read from `H` `step` rows at a time."""
    block = torch.empty(len(rows), len(cols), dtype=torch.float64, device=H.device)
    for start in range(0, len(rows), step):
        r = rows[start : start + step]
        block[start : start + step] = H[r[:, None], cols[None, :]]
        if mu is not None:
            block[start : start + step] -= torch.outer(mu[r], mu[cols])
    return block


def _quadratic_trace(V: torch.Tensor, H: torch.Tensor, idx: torch.Tensor, mu, columns: int = 2048) -> float:
    """`tr(V (H − μμᵀ)[idx][:, idx] Vᵀ)` in float64 (`V`: `(d_out, len(idx))`), reading `H` by bands of columns."""
    total = 0.0
    for start in range(0, len(idx), columns):
        block = _gram_block(H, idx, idx[start : start + columns], mu)  # (len(idx), columns)
        total += float(((V @ block) * V[:, start : start + columns]).sum())
    return total


def _refit(
    W: torch.Tensor,
    H: torch.Tensor,
    keep: torch.Tensor,
    damping: float,
    strength: float,
    mu: torch.Tensor | None,
    step: int = 1024,
) -> tuple[torch.Tensor, float]:
    """[`compensate`] on the Gram `G = H − μμᵀ`; returns the new weight in W's dtype and the residual.

    Held in float64 at once: `G_KK` (it becomes its own Cholesky factor `L`), one `(k, d_out)` right-hand side (it
    becomes the solution) and `W_P`; the new weight is written `step` kept columns at a time. The residual
    `tr(δW G δWᵀ)`, with `δW_K = sΔ` and `δW_P = −W_P`, is
    `s²·tr(Δ G_KK Δᵀ) − 2s·tr(Δ G_KP W_Pᵀ) + tr(W_P G_PP W_Pᵀ)`, where with `R = G_KP W_Pᵀ` and `Y = L⁻¹R` (the
    first triangular solve) `tr(Δ G_KP W_Pᵀ) = ‖Y‖²` and `tr(Δ G_KK Δᵀ) = ‖Y‖² − γ‖Δ‖²`: only `G_PP` is read again."""
    D = W.shape[1]
    mask = torch.zeros(D, dtype=torch.bool, device=W.device)
    mask[keep] = True
    K, P = mask.nonzero()[:, 0], (~mask).nonzero()[:, 0]
    if not P.numel():  # nothing removed: the refit's change is exactly zero (no (D, D) float64 factor to build)
        return W.clone(), 0.0
    W_P = W[:, P].double()  # (d_out, p)
    residual = _quadratic_trace(W_P, H, P, mu)  # tr(W_P G_PP W_Pᵀ): the loss of the bare removal
    W_new = torch.zeros_like(W)
    if K.numel():
        X = _column_major(_gram_block(H, K, P, mu) @ W_P.T)  # (k, d_out) R = G_KP W_Pᵀ
        del W_P
        L, shift = _damped_cholesky(_gram_block(H, K, K, mu), damping, rebuild=lambda: _gram_block(H, K, K, mu))
        torch.linalg.solve_triangular(L, X, upper=False, out=X)  # Y = L⁻¹ R
        cross = _squared_norm(X)  # ‖Y‖² = tr(Δ (G_KK + γI) Δᵀ)
        torch.linalg.solve_triangular(L.mT, X, upper=True, out=X)  # Δᵀ = L⁻ᵀ Y
        del L
        residual += strength**2 * (cross - float(shift) * _squared_norm(X)) - 2 * strength * cross
        X.mul_(strength)
        for start in range(0, len(K), step):  # W_K + sΔ a band of columns at a time: no (d_out, k) temporaries
            cols = K[start : start + step]
            W_new[:, cols] = (W[:, cols].double() + X[start : start + step].T).to(W.dtype)
    return W_new, residual


def compensate(
    W: torch.Tensor, H: torch.Tensor, keep: torch.Tensor, damping: float = 0.01, strength: float = 1.0
) -> tuple[torch.Tensor, float]:
    """Least-squares refit of the kept input channels (Thm. 3, cheap form).

    `W[:, K] += s · W[:, P] · H[P, K] · (H[K, K] + γI)⁻¹`, then columns P are zero; γ = damping · mean(diag H),
    s = `strength` (1: the refit; 0: the kept weights unchanged; between: shrunk toward them). Only the `(k, k)`
    and `(k, D − k)` blocks of `H` are held in float64 (`H` itself stays as given, e.g. float32).

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
    return _refit(W, H, keep.to(W.device), damping, strength, None)


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
    those weights: s = 0 is FLAP's bias compensation exactly, `b = W[:, P] μ_P`. `Σ` is never formed whole: its
    blocks are read from `H` and `μ` as the refit needs them.

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
    W_new, residual = _refit(W, H, keep.to(W.device), damping, strength, mu)
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
