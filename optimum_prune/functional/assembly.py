"""Assembly under a budget: one option per group (a layer's variants), minimising the summed error subject to the
summed cost (time, bytes or parameters) staying within a budget: the multiple-choice knapsack.

`choose_options` solves it by dynamic programming over the cost axis cut into `resolution` cells, every option's cost
rounded **up** to whole cells, so the choice it returns always fits the true budget; it is optimal among choices
whose rounded cost fits. Its optimality gap is bounded by the Lagrangian dual of the unrounded problem,
`max_λ≥0 Σ_g min_o (e_go + λ c_go) − λ B`, a lower bound on every feasible choice's error: the returned
`info["gap"]` is `(error − bound) / error` (0 when the bound is met).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["choose_options", "lagrangian_bound"]


def lagrangian_bound(options: Sequence[Sequence[tuple[float, float]]], budget: float, iters: int = 200) -> float:
    """The Lagrangian dual bound of the multiple-choice knapsack (see the module docstring), by bisection on the
    subgradient `Σ_g c_g(λ) − B` of the concave dual."""
    costs = [np.asarray([c for c, _ in opts], dtype=np.float64) for opts in options]
    errors = [np.asarray([e for _, e in opts], dtype=np.float64) for opts in options]

    def dual(lam: float) -> tuple[float, float]:
        value, used = -lam * budget, 0.0
        for c, e in zip(costs, errors):
            k = int(np.argmin(e + lam * c))
            value += e[k] + lam * c[k]
            used += c[k]
        return value, used

    value0, used0 = dual(0.0)
    if used0 <= budget:
        return float(value0)  # the unconstrained optimum fits
    lo, hi = 0.0, 1.0
    while dual(hi)[1] > budget and hi < 1e30:
        lo, hi = hi, hi * 4
    best = max(dual(lo)[0], dual(hi)[0])
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        value, used = dual(mid)
        best = max(best, value)
        if used > budget:
            lo = mid
        else:
            hi = mid
    return float(best)


def choose_options(
    options: Sequence[Sequence[tuple[float, float]]], budget: float, resolution: int = 4000, bound: bool = True
) -> tuple[list[int], dict]:
    """The option of every group (`options[g]`: `(cost, error)` pairs) minimising the summed error with the summed
    cost within `budget` (see the module docstring).

    Returns:
        `(choice, info)`: the index chosen in each group, and `{"cost", "error", "bound", "gap", "resolution"}`
        (`bound` and `gap` `None` where `bound=False`: a caller comparing many problems bounds the one it keeps).

    Raises:
        `ValueError` when even the cheapest option of every group exceeds the budget.
    """
    if not options or any(not opts for opts in options):
        raise ValueError("Every group needs at least one option.")
    cheapest = sum(min(c for c, _ in opts) for opts in options)
    if cheapest > budget * (1 + 1e-12):
        raise ValueError(f"The budget {budget:.6g} is below the cheapest assembly ({cheapest:.6g}).")
    cell = budget / resolution if budget > 0 else 1.0
    inf = math.inf
    dp = np.full(resolution + 1, inf)  # dp[b]: least error of the groups so far with rounded cost exactly b
    dp[0] = 0.0
    back = []
    for opts in options:
        cells = [min(math.ceil(c / cell - 1e-9), resolution + 1) if c > 0 else 0 for c, _ in opts]
        new = np.full(resolution + 1, inf)
        arg = np.full(resolution + 1, -1, dtype=np.int64)
        for k, ((_, e), w) in enumerate(zip(opts, cells)):
            if w > resolution:
                continue
            cand = np.full(resolution + 1, inf)
            cand[w:] = dp[: resolution + 1 - w] + e
            better = cand < new
            new[better], arg[better] = cand[better], k
        dp = new
        back.append(arg)
        if not np.isfinite(dp).any():
            break
    if not np.isfinite(dp).any():  # rounding up made the tight budget infeasible: take the cheapest options
        choice = [int(np.argmin([c for c, _ in opts])) for opts in options]
    else:
        b = int(np.argmin(dp))
        choice = []
        for g in range(len(options) - 1, -1, -1):
            k = int(back[g][b])
            choice.append(k)
            w = min(math.ceil(options[g][k][0] / cell - 1e-9), resolution + 1) if options[g][k][0] > 0 else 0
            b -= w
        choice.reverse()
    cost = sum(options[g][k][0] for g, k in enumerate(choice))
    error = sum(options[g][k][1] for g, k in enumerate(choice))
    info = {"cost": float(cost), "error": float(error), "bound": None, "gap": None, "resolution": resolution}
    if bound:
        info.update(bound=lagrangian_bound(options, budget))
        info.update(gap=0.0 if error <= 0 else max(error - info["bound"], 0.0) / error)
    return choice, info
