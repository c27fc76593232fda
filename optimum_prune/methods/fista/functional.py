"""FISTAPruner (Zhao et al., "A Convex-optimization-based Layer-wise Post-training Pruner for LLMs";
docs/methods/fista.md).

For one operator with dense weight `W` (m×n), dense input `X` (n×p) and pruned-network input `X*` (n×p):

    min_{W*}  F(W*) = ½ ||W* X* − W X||_F² + λ ||W*||_1                               (paper Eq. 4)

Everything runs in Gram form, so the cost per iteration is one m×n×n GEMM, independent of the token count `p`:

    G = X Xᵀ,  Gs = X* X*ᵀ,  C = X X*ᵀ   (all n×n, normalised by the token count)
    ∇ ½||W* X* − W X||² = W* Gs − W C                                                    (Eq. 5a, typo fixed)
    ||A X* − W X||_F² = tr(A Gs Aᵀ) − 2 tr(W C Aᵀ) + tr(W G Wᵀ)     (evaluated in a cancellation-free form)

With normalised Grams, errors are `||A X* − W X||_F / sqrt(p)` and `λ` is per token; ratios and relative
improvements, which drive the outer loop, are unaffected.

The inner FISTA iterations, in the weight basis or (once the ℓ1 term is negligible) in the eigenbasis of `Gs`, are
in [`solver`](solver.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ...functional.masks import keep_mask, parse_pattern
from . import solver as _solver
from .solver import (
    SpectralGram,
    fista_inner,
    fista_inner_spectral,
    lipschitz_constant,
    prox_is_negligible,
    spectral_gram,
)

__all__ = [
    *_solver.__all__,  # re-exported: the inner iterations live in solver.py
    "reconstruction_error",
    "fista_objective",
    "round_to_pattern",
    "shrink_refit",
    "fista_prune",
]

logger = logging.getLogger(__name__)

_SEARCH = ("log", "paper")
_LOG_FLOOR = 1e-12  # lower end of the geometric bisection while no lower bound is known (the paper gives no bracket)
_CHUNK = 2048  # columns of an n×n Gram converted to float64 at a time


def _matmul64(A: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """`A @ M` in float64, converting `M` by column chunks to bound the extra memory."""
    A64 = A.double()  # (m, n)
    return torch.cat([A64 @ M[:, j : j + _CHUNK].double() for j in range(0, M.shape[1], _CHUNK)], dim=1)  # (m, n)


def _trace64(A: torch.Tensor, M: torch.Tensor, B: torch.Tensor) -> float:
    """`tr(A M Bᵀ) = Σ (A M) ∘ B` in float64, chunked over the columns of `M`."""
    A64 = A.double()  # (m, n)
    total = 0.0
    for j in range(0, M.shape[1], _CHUNK):
        AM = A64 @ M[:, j : j + _CHUNK].double()  # (m, chunk)
        total += float((AM * B[:, j : j + _CHUNK].double()).sum().item())
    return total


class _ErrorTerms(NamedTuple):
    """Once-per-operator terms of the difference form of the error (see [`reconstruction_error`])."""

    W: torch.Tensor  # (m, n) dense weight in the working dtype
    P: torch.Tensor  # (m, n) float64, W (Gs − C)
    c: float  # ||W (X* − X)||² = tr(W (G + Gs − C − Cᵀ) Wᵀ)


def _error_terms(W, G, Gs, C, dtype: torch.dtype, energy: float | None = None, WC: torch.Tensor | None = None):
    """The terms, and `W C` in float64; `energy = tr(W G Wᵀ)` replaces `G`, and `WC` replaces `C`, when given."""
    WC64 = _matmul64(W, C) if WC is None else WC.double()  # (m, n) W C
    WGs64 = _matmul64(W, Gs)  # (m, n) W Gs
    energy = _trace64(W, G, W) if energy is None else energy
    c = energy + float(((WGs64 - 2.0 * WC64) * W.double()).sum().item())
    return _ErrorTerms(W.to(dtype), WGs64 - WC64, c), WC64


def _error(A: torch.Tensor, Gs: torch.Tensor, terms: _ErrorTerms) -> float:
    D = A.to(terms.W.dtype) - terms.W  # (m, n)
    DGs = D @ Gs  # (m, n) the only O(m n²) product per candidate
    D64 = D.double()  # (m, n)
    sq = float((DGs.double() * D64).sum().item()) + 2.0 * float((terms.P * D64).sum().item()) + terms.c
    return math.sqrt(max(sq, 0.0))  # rounding can leave a tiny negative value


def reconstruction_error(
    A: torch.Tensor, W: torch.Tensor, G: torch.Tensor, Gs: torch.Tensor, C: torch.Tensor
) -> float:
    """`||A X* − W X||_F` from Grams.

    Uses the difference form with `D = A − W`, `A X* − W X = D X* + W (X* − X)`:
    `tr(D Gs Dᵀ) + 2 tr(W (Gs − C) Dᵀ) + tr(W (G + Gs − C − Cᵀ) Wᵀ)`. Every term is of the order of the error
    (all but the first vanish when `X* = X`), unlike the expanded `tr(A Gs Aᵀ) − 2 tr(W C Aᵀ) + tr(W G Wᵀ)`, which
    cancels catastrophically. Terms that depend only on `W` are computed in float64; `D Gs` runs in float32
    (float64 for float64 inputs) and is reduced in float64.

    Args:
        A (`torch.Tensor` of shape `(m, n)`): candidate (pruned) weight `W*`.
        W (`torch.Tensor` of shape `(m, n)`): dense target weight.
        G (`torch.Tensor` of shape `(n, n)`): dense-input Gram `X Xᵀ`.
        Gs (`torch.Tensor` of shape `(n, n)`): pruned-input Gram `X* X*ᵀ`.
        C (`torch.Tensor` of shape `(n, n)`): cross Gram `X X*ᵀ` (dense rows, pruned columns).
    """
    dtype = torch.float64 if torch.float64 in (A.dtype, W.dtype) else torch.float32
    return _error(A, Gs.to(dtype), _error_terms(W, G, Gs, C, dtype)[0])


def fista_objective(
    A: torch.Tensor, W: torch.Tensor, G: torch.Tensor, Gs: torch.Tensor, C: torch.Tensor, lam: float
) -> float:
    """Lasso objective `½ ||A X* − W X||_F² + λ ||A||_1` (paper Eq. 4) from Grams, in float64.

    Args:
        A, W, G, Gs, C (`torch.Tensor`): as in [`reconstruction_error`].
        lam (`float`): l1 weight `λ`.
    """
    return 0.5 * reconstruction_error(A, W, G, Gs, C) ** 2 + lam * float(A.double().abs().sum().item())


def round_to_pattern(
    W: torch.Tensor,
    sparsity: float | None = None,
    nm: str | tuple[int, int] | None = None,
    per: str = "matrix",
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paper Eq. 8: zeros the smallest-magnitude entries to reach exact unstructured sparsity or N:M.

    Args:
        W (`torch.Tensor` of shape `(m, n)`): weight to round.
        sparsity (`float`, *optional*): unstructured sparsity (`round(sparsity * numel)` zeros per matrix or row).
        nm (`str` or `tuple[int, int]`, *optional*): N:M pattern (`N` kept per `M`); takes precedence.
        per (`str`, defaults to `"matrix"`): `"matrix"` (paper) or `"row"` for unstructured sparsity.
        scale (`torch.Tensor` of shape `(n,)`, *optional*): rank the entries by `|W_ij| · scale_j` instead of `|W_ij|`
            (e.g. `scale_j = ||X*_j||`: Wanda's score, the error each entry alone adds to the output).
    """
    scores = W.abs() if scale is None else W.abs() * scale.to(W.dtype)  # (m, n)
    keep = keep_mask(scores, sparsity=sparsity, pattern=nm, per=per)  # (m, n)
    return W.masked_fill(~keep, 0.0)  # (m, n)


def shrink_refit(W: torch.Tensor, W_fit: torch.Tensor, strength: float) -> torch.Tensor:
    """The pruned weights moved from the re-fitted `W_fit` toward the dense `W`, on `W_fit`'s support (its pattern
    is kept): `W + s·(W_fit − W)` where `W_fit ≠ 0`, else 0. `s = 1` is `W_fit`, `s = 0` the dense weights under its
    mask.

    Args:
        W (`torch.Tensor` of shape `(m, n)`): dense weight.
        W_fit (`torch.Tensor` of shape `(m, n)`): pruned, re-fitted weight.
        strength (`float`): `s`, in [0, 1].
    """
    W = W.to(W_fit.dtype)
    return torch.where(W_fit != 0, torch.lerp(W, W_fit, strength), torch.zeros((), dtype=W_fit.dtype))  # (m, n)


def _shifted(eig: SpectralGram, delta: float) -> SpectralGram:
    """The eigendecomposition of `Gs + δI` from that of `Gs`."""
    return SpectralGram(eig.Q, (eig.d.double() + delta).to(eig.d.dtype))


def _next_lambda(lo: float, hi: float, mode: str) -> float:
    if mode == "paper":
        return (lo + hi) / 2.0
    return math.sqrt(max(lo, _LOG_FLOOR) * hi)


@torch.no_grad()
def fista_prune(
    W: torch.Tensor,
    G: torch.Tensor | None,
    Gs: torch.Tensor,
    C: torch.Tensor | None,
    W0: torch.Tensor,
    sparsity: float | None = None,
    nm: str | tuple[int, int] | None = None,
    *,
    lam0: float = 1e-5,
    xi: float = 0.3,
    K: int = 20,
    tol: float = 1e-6,
    T: int = 3,
    eps: float = 1e-3,
    lambda_search: str = "log",
    lam_bounds: tuple[float, float] = (0.0, 1e6),
    momentum: str = "standard",
    rounding_per: str = "matrix",
    reset_bad_counter: bool = False,
    max_outer: int = 200,
    L: float | None = None,
    spectral: bool = True,
    eig: SpectralGram | Callable[[], SpectralGram] | None = None,
    ridge: float = 0.0,
    dense_energy: float | None = None,
    WC: torch.Tensor | None = None,
    rounding_scale: torch.Tensor | None = None,
    on_iterate: Callable[[torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """FISTAPruner outer loop (paper Algorithm 1): FISTA, rounding and adaptive `λ` until no more improvement.

    Args:
        W (`torch.Tensor` of shape `(m, n)`): dense weight (the target is `W X`).
        G (`torch.Tensor` of shape `(n, n)`, *optional*): `X Xᵀ / p`; only the constant `tr(W G Wᵀ)` of the error
            depends on it, so `None` with `dense_energy` given instead.
        Gs (`torch.Tensor` of shape `(n, n)`): `X* X*ᵀ / p` (equal to `G` when the input is unchanged).
        C (`torch.Tensor` of shape `(n, n)`, *optional*): `X X*ᵀ / p` (equal to `G` when the input is unchanged); it
            enters only as `W C`, so `None` with `WC` given instead.
        W0 (`torch.Tensor` of shape `(m, n)`): warm start (Wanda or SparseGPT result); rounded to the pattern first,
            so the result is never worse than the rounded warm start.
        sparsity (`float`, *optional*): unstructured target sparsity.
        nm (`str` or `tuple[int, int]`, *optional*): N:M pattern (`N` kept per `M`); takes precedence.
        lam0 (`float`, defaults to `1e-5`): initial `λ`.
        xi (`float`, defaults to `0.3`): threshold on `E_round / E_total`; above it `λ` increases.
        K (`int`, defaults to `20`): FISTA iterations per outer step.
        tol (`float`, defaults to `1e-6`): FISTA tolerance.
        T (`int`, defaults to `3`): stop after `T` non-improving outer steps.
        eps (`float`, defaults to `1e-3`): stop when the last relative improvement is below `eps` (paper: 1e-6 OPT).
        lambda_search (`str`, defaults to `"log"`): `"log"` bisects geometrically (`sqrt(max(lo, 1e-12) * hi)`) and
            caps the bracket at `max|W C|`, above which `W* = 0` is optimal; `"paper"` bisects arithmetically
            (`(lo + hi) / 2`) on `lam_bounds`.
        lam_bounds (`tuple[float, float]`, defaults to `(0.0, 1e6)`): initial bisection bracket.
        momentum (`str`, defaults to `"standard"`): see [`fista_inner`].
        rounding_per (`str`, defaults to `"matrix"`): unstructured rounding group, `"matrix"` (paper) or `"row"`.
        reset_bad_counter (`bool`, defaults to `False`): reset the failure counter on improvement (the paper does not).
        max_outer (`int`, defaults to `200`): safety cap on outer steps (the paper has none).
        L (`float`, *optional*): `λ_max(Gs)`; when omitted, taken from `eig` if it is a `SpectralGram`, else
            computed with [`lipschitz_constant`] (exact eigenvalues, rounded to the working dtype like `eig.L`).
        spectral (`bool`, defaults to `True`): run an outer step's FISTA iterations in the eigenbasis of `Gs`
            ([`fista_inner_spectral`]) whenever [`prox_is_negligible`] holds for its λ; `False` always iterates in the
            weight basis.
        eig (`SpectralGram` or a callable returning one, *optional*): the [`spectral_gram`] of `Gs` (projections
            that share an input share it), or a function computing it on first use (an eigendecomposition costs
            O(n³), and a projection whose λ never becomes negligible needs none); computed here on first use when
            omitted.
        ridge (`float`, defaults to `0.0`): adds `(δ/2) ||W* − W||_F²` to the smooth part, `δ = ridge · mean(diag Gs)`
            (a pull towards the dense weights, as SparseGPT's damping of its Hessian). It is the same problem on
            the Grams `G + δI`, `Gs + δI`, `C + δI` (inputs augmented with `sqrt(δ) I` in both networks), which is
            how it is solved; the errors in `info` then include the ridge term. `0` is the paper's objective.
        dense_energy (`float`, *optional*): `tr(W G Wᵀ) = ||W X||_F² / p`, in place of `G`.
        rounding_scale (`torch.Tensor` of shape `(n,)`, *optional*): the rounding (Eq. 8) ranks entries by
            `|W*_ij| · rounding_scale_j` (see [`round_to_pattern`]); `None` is the paper's magnitude.
        WC (`torch.Tensor` of shape `(m, n)`, *optional*): `W C = (W X) X*ᵀ / p`, in place of `C`. With
            `dense_energy`, the statistics of the dense side cost O(m·n) per token instead of O(n²): cheaper when `W`
            has fewer rows than columns (e.g. a down projection).
        on_iterate (`Callable[[torch.Tensor], None]`, *optional*): called with every rounded iterate, `(m, n)` in the
            working dtype: first the rounded warm start, then each outer step's `W_{K+1}` (Eq. 8), kept or not (to
            follow the iterates, e.g. their error on held-out inputs; it must not modify them).

    Returns:
        `(W_best, info)`: `W_best` in the dtype of `W`; `info` has `lambdas`, `errors_total`, `errors_round`,
        `improved`, `inner_iterations` (one entry per outer step), `error_init`, `error_best`, `outer_iterations`,
        `L`, `lam_bracket` (the initial bisection bracket), `spectral` (per outer step, whether it ran in the
        eigenbasis) and `stop_reason`.
    """
    nm = parse_pattern(nm)
    if nm is None and sparsity is None:
        raise ValueError("fista_prune needs `sparsity` or an N:M pattern `nm`.")
    if lambda_search not in _SEARCH:
        raise ValueError(f"lambda_search must be one of {_SEARCH}, got {lambda_search!r}.")
    n = W.shape[1]
    if (G is None) == (dense_energy is None):
        raise ValueError("fista_prune needs exactly one of `G` and `dense_energy` (= tr(W G Wᵀ)).")
    if (C is None) == (WC is None):
        raise ValueError("fista_prune needs exactly one of `C` and `WC` (= W C).")
    for name, M in (("G", G), ("Gs", Gs), ("C", C)):
        if M is not None and M.shape != (n, n):
            raise ValueError(f"{name} must have shape ({n}, {n}) to match W, got {tuple(M.shape)}.")
    if WC is not None and WC.shape != W.shape:
        raise ValueError(f"WC must have the shape of W, {tuple(W.shape)}, got {tuple(WC.shape)}.")
    dtype = torch.float64 if W.dtype == torch.float64 else torch.float32
    if ridge < 0:
        raise ValueError(f"ridge must be >= 0, got {ridge}.")
    delta = 0.0
    if ridge > 0:  # the same problem on inputs augmented with sqrt(δ) I: add δI to every Gram
        delta = ridge * float(Gs.diagonal().double().mean().item())
        G, Gs, C = (
            None if M is None else M + delta * torch.eye(n, dtype=M.dtype, device=M.device) for M in (G, Gs, C)
        )
        if dense_energy is not None:  # tr(W (G + δI) Wᵀ)
            dense_energy += delta * float(W.double().square().sum().item())
        if WC is not None:  # W (C + δI)
            WC = WC.double() + delta * W.double()
        if L is not None:  # rounded to the working dtype as `_shifted(eig).L` is: the same step either way
            L = float(torch.tensor(L + delta, dtype=torch.float64).to(dtype))
        if isinstance(eig, SpectralGram):
            eig = _shifted(eig, delta)
        elif callable(eig):
            eig_fn = eig
            eig = lambda: _shifted(eig_fn(), delta)  # noqa: E731 (still lazy)
    Gs_ = Gs.to(dtype)  # (n, n)
    terms, WC64 = _error_terms(W, G, Gs, C, dtype, dense_energy, WC)  # computed once per operator
    WC = WC64.to(dtype)  # (m, n)
    if L is None:
        L = eig.L if isinstance(eig, SpectralGram) else lipschitz_constant(Gs_, dtype=dtype)
    if L <= 0:  # X* == 0: only W* = 0 is optimal; any positive step reaches it
        L = 1.0

    def err(A: torch.Tensor) -> float:
        return _error(A, Gs_, terms)

    basis = None  # (Q, d, W C Q, W Q, P Q) once the first spectral step needs them

    def err_spectral(Z: torch.Tensor) -> float:  # err(Z Qᵀ) in O(m n): D̂ = Z − W Q, tr(D Gs Dᵀ) = Σ_j d_j |D̂_j|²
        _, d, _, WQ, PQ = basis
        D = Z.double() - WQ  # (m, n)
        sq = float((D * D * d.double()).sum().item()) + 2.0 * float((PQ * D).sum().item()) + terms.c
        return math.sqrt(max(sq, 0.0))

    W_best = round_to_pattern(W0.to(dtype), sparsity, nm, rounding_per, rounding_scale)  # (m, n)
    if on_iterate is not None:
        on_iterate(W_best)
    Z_best = None  # W_best Q, when known
    E_best = err(W_best)
    info: dict[str, Any] = {"lambdas": [], "errors_total": [], "errors_round": [], "improved": [], "spectral": []}
    info.update(inner_iterations=[], error_init=E_best, L=L, ridge_delta=delta)
    lo, hi = lam_bounds
    if lambda_search == "log":  # λ ≥ max|W C| makes W* = 0 optimal (lasso critical value): no use searching above
        hi = min(hi, max(float(WC64.abs().max().item()), lam0))
    info["lam_bracket"] = (lo, hi)
    lam, bad, E_stop = lam0, 0, math.inf
    for _ in range(max_outer):
        if bad >= T or E_stop < eps or E_best == 0.0:
            reason = "no_improvement" if bad >= T else ("converged" if E_stop < eps else "exact")
            break
        in_eigenbasis = spectral and prox_is_negligible(lam, L, K, tol, W.numel())
        if in_eigenbasis:
            if basis is None:
                if not isinstance(eig, SpectralGram):
                    eig = eig() if callable(eig) else spectral_gram(Gs_, dtype)
                Q = eig.Q.to(dtype)  # (n, n)
                basis = (Q, eig.d, WC @ Q, W.double() @ Q.double(), terms.P @ Q.double())
            Q, d, B = basis[:3]
            Z_K, iters = fista_inner_spectral(
                W_best @ Q if Z_best is None else Z_best, B, d, L, K=K, tol=tol, momentum=momentum
            )  # (m, n)
            E_K = err_spectral(Z_K)
            W_K1 = round_to_pattern(Z_K @ Q.T, sparsity, nm, rounding_per, rounding_scale)  # (m, n) Eq. 8
            Z_K1 = W_K1 @ Q  # (m, n) also the next warm start if kept
            E_tot = err_spectral(Z_K1)
        else:
            W_K, iters = fista_inner(W_best, WC, Gs_, lam, L, K=K, tol=tol, momentum=momentum)  # (m, n)
            W_K1 = round_to_pattern(W_K, sparsity, nm, rounding_per, rounding_scale)  # (m, n) Eq. 8
            E_tot, E_K, Z_K1 = err(W_K1), err(W_K), None
        if on_iterate is not None:
            on_iterate(W_K1)
        E_rnd = E_tot - E_K  # Eq. 9
        improved = E_tot < E_best
        if improved:
            E_stop = (E_best - E_tot) / E_best
            W_best, Z_best, E_best = W_K1, Z_K1, E_tot
            bad = 0 if reset_bad_counter else bad
        else:
            bad += 1
        for key, val in zip(("lambdas", "errors_total", "errors_round", "improved"), (lam, E_tot, E_rnd, improved)):
            info[key].append(val)
        info["inner_iterations"].append(iters)
        info["spectral"].append(in_eigenbasis)
        if E_tot > 0 and E_rnd / E_tot > xi:  # rounding dominates: FISTA's result is not sparse enough
            lo = lam
        else:
            hi = lam
        lam = _next_lambda(lo, hi, lambda_search)
    else:
        reason = "max_outer"
    info.update(error_best=E_best, outer_iterations=len(info["lambdas"]), stop_reason=reason)
    logger.debug(
        "FISTA: %d outer steps, error %.4g -> %.4g (%s)", len(info["lambdas"]), info["error_init"], E_best, reason
    )
    return W_best.to(W.dtype), info
