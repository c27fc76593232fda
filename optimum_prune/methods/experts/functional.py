"""Expert pruning math: expert saliency from routing sums, which experts each layer keeps, and the channel selection
and refit inside one expert. Pure tensors (docs/methods/experts.md).

REAP (Lasby et al. 2025, arXiv 2510.13999, Eq. 9): over the set `X_j` of calibration tokens routed to expert `j`,
`S_j = 1/|X_j| Σ_{x ∈ X_j} g_j(x) · ‖f_j(x)‖₂`, with `g_j` the router's gate value and `f_j` the expert's output.
"""

from __future__ import annotations

import torch

from ...functional.compensation import compensate
from ...functional.fluctuation import fluctuation_metric
from ...functional.gram_scores import numerical_scores

__all__ = [
    "kept_width",
    "expert_saliency",
    "kept_experts",
    "kept_experts_global",
    "channel_saliency",
    "prune_expert_channels",
]


def kept_width(width: int, ratio: float, multiple: int = 1) -> int:
    """Channels each expert keeps: `width − round(ratio · width)`, to the nearest multiple of `multiple` (at least
    one multiple; a width of at most `multiple` is not rounded)."""
    kept = width - round(ratio * width)
    if multiple > 1 and width > multiple:
        kept = min(width, max(multiple, round(kept / multiple) * multiple))
    return kept


def expert_saliency(sums: dict[str, torch.Tensor], criterion: str, gate: str = "softmax", seed: int = 0):
    """`(E,)` float64 saliency of each expert of one layer (higher = kept first) from `RoutingStats.sums()`.

    `"reap"`: mean of gate × ‖output‖ over its routed tokens (`gate="softmax"`: the router probability, `"router"`:
    the routing weight of the forward); `"ean"`: mean ‖output‖; `"frequency"`: routed tokens; `"random"`: a seeded
    uniform draw. An expert no token reached scores 0 (it goes first) under every data criterion.
    """
    routed = sums["routed"].double()  # (E,)
    if criterion == "random":
        g = torch.Generator().manual_seed(seed)
        return torch.rand(routed.shape[0], generator=g, dtype=torch.float64)
    if criterion == "frequency":
        return routed.clone()
    total = {"reap": sums["prob_norm" if gate == "softmax" else "weight_norm"], "ean": sums["norm"]}[criterion]
    return torch.where(routed > 0, total.double() / routed.clamp_min(1), torch.zeros_like(routed))


def kept_experts(saliency: torch.Tensor, remove: int) -> list[int]:
    """The experts left after removing the `remove` least salient (ties: the lower index goes first), in index
    order."""
    order = torch.sort(saliency.double().cpu(), stable=True).indices  # ascending
    return sorted(order[remove:].tolist())


def kept_experts_global(saliencies: dict[int, torch.Tensor], remove: int, min_keep: int) -> dict[int, list[int]]:
    """Remove the `remove` least salient experts of all layers together, each layer keeping at least `min_keep`
    (ties: the earlier layer, then the lower index, goes first)."""
    left = {i: s.numel() for i, s in saliencies.items()}
    flat = sorted((float(s[j]), i, j) for i, s in saliencies.items() for j in range(s.numel()))
    gone: dict[int, set[int]] = {i: set() for i in saliencies}
    for _, i, j in flat:
        if remove == 0:
            break
        if left[i] > min_keep:
            gone[i].add(j)
            left[i] -= 1
            remove -= 1
    return {i: [j for j in range(s.numel()) if j not in gone[i]] for i, s in saliencies.items()}


def channel_saliency(
    W: torch.Tensor, gram: torch.Tensor, mean: torch.Tensor, ratio: float, method: str = "numerical"
) -> torch.Tensor:
    """`(I,)` float64 score of each channel of one expert (higher = kept), from its down projection `W (H, I)` and the
    Gram `(I, I)` / mean `(I,)` of its inputs on the tokens routed to it: Numerical Pruning's closed-form scores at
    `ratio` (`"numerical"`) or FLAP's `‖W_:,c‖²·Var(h_c)` (`"fluctuation"`)."""
    if method == "numerical":
        return numerical_scores(W, gram, ratio)
    var = (gram.diagonal().double() - mean.double() ** 2).clamp_min(0)  # (I,)
    return fluctuation_metric(W, mean, var)


def prune_expert_channels(
    W: torch.Tensor,
    gram: torch.Tensor | None,
    mean: torch.Tensor | None,
    keep: int,
    ratio: float,
    method: str = "numerical",
    damping: float = 0.1,
    refit: bool = True,
) -> tuple[list[int], torch.Tensor, float]:
    """Keep the `keep` best channels of one expert and refit its down projection to them.

    Args:
        W (`torch.Tensor` of shape `(H, I)`): the expert's down projection, `(out, in)`.
        gram (`torch.Tensor | None` of shape `(I, I)`): Gram of its inputs on its routed tokens; `None` when no
            token reached it: the channels are then ranked by `‖W_:,c‖` and nothing is refitted.
        mean (`torch.Tensor | None` of shape `(I,)`): mean of those inputs.
        keep (`int`): channels kept.
        ratio (`float`): the channel ratio (the numerical scores' count constraint).
        method (`str`): `channel_saliency`'s method.
        damping (`float`): relative ridge of the refit.
        refit (`bool`): refit the kept columns (least squares on the Gram, `functional.compensation.compensate`).

    Returns:
        `(kept channel indices in order, W_new (H, I) with the removed columns zero, residual loss)`.
    """
    if gram is None:
        score = W.double().pow(2).sum(0)
    else:
        score = channel_saliency(W, gram, mean, ratio, method)
    kept = sorted(torch.sort(score.cpu(), descending=True, stable=True).indices[:keep].tolist())
    idx = torch.as_tensor(kept, dtype=torch.long, device=W.device)
    if refit and gram is not None:
        W_new, residual = compensate(W, gram.to(W.device), idx, damping)
        return kept, W_new, residual
    W_new = torch.zeros_like(W)
    W_new[:, idx] = W[:, idx]
    return kept, W_new, float("nan")
