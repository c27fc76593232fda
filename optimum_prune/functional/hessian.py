"""Damped Cholesky factorisations of layer Hessians `H = X Xᵀ` (damping relative to mean(diag H)), as SparseGPT, RIA
and FISTA use them.

Conventions (SparseGPT, official code):

- dead input channels (`diag(H) == 0`, e.g. an input that is always zero) get `H[d, d] = 1`; callers zero the matching
  weight columns `W[:, d]`, which [`dead_channels`] identifies;
- damping adds `percdamp * mean(diag(H)) * I`; when the factorisation fails, the damping is multiplied by 10 and the
  factorisation retried (RIA retries with 0.1 after 0.01);
- factorisations run in float32, or in float64 when `H` is float64. The input is never modified.

[`largest_eigenvalue`] gives the step-size constant of gradient methods on `H` (FISTA's `L`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

__all__ = ["dead_channels", "damped_cholesky", "cholesky_inverse_upper", "largest_eigenvalue"]

logger = logging.getLogger(__name__)


def dead_channels(H: torch.Tensor) -> torch.Tensor:
    """Boolean mask of dead input channels, `diag(H) == 0`.

    Args:
        H (`torch.Tensor` of shape `(in_features, in_features)`): Hessian / Gram matrix of the layer input.
    """
    return torch.diagonal(H) == 0  # (in,)


def _work_dtype(H: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    return torch.float64 if H.dtype == torch.float64 else torch.float32


def _damped_copies(
    H: torch.Tensor, percdamp: float, retries: int, dtype: torch.dtype | None
) -> Iterator[tuple[float, torch.Tensor]]:
    """Yields `(percdamp_used, H + percdamp_used * mean(diag H) * I)` for the first try and each retry."""
    if H.dim() != 2 or H.shape[0] != H.shape[1]:
        raise ValueError(f"H must be a square matrix, got shape {tuple(H.shape)}.")
    if percdamp < 0:
        raise ValueError(f"percdamp must be >= 0, got {percdamp}.")
    if retries < 0:
        raise ValueError(f"retries must be >= 0, got {retries}.")
    Hd = H.to(_work_dtype(H, dtype), copy=True)  # (in, in)
    if not torch.isfinite(Hd).all():
        raise ValueError("H contains NaN or Inf; check the calibration statistics.")
    diag = torch.diagonal(Hd)  # (in,) a view: writes go to Hd
    diag[diag == 0] = 1.0  # SparseGPT: dead channels get H[d, d] = 1
    mean_diag = diag.mean()  # () computed after the dead-channel fix, as in SparseGPT
    applied = 0.0
    for attempt in range(retries + 1):
        frac = percdamp if attempt == 0 else max(percdamp, 1e-3) * 10**attempt
        diag.add_(mean_diag * (frac - applied))  # increments the damping in place
        applied = frac
        yield frac, Hd


def _failed(frac: float, attempt: int, retries: int, what: str) -> None:
    if attempt < retries:
        logger.warning("%s failed with percdamp=%g; retrying with 10x more damping.", what, frac)


def damped_cholesky(
    H: torch.Tensor, percdamp: float = 0.01, retries: int = 2, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Lower Cholesky factor `L` of `H + percdamp * mean(diag H) * I` (dead channels set to 1 first).

    Args:
        H (`torch.Tensor` of shape `(in_features, in_features)`): symmetric positive semi-definite Hessian.
        percdamp (`float`, defaults to `0.01`): damping relative to the mean diagonal.
        retries (`int`, defaults to `2`): extra attempts, each with 10x more damping, after a failed factorisation.
        dtype (`torch.dtype`, *optional*): working dtype; defaults to float64 for float64 input, else float32.

    Returns:
        `torch.Tensor` of shape `(in_features, in_features)`: lower-triangular `L` with `L Lᵀ = H_damped`.

    Raises:
        `torch.linalg.LinAlgError` when every attempt fails.
    """
    for attempt, (frac, Hd) in enumerate(_damped_copies(H, percdamp, retries, dtype)):
        L, info = torch.linalg.cholesky_ex(Hd)  # (in, in)
        if int(info.item()) == 0:
            return L
        _failed(frac, attempt, retries, "Cholesky factorisation")
    raise torch.linalg.LinAlgError(
        f"Cholesky factorisation of H failed even with percdamp={frac:g}; the calibration Hessian is not usable."
    )


def cholesky_inverse_upper(
    H: torch.Tensor, percdamp: float = 0.01, retries: int = 2, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Upper Cholesky factor `U` of `H_damped⁻¹` (`Uᵀ U = H_damped⁻¹`), the `Hinv` of SparseGPT.

    Row `j` of `U` divided by `U[j, j]` is the OBS update direction for removing input `j` when inputs `< j` are
    already fixed: `U[j, j:] / U[j, j] = [H_F⁻¹]_{0,:} / [H_F⁻¹]_{0,0}` with `F = {j, ..., n-1}`.

    Args:
        H (`torch.Tensor` of shape `(in_features, in_features)`): symmetric positive semi-definite Hessian.
        percdamp (`float`, defaults to `0.01`): damping relative to the mean diagonal.
        retries (`int`, defaults to `2`): extra attempts, each with 10x more damping.
        dtype (`torch.dtype`, *optional*): working dtype; defaults to float64 for float64 input, else float32.

    Returns:
        `torch.Tensor` of shape `(in_features, in_features)`: upper-triangular `U`.

    Raises:
        `torch.linalg.LinAlgError` when every attempt fails.
    """
    for attempt, (frac, Hd) in enumerate(_damped_copies(H, percdamp, retries, dtype)):
        F, info = torch.linalg.cholesky_ex(Hd)  # (in, in) column-major: LAPACK's layout, so the next two work in it
        if int(info.item()) == 0:  # two (in, in) matrices at once (Hd and F), not four
            torch.cholesky_inverse(F, out=F)  # F = H_damped⁻¹ (LAPACK's potri overwrites the factor)
            torch.linalg.cholesky_ex(F, upper=True, out=(F, info))  # F's upper triangle = U
            if int(info.item()) == 0 and bool(torch.isfinite(F.triu_()).all()):
                return F
        _failed(frac, attempt, retries, "Cholesky factorisation of H or H⁻¹")
    raise torch.linalg.LinAlgError(
        f"Cholesky factorisation of H⁻¹ failed even with percdamp={frac:g}; the calibration Hessian is not usable."
    )


def largest_eigenvalue(H: torch.Tensor, method: str = "auto", iters: int = 100, rtol: float = 1e-6) -> float:
    """Largest eigenvalue of a symmetric PSD matrix (e.g. the FISTA Lipschitz constant `λ_max(X* X*ᵀ)`).

    Args:
        H (`torch.Tensor` of shape `(n, n)`): symmetric positive semi-definite matrix.
        method (`str`, defaults to `"auto"`): `"eigh"` (exact, O(n³)), `"power"` (power iteration, O(n²) per step,
            result multiplied by 1.01 as a safety margin against underestimation) or `"auto"` (eigh for n ≤ 1024).
        iters (`int`, defaults to `100`): maximum power iterations.
        rtol (`float`, defaults to `1e-6`): relative change of the estimate that stops the power iteration.
    """
    n = H.shape[0]
    H = H if H.dtype in (torch.float32, torch.float64) else H.float()
    if method == "eigh" or (method == "auto" and n <= 1024):
        return float(torch.linalg.eigvalsh(H.double()).max().item())
    if method not in ("power", "auto"):
        raise ValueError(f"method must be 'auto', 'eigh' or 'power', got {method!r}.")
    gen = torch.Generator(device=H.device).manual_seed(0)
    v = torch.randn(n, generator=gen, device=H.device, dtype=H.dtype)  # (n,)
    v /= v.norm()
    est = 0.0
    for _ in range(iters):
        u = H @ v  # (n,)
        new = float(torch.dot(u, v).item())  # Rayleigh quotient
        norm = u.norm()
        if norm == 0:
            return 0.0
        v = u / norm
        if abs(new - est) <= rtol * abs(new):
            est = new
            break
        est = new
    return est * 1.01
