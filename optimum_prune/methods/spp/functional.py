"""SPP math (docs/methods/spp.md), pure tensor code: one Linearized-Bregman step on a mask vector, the importance order
a solution path defines, and the cost-weighted selection of the units to remove.

Notation: `M` the mask (initialised to 1), `Γ` its sparse companion, `Z` the dual variable (both initialised to 0).
A unit *enters* the path when `Γ` becomes non-zero; the support of `Γ` grows from empty to dense, important units
first (inverse scale space).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ...functional.proximal import nonnegative_soft_threshold, soft_threshold

__all__ = ["init_state", "bregman_step_", "auto_nu", "reachable_z", "removal_order", "select_removed"]

ADAM_MODES = ("coupled", "code")  # the dynamics that step M with AdamW


def init_state(mask: torch.Tensor, faithful_to: str) -> dict:
    """The per-mask state: `z`, `gamma`, `entry` (first step with `Γ ≠ 0`, −1 = never), `record` (the code's
    `step_record`), `step`, and Adam's moments in the AdamW modes (`"coupled"`, `"code"`)."""
    state = {
        "step": 0,
        "z": torch.zeros_like(mask),
        "gamma": torch.zeros_like(mask),
        "entry": torch.full(mask.shape, -1, dtype=torch.int32, device=mask.device),
        "record": torch.zeros(mask.shape, dtype=torch.int32, device=mask.device),
    }
    if faithful_to in ADAM_MODES:
        state["exp_avg"] = torch.zeros_like(mask)
        state["exp_avg_sq"] = torch.zeros_like(mask)
    return state


@torch.no_grad()
def bregman_step_(
    mask: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    *,
    faithful_to: str,
    lr: float,
    lambda_: float,
    kappa: float = 1.0,
    nu: float = 100.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-4,
    interval: int = 20,
    coupling: bool = False,
) -> None:
    """One step of the search on one mask vector, in place (`mask` and `state`).

    `"coupled"` (the default): `"code"` with `coupling` always on and `Z ← Z + lr·κ·(M_{k+1} − Γ_k)` (Adam's plain lr,
    not its bias-corrected step). `"code"` (the authors' `adamw_spp.py`): AdamW on
    `M` with the task-loss gradient only (weight decay 0), then
    `Z ← Z + s_t·κ·(M_{k+1} − Γ_k)` with Adam's bias-corrected step `s_t = lr / (1 − β1^t)`, and the one-sided
    `Γ = max(Z − λ, 0)`; with `coupling`, AdamW steps on `∇L + (M − Γ)/ν` instead (the gradient of the paper's
    coupled loss, Eq. 9, which the code only logs). `"paper"` (Eq. 10): `M_{k+1} = M_k − κ·lr·(∇L + (M_k − Γ_k)/ν)`,
    `Z_{k+1} = Z_k + (lr/ν)(M_k − Γ_k)`, `Γ_{k+1} = κ·sign(Z)·max(|Z| − λ, 0)`.
    Then the path record: `entry` gets the step number where `Γ` first turns non-zero, and every `interval` steps
    `record += 1[Γ ≠ 0]`.

    Args:
        mask (`torch.Tensor` of shape `(n,)`): the mask `M`.
        grad (`torch.Tensor` of shape `(n,)`): `∇_M` of the task loss.
        state (`dict`): from [`init_state`].
        faithful_to (`str`): `"coupled"`, `"code"` or `"paper"`.
        lr / lambda_ / kappa / nu / betas / eps / interval / coupling: see `SPPConfig`.
    """
    state["step"] += 1
    t = state["step"]
    z, gamma = state["z"], state["gamma"]
    if faithful_to in ADAM_MODES:
        coupling = coupling or faithful_to == "coupled"
        b1, b2 = betas
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if coupling:
            grad = grad + (mask - gamma) / nu
        m.mul_(b1).add_(grad, alpha=1 - b1)
        v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        step_size = lr / (1 - b1**t)
        denom = (v.sqrt() / math.sqrt(1 - b2**t)).add_(eps)
        mask.addcdiv_(m, denom, value=-step_size)
        # "code" scales Z's step by Adam's bias-corrected lr (≈ 10·lr at t = 1, β1 = 0.9: every unit gains Z ≈ 0.6·lr·…
        # early whatever its mask); "coupled" by lr itself, so Z is exactly lr·κ·Σ (M − Γ)
        z.add_(mask - gamma, alpha=(step_size if faithful_to == "code" else lr) * kappa)
        gamma.copy_(nonnegative_soft_threshold(z, lambda_))
    elif faithful_to == "paper":
        coupling = mask - gamma  # M_k − Γ_k
        mask.add_(grad + coupling / nu, alpha=-kappa * lr)
        z.add_(coupling, alpha=lr / nu)
        gamma.copy_(kappa * soft_threshold(z, lambda_))
    else:
        raise ValueError(f"faithful_to must be 'coupled', 'code' or 'paper', got {faithful_to!r}")
    entered = gamma != 0
    state["entry"][entered & (state["entry"] < 0)] = t
    if t % interval == 0:
        state["record"] += entered.to(state["record"].dtype)


# `_sum_squares`: the row length of its partial sums. A sum over a whole tensor of at least 32768 elements runs as one
# partial sum per thread, so its rounding depends on the thread count (measured: a float64 `x.pow(2).sum()` of 331k
# elements differs between 1 and 2 threads); a reduction along rows, one partial per row, is split over the rows and
# sums each row in the same order whatever the thread count
_ROW = 4096


def _sum_squares(g: torch.Tensor) -> float:
    """`Σ g²` in float64, the same to the last bit whatever the thread count: fixed rows of `_ROW` elements summed
    each in one pass, then the row sums added exactly (`math.fsum`)."""
    x = g.detach().flatten().double()
    full = x.numel() - x.numel() % _ROW
    rows = x[:full].view(-1, _ROW).pow(2).sum(1).tolist()
    return math.fsum(rows + [float(x[full:].pow(2).sum())])  # the tail (< `_ROW` elements): summed in one pass


def auto_nu(grads: Sequence[torch.Tensor], nu_scale: float) -> float:
    """ν from the measured gradient scale: `nu_scale / RMS(∇_M L)` over the masks `grads` of one unit kind (their
    gradients at `M = 1`, the first step's). The coupling's pull `(M − Γ)/ν` at `M = 1` then equals `1 / nu_scale`
    times the typical loss gradient, so a unit keeps its mask up only where the loss resists its removal at least
    that much, whatever the model's or the kind's gradient scale."""
    sq = math.fsum(_sum_squares(g) for g in grads)
    n = sum(g.numel() for g in grads)
    rms = math.sqrt(sq / max(n, 1))
    if not math.isfinite(rms) or rms <= 0:
        raise ValueError(
            "The mask gradients are all zero at the first step, so ν cannot be set from their scale (nu='auto'); "
            "check that the loss depends on the pruned units, or give `nu` a number."
        )
    return nu_scale / rms


def reachable_z(
    faithful_to: str, steps: int, lr: float, kappa: float = 1.0, nu: float = 100.0, betas=(0.9, 0.999)
) -> float:
    """The dual `Z` a unit whose mask stays at 1 reaches in `steps` steps (with `Γ = 0`): a unit enters only once `Z`
    passes λ, so a search with `reachable_z(...) <= lambda_` can enter no unit at all (masks above 1 aside)."""
    if faithful_to == "coupled":
        return kappa * lr * steps
    if faithful_to == "code":
        b1 = betas[0]
        return kappa * sum(lr / (1 - b1**t) for t in range(1, steps + 1))
    return steps * lr / nu


def removal_order(
    entry: torch.Tensor,
    record: torch.Tensor,
    z: torch.Tensor,
    gamma: torch.Tensor,
    statistic: str = "entry_time",
    tie_break: str = "z",
) -> torch.Tensor:
    """Units from the least to the most important along a solution path.

    `"entry_time"`: later entry = less important, never entered = least; `"step_record"`: fewer recorded intervals
    in the support = less important. Ties (and units that never entered) are ordered by `Z` (`"z"`: smaller = less
    important) or `|Γ|` (`"gamma"`); remaining exact ties keep the input order (deterministic).

    Args:
        entry / record / z / gamma (`torch.Tensor` of shape `(n,)`): the path statistics of every unit of a pool.

    Returns:
        `torch.LongTensor` of shape `(n,)`: indices, least important first.
    """
    tie = z if tie_break == "z" else gamma.abs()
    if statistic == "entry_time":
        never = int(entry.max().clamp_min(0)) + 1
        primary = torch.where(entry >= 0, entry, torch.full_like(entry, never))  # larger = less important
    elif statistic == "step_record":
        primary = -record
    else:
        raise ValueError(f"statistic must be 'entry_time' or 'step_record', got {statistic!r}")
    order = torch.sort(tie.double().cpu(), stable=True).indices  # smallest Z first
    return order[torch.sort(primary.cpu()[order], descending=True, stable=True).indices]


def select_removed(
    order: torch.Tensor, costs: torch.Tensor, groups: torch.Tensor, caps: Sequence[int], target: float
) -> torch.Tensor:
    """Walk `order` (least important first) and remove units until the removed cost is closest to `target`.

    A unit whose group (a layer's QK pairs, VO dimensions or MLP channels) has reached its cap is skipped (the guards:
    every layer keeps a minimum); the walk stops before the first unit that would overshoot the target by more than
    half its cost, so the achieved cost matches the target to within half a unit.

    Args:
        order (`torch.LongTensor` of shape `(n,)`): from [`removal_order`].
        costs (`torch.Tensor` of shape `(n,)`): parameters removed with each unit.
        groups (`torch.LongTensor` of shape `(n,)`): group id of each unit.
        caps (`Sequence[int]`): per group id, how many units may go at most.
        target (`float`): parameters to remove.

    Returns:
        `torch.BoolTensor` of shape `(n,)`: the removed units.
    """
    removed = torch.zeros(costs.numel(), dtype=torch.bool)
    taken = [0] * len(caps)
    done = 0.0
    cost_list, group_list = costs.double().tolist(), groups.tolist()
    for j in order.tolist():
        g, c = group_list[j], cost_list[j]
        if taken[g] >= caps[g]:
            continue
        if done + c / 2 > target:
            break
        removed[j] = True
        taken[g] += 1
        done += c
    return removed
