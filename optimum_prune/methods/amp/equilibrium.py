"""AMP in a regime where its masks carry information (docs/methods/amp.md, "The paper's setting and our defaults").

The objective is AMP's own, in mask space: `L(M) = D(M) + ½λ‖M‖²`, `D` the attention error of `functional.amp_masks`.
At `M = 1` the residual `f̃ − f` is zero, so `D`'s Hessian there is exactly its Gauss-Newton matrix `H = JᵀJ`, and
`∇D(1 + εv) = ε·Hv + O(ε²)`: a Gauss-Newton product costs two gradient evaluations (a central difference), no new
derivative code. From those products:

  - `curvature_scales`: the mean curvature per mask entry `tr(H)/N` (Hutchinson, Rademacher probes) and the largest
    eigenvalue of `H` (power iteration). On real models the ratio is large and the paper's λ = 0.05 is several times
    the mean curvature, so its masks shrink uniformly and order by a transient, and plain descent would need about
    `λ_max / λ` steps to reach the equilibrium of the directions that matter;
  - `equilibrium_masks`: the minimiser of the quadratic model of `L` at `M = 1`, `(H + λ)δ = −λ·1`, `M = 1 + δ`, by
    conjugate gradients with λ = `lambda_rel` × the mean curvature (a dimensionless setting); a direction the
    attention never feels (zero curvature) goes to `M = 0`, one it feels strongly stays near 1;
  - `refit_kept`: after binarisation, descent on the kept masks alone (λ = 0, heavy ball, step `lr / L_max`) so that
    the kept `W∘M` reproduce the dense attention probabilities: a compensation measured in the quantity AMP cares
    about, where SparseGPT compensates the q/k outputs.

Everything here works on masks in float64 (forward/backward in the weights' dtype, as in `amp_masks`).
"""

from __future__ import annotations

import math
import time

import torch
from tqdm.auto import tqdm

from .attention import AttentionInputs

__all__ = ["MaskObjective", "curvature_scales", "equilibrium_masks", "input_norms", "refit_kept"]

Pair = list  # [q tensor, k tensor]; None for a matrix that is not optimised


class MaskObjective:
    """The data term `D(M_Q, M_K)` of `amp_masks` and its mask-space gradient `W ∘ ∇_{W∘M} D`, for the matrices in
    `update` (`(update_q, update_k)`; the others stay at ones and take no gradient).

    Args:
        data_term: a `functional.DataTerm` (dense probabilities cached) of the layer.
        Wq, Wk (`torch.Tensor`, `(out, in)`): dense weights.
        update (`tuple[bool, bool]`): which masks are variables.
    """

    def __init__(self, data_term, Wq: torch.Tensor, Wk: torch.Tensor, update: tuple[bool, bool] = (True, True)):
        self.data_term, self.dtype, self.update = data_term, Wq.dtype, tuple(update)
        self.W = [Wq.double(), Wk.double()]

    def zeros(self) -> Pair:
        return [torch.zeros_like(W) if u else None for W, u in zip(self.W, self.update)]

    def grad(self, M: Pair) -> tuple[float, Pair]:
        """`(D(M), ∇_M D)` (the gradient of a fixed matrix is None)."""
        masked = [(W * m).to(self.dtype) for W, m in zip(self.W, M)]
        data, gq, gk = self.data_term(masked[0], masked[1], *self.update)
        return data, [None if g is None else g.double() * W for g, W in zip((gq, gk), self.W)]

    def gauss_newton(self, v: Pair, eps: float = 1e-2) -> Pair:
        """`H v` at `M = 1` by a central difference of gradients; `v` is scaled so that no mask moves by more than
        `eps` (relative to the weight), which keeps the difference well above float32 rounding and in the quadratic
        regime."""
        scale = max(float(x.abs().max()) for x in v if x is not None)
        if scale == 0:
            return [None if x is None else torch.zeros_like(x) for x in v]
        step = eps / scale
        plus = [torch.ones_like(W) if x is None else 1 + step * x for W, x in zip(self.W, v)]
        minus = [torch.ones_like(W) if x is None else 1 - step * x for W, x in zip(self.W, v)]
        gp, gm = self.grad(plus)[1], self.grad(minus)[1]
        return [None if a is None else (a - b) / (2 * step) for a, b in zip(gp, gm)]


def _dot(a: Pair, b: Pair) -> float:
    return sum(float((x * y).sum()) for x, y in zip(a, b) if x is not None)


def _axpy(alpha: float, x: Pair, y: Pair) -> Pair:
    """`y + αx` (new tensors)."""
    return [None if b is None else b + alpha * a for a, b in zip(x, y)]


def curvature_scales(
    obj: MaskObjective, probes: int = 8, power_steps: int = 8, seed: int = 0
) -> tuple[float, float, Pair | None]:
    """`(mean, max, diagonal)` curvature of `D` at `M = 1`: `tr(H)/N` and `diag(H)` (clamped at 0) from `probes`
    Rademacher vectors `v` (Hutchinson: `E[v∘Hv] = diag(H)`), and the largest eigenvalue of `H` from `power_steps`
    power iterations (a slight underestimate: the step sizes built on it keep a margin). `probes=0` /
    `power_steps=0` skip that estimate (NaN and None / 0)."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(W.numel() for W, u in zip(obj.W, obj.update) if u)
    diag = obj.zeros() if probes else None
    for _ in range(probes):  # probes from a CPU generator: the same on any device
        v = [
            torch.randint(0, 2, W.shape, generator=gen).to(W).mul_(2).sub_(1) if u else None
            for W, u in zip(obj.W, obj.update)
        ]
        for d, a, b in zip(diag, v, obj.gauss_newton(v)):
            if d is not None:
                d.add_(a * b, alpha=1.0 / probes)
    mean = sum(float(d.sum()) for d in diag if d is not None) / max(n, 1) if probes else math.nan
    if diag is not None:
        diag = [None if d is None else d.clamp_(min=0) for d in diag]
    v = [
        torch.randn(W.shape, generator=gen, dtype=torch.float64).to(W) if u else None
        for W, u in zip(obj.W, obj.update)
    ]
    top = 0.0
    for _ in range(power_steps):
        h = obj.gauss_newton(v)
        top = math.sqrt(_dot(h, h) / max(_dot(v, v), 1e-300))
        v = h
    return mean, top, diag


def equilibrium_masks(
    obj: MaskObjective,
    lambda_: float,
    steps: int,
    diagonal: Pair | None = None,
    progress: bool = True,
    desc: str = "amp: cg",
) -> tuple[Pair, dict]:
    """Masks minimising the quadratic model of `D(M) + ½λ‖M‖²` at `M = 1`: `(H + λ)δ = −λ·1` by `steps` conjugate-
    gradient iterations from `δ = 0` (each one Gauss-Newton product, two gradients), preconditioned by
    `diag(H) + λ` when `diagonal` is given. Without it, CG resolves the stiff (high-curvature) directions first and
    barely moves the flat ones, the very entries a ranking must find (an entry the attention never feels stays near
    1); with it, the first iteration already sets each entry to its diagonal equilibrium `H_ii / (H_ii + λ)` and the
    next ones add the couplings. Returns `(M, info)`, `M = 1 + δ` (ones for a matrix that is not optimised), `info`
    with the relative residual of each iteration."""
    if lambda_ <= 0:
        raise ValueError(f"lambda_ must be > 0, got {lambda_}.")

    def precondition(r: Pair) -> Pair:
        if diagonal is None:
            return [None if t is None else t.clone() for t in r]
        return [None if t is None else t / (d + lambda_) for t, d in zip(r, diagonal)]

    x = obj.zeros()
    r = [None if z is None else torch.full_like(z, -lambda_) for z in x]
    z = precondition(r)
    p, rz = [None if t is None else t.clone() for t in z], _dot(r, z)
    r0, residuals = math.sqrt(_dot(r, r)), []
    for _ in tqdm(range(steps), desc=desc, leave=False, **({} if progress else {"disable": True})):
        Ap = _axpy(lambda_, p, obj.gauss_newton(p))
        pAp = _dot(p, Ap)
        if not math.isfinite(pAp):
            raise FloatingPointError(f"AMP's curvature product became {pAp}.")
        if pAp <= 0:  # converged to rounding (or a non-positive product): stop here
            break
        alpha = rz / pAp
        x, r = _axpy(alpha, p, x), _axpy(-alpha, Ap, r)
        residuals.append(math.sqrt(_dot(r, r)) / r0)
        z = precondition(r)
        rz_new = _dot(r, z)
        if rz_new <= 0:
            break
        p, rz = _axpy(rz_new / rz, p, z), rz_new
    M = [torch.ones_like(W) if d is None else 1 + d for W, d in zip(obj.W, x)]
    return M, {"residuals": residuals, "iterations": len(residuals)}


def refit_kept(
    obj: MaskObjective,
    keep: Pair,
    lr: float,
    steps: int,
    momentum: float = 0.9,
    progress: bool = True,
    desc: str = "amp: refit",
) -> tuple[Pair, dict]:
    """Heavy-ball descent on the kept entries' masks (pruned entries stay 0, λ = 0), from `M = keep`, minimising the
    attention error of the pruned layer. Returns the masks of the lowest loss seen (the loss is evaluated at every
    iterate anyway) and `info` (`loss_initial`, `loss_final`, `steps`, `seconds`).

    Raises:
        `FloatingPointError` when the loss becomes NaN/Inf.
    """
    t0 = time.perf_counter()
    S = [None if k is None else k.double() for k in keep]
    M = [W.new_ones(W.shape) if s is None else s.clone() for W, s in zip(obj.W, S)]
    V = [None if s is None else torch.zeros_like(s) for s in S]
    best, best_M, first = math.inf, [m.clone() for m in M], None
    for _ in tqdm(range(steps + 1), desc=desc, leave=False, **({} if progress else {"disable": True})):
        loss, g = obj.grad(M)
        if not math.isfinite(loss):
            raise FloatingPointError(f"AMP's refit loss became {loss}; lower `refit_lr`.")
        first = loss if first is None else first
        if loss < best:
            best, best_M = loss, [m.clone() for m in M]
        for m, v, gg, s in zip(M, V, g, S):
            if s is not None:
                v.mul_(momentum).add_(gg * s)
                m.sub_(lr * v)
    info = {"loss_initial": first, "loss_final": best, "steps": steps, "seconds": time.perf_counter() - t0}
    return best_M, info


def input_norms(inp: AttentionInputs) -> torch.Tensor:
    """‖X_j‖ over every calibration token, per input feature (Wanda's activation norm), float64."""
    sq = sum(x.double().pow(2).reshape(-1, x.shape[-1]).sum(0) for x in inp.xs)
    return torch.as_tensor(sq).sqrt()
