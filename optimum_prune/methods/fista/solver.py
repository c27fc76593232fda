"""The inner FISTA iterations of FISTAPruner (paper Eq. 5), run on all rows of a projection at once.

Everything is in Gram form: with `Gs = X* X*ᵀ` and `C = X X*ᵀ` (n×n), the gradient of `½ ||W* X* − W X||_F²` is
`W* Gs − W C`, so an iteration costs one m×n×n GEMM whatever the number of calibration tokens.

Spectral iterations. The adaptive λ of the paper drives λ towards 0 whenever rounding contributes little error
(`E_round / E_total ≤ ξ`), which is the usual case: after a few outer steps the soft threshold `τ = λ / L` is so small
that it cannot move `W*` by more than FISTA's own tolerance, and each outer step is plain accelerated gradient descent
on the quadratic, followed by rounding. In the eigenbasis of `Gs = Q diag(d) Qᵀ` that quadratic is separable: with
`Z = W* Q` and `B = W C Q` the gradient step is `Z − (Z diag(d) − B) / L`, elementwise. Those steps then cost O(m·n)
instead of O(m·n²), leaving two m×n×n GEMMs per outer step (back to the weight basis for rounding, and forward again)
instead of K + 2. The iterates are the same as the direct ones up to that tolerance (tested); see
[`prox_is_negligible`].

Closed form of the spectral iterations. Column `j` of `Z` evolves by the scalar affine map `z -> a_j z + s`
(`a_j = 1 − d_j / L`, `s = B_j / L`), whose fixed point lies on the line from `Z_0` along the first step
`R = Z_1 − Z_0 = B / L − Z_0 diag(d) / L`. Every FISTA iterate therefore is `Z_0 + R diag(w)` with a per-column
weight `w` that follows the same recurrence on a vector of length `n` (`w -> 1 + a ∘ w`, extrapolated with the same
momentum), and the step norm of the early stop is `||R diag(Δw)||_F = sqrt(Σ_j Δw_j² ||R_j||²)`. The `K` iterations
then cost O(K·n) plus two O(m·n) passes instead of K O(m·n) passes, with the same iterates (tested against the
elementwise recurrence and the weight-basis iterations).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ...functional.hessian import largest_eigenvalue
from ...functional.proximal import soft_threshold

__all__ = [
    "lipschitz_constant",
    "SpectralGram",
    "spectral_gram",
    "prox_is_negligible",
    "fista_inner",
    "fista_inner_spectral",
]

_MOMENTUM = ("standard", "paper", "none")


def lipschitz_constant(Gs: torch.Tensor, method: str = "eigh", dtype: torch.dtype | None = None) -> float:
    """Step-size constant `L = λ_max(Gs)` of the smooth part (paper §3.2); see [`largest_eigenvalue`].

    Args:
        Gs (`torch.Tensor` of shape `(n, n)`): pruned-input Gram `X* X*ᵀ`.
        method (`str`, defaults to `"eigh"`): `"eigh"` (exact eigenvalues in float64), `"power"` or `"auto"`.
        dtype (`torch.dtype`, *optional*): round the value to this dtype (as [`SpectralGram.L`] is), so that both
            give the same step size.
    """
    L = largest_eigenvalue(Gs, method=method)
    return L if dtype is None else float(torch.tensor(max(L, 0.0), dtype=dtype).item())


class SpectralGram(NamedTuple):
    """Eigendecomposition `Gs = Q diag(d) Qᵀ` of a pruned-input Gram, shared by the projections that read it."""

    Q: torch.Tensor  # (n, n) orthonormal eigenvectors (columns), in the working dtype
    d: torch.Tensor  # (n,) eigenvalues, ascending, clamped at 0, in the working dtype

    @property
    def L(self) -> float:
        """The Lipschitz constant `λ_max(Gs)`."""
        return float(self.d[-1].item()) if self.d.numel() else 0.0


def spectral_gram(Gs: torch.Tensor, dtype: torch.dtype | None = None) -> SpectralGram:
    """Eigendecomposition of `Gs` computed in float64 (`torch.linalg.eigh`), returned in `dtype`.

    Args:
        Gs (`torch.Tensor` of shape `(n, n)`): symmetric PSD Gram `X* X*ᵀ`.
        dtype (`torch.dtype`, *optional*): working dtype (float64 for float64 input, else float32).
    """
    dtype = dtype or (torch.float64 if Gs.dtype == torch.float64 else torch.float32)
    d, Q = torch.linalg.eigh(Gs.double())  # (n,), (n, n)
    return SpectralGram(Q.to(dtype), d.clamp_min(0).to(dtype))


def prox_is_negligible(lam: float, L: float, K: int, tol: float, numel: int) -> bool:
    """Whether the ℓ1 prox is the identity to within FISTA's tolerance over one call of `K` iterations.

    The soft threshold moves every entry by at most `τ = λ / L`, i.e. an iterate by at most `τ·sqrt(numel)` in
    Frobenius norm; in accelerated schemes such per-step perturbations add up to at most about `K²/2` times that over
    `K` steps. When `K² τ sqrt(numel) ≤ tol` the whole call can therefore not differ from the unregularised one by more
    than the tolerance at which the paper declares two iterates equal (Eq. 7), and the spectral iterations apply.
    """
    return tol > 0 and lam >= 0 and K * K * (lam / L) * math.sqrt(numel) <= tol


def _accelerated(step, x0: torch.Tensor, K: int, tol: float, momentum: str, norm=None) -> tuple[torch.Tensor, int]:
    """The FISTA recurrence around a prox-gradient map `step(y) -> x` (paper Eq. 5), shared by both bases.

    `norm(diff)` is the Frobenius norm of a step in the weight space (default: of `diff` itself)."""
    norm = norm or torch.linalg.vector_norm
    if momentum not in _MOMENTUM:
        raise ValueError(f"momentum must be one of {_MOMENTUM}, got {momentum!r}.")
    x_prev = x0  # last prox output ("standard"/"none") or last iterate ("paper")
    y = x0  # point where the gradient is taken
    t = 1.0
    iters = 0
    while iters < K:
        iters += 1
        x = step(y)  # Eq. 5a-b
        if momentum == "none":
            diff = x - x_prev
            y = x
        else:
            t_next = (1.0 + math.sqrt(1.0 + 4.0 * t * t)) / 2.0  # Eq. 5c
            beta = (t - 1.0) / t_next
            if momentum == "standard":
                diff = x - x_prev
                y = torch.add(x, diff, alpha=beta)  # extrapolate between prox outputs
            else:
                x = torch.add(x, x - y, alpha=beta)  # Eq. 5d: W_{k+1} = W_h + β (W_h − W_k)
                diff = x - y
                y = x
            t = t_next
        x_prev = x
        if float(norm(diff)) < tol:  # Eq. 7 (rotation invariant: same in both bases)
            break
    return x_prev, iters


@torch.no_grad()
def fista_inner(
    W_init: torch.Tensor,
    WC: torch.Tensor,
    Gs: torch.Tensor,
    lam: float,
    L: float,
    K: int = 20,
    tol: float = 1e-6,
    momentum: str = "standard",
) -> tuple[torch.Tensor, int]:
    """Runs up to `K` FISTA iterations on all rows at once (paper Eq. 5), stopping when `||W_k − W_{k−1}||_F < tol`.

    Args:
        W_init (`torch.Tensor` of shape `(m, n)`): warm start `W*_0`.
        WC (`torch.Tensor` of shape `(m, n)`): precomputed `W C` (dense weight times cross Gram).
        Gs (`torch.Tensor` of shape `(n, n)`): pruned-input Gram `X* X*ᵀ`.
        lam (`float`): l1 weight `λ`; the soft threshold is `λ / L`.
        L (`float`): Lipschitz constant `λ_max(Gs)` (step `1 / L`).
        K (`int`, defaults to `20`): maximum iterations; the momentum restarts at `t = 1` on every call.
        tol (`float`, defaults to `1e-6`): absolute Frobenius tolerance on consecutive iterates (paper Eq. 7).
        momentum (`str`, defaults to `"standard"`): `"standard"` (Beck–Teboulle: gradient at the extrapolated
            point, extrapolation between prox outputs), `"paper"` (Eq. 5c–d literally: extrapolation between the prox
            output and the previous extrapolated iterate) or `"none"` (ISTA, monotone).

    Returns:
        `(W_K, iterations)`: the last iterate (a prox output except for `"paper"`) and the iterations run.
    """
    if L <= 0:
        raise ValueError(f"L must be positive, got {L}.")
    inv_L = 1.0 / L
    tau = lam * inv_L

    def step(y: torch.Tensor) -> torch.Tensor:
        V = torch.addmm(WC, y, Gs, beta=inv_L, alpha=-inv_L).add_(y)  # (m, n) y − (y Gs − W C) / L
        return soft_threshold(V, tau)  # (m, n) prox step, Eq. 5b

    return _accelerated(step, W_init, K, tol, momentum)


@torch.no_grad()
def fista_inner_spectral(
    Z_init: torch.Tensor,
    B: torch.Tensor,
    d: torch.Tensor,
    L: float,
    K: int = 20,
    tol: float = 1e-6,
    momentum: str = "standard",
) -> tuple[torch.Tensor, int]:
    """[`fista_inner`] with a negligible ℓ1 term, in the eigenbasis of `Gs` (O(m·n) per iteration).

    With `Gs = Q diag(d) Qᵀ`, `Z = W* Q` and `B = W C Q`, the step `W* − (W* Gs − W C) / L` becomes
    `Z ∘ (1 − d / L) + B / L` column by column. Only valid when [`prox_is_negligible`] holds.

    Args:
        Z_init (`torch.Tensor` of shape `(m, n)`): warm start in the eigenbasis, `W*_0 Q`.
        B (`torch.Tensor` of shape `(m, n)`): `W C Q`.
        d (`torch.Tensor` of shape `(n,)`): eigenvalues of `Gs`.
        L (`float`), K (`int`), tol (`float`), momentum (`str`): as in [`fista_inner`].

    Returns:
        `(Z_K, iterations)`: the last iterate in the eigenbasis (`W*_K = Z_K Qᵀ`) and the iterations run.
    """
    if L <= 0:
        raise ValueError(f"L must be positive, got {L}.")
    # Closed form (module docstring): iterate k is Z_0 + R diag(w_k), with w_0 = 0 and w -> 1 + decay ∘ w.
    decay = 1.0 - d.double() / L  # (n,) per-eigendirection contraction of a gradient step
    R = torch.addcmul(B / L, Z_init, d.to(Z_init.dtype) / L, value=-1.0)  # (m, n) first step Z_1 − Z_0
    col_sq = R.double().square().sum(dim=0)  # (n,) ||R_j||²

    def step(w: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(torch.ones_like(w), decay, w)  # (n,)

    def norm(dw: torch.Tensor) -> float:
        return math.sqrt(float(torch.dot(dw * dw, col_sq).item()))

    w, iters = _accelerated(step, torch.zeros_like(decay), K, tol, momentum, norm)  # (n,)
    return torch.addcmul(Z_init, R, w.to(Z_init.dtype)), iters  # (m, n)
