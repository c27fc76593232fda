"""Budget allocation across layers: which heads / KV groups / channels to remove given per-unit scores and costs.

Pure tensor / list math: no modules, no hooks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "LayerUnits",
    "allocate",
    "allocate_channel_blocks",
    "channel_block_path",
    "allocate_per_layer",
    "allocate_servable",
    "literal_head_weight",
    "outlier_fraction",
    "owl_layer_ratios",
    "round_kept_channels",
]


@dataclass
class LayerUnits:
    """Prunable units of one layer.

    Args:
        head_scores (`torch.Tensor | None`): `(U,)` scores of the attention units (KV groups or query-head ranks),
            lower = pruned first. Units must be listed in the order they may be removed when scores tie.
        head_cost (`float`): parameters removed with one attention unit.
        max_head_units (`int`): how many attention units may go at most (guards).
        channel_scores (`torch.Tensor | None`): `(I,)` MLP channel scores.
        channel_cost (`float`): parameters removed with one MLP channel.
        max_channels (`int`): how many channels may go at most.
    """

    head_scores: torch.Tensor | None
    head_cost: float
    max_head_units: int
    channel_scores: torch.Tensor | None
    channel_cost: float
    max_channels: int


def literal_head_weight(u: LayerUnits, default: float) -> float:
    """NP's α for one layer's attention units: the unit's parameter cost in MLP-channel units (4·D_h/3 for an MHA
    head, `(2·n_rep+2)·D_h/3` for a GQA group, `2·n_kv·D_h/3` for a rank of query heads); `default` without MLP units."""
    return u.head_cost / u.channel_cost if u.channel_cost > 0 else default


def _flatten(units: list[LayerUnits], head_weight: float | None = None):
    scores, costs, layer, kind, index = [], [], [], [], []
    for li, u in enumerate(units):
        for k, (s, c) in enumerate(((u.head_scores, u.head_cost), (u.channel_scores, u.channel_cost))):
            if s is None:
                continue
            s = s.detach().double().cpu()
            if k == 0 and head_weight is not None:
                s = s * literal_head_weight(u, head_weight)
            scores.append(s)
            costs.append(torch.full_like(s, c))
            layer.append(torch.full(s.shape, li, dtype=torch.long))
            kind.append(torch.full(s.shape, k, dtype=torch.long))
            index.append(torch.arange(s.numel()))
    return torch.cat(scores), torch.cat(costs), torch.cat(layer), torch.cat(kind), torch.cat(index)


def allocate(units: list[LayerUnits], ratio: float, total_cost: float, mode: str = "global", head_weight: float = 1.0):
    """Choose the units to remove.

    Args:
        units (`list[LayerUnits]`): one entry per layer.
        ratio (`float`): target fraction of `total_cost` to remove.
        total_cost (`float`): the parameters the ratio refers to (attention + MLP).
        mode (`str`): `"global"` (cost-weighted global ranking, FLAP/NP: walk units by ascending score and stop
            where the removed cost is closest to the target), `"uniform"` (the same fraction of units in every
            layer) or `"literal"` (NP's printed recipe: head scores times `head_weight`, a unit-count threshold).
        head_weight (`float`): α of the literal mode for layers without MLP units; elsewhere α is the attention
            unit's cost over an MLP channel's (`literal_head_weight`), which is `4·D_h/3` for the paper's MHA heads.

    Returns:
        `(removed_heads, removed_channels)`: per layer, sorted lists of removed unit indices.

    Raises:
        `ValueError` when the target cannot be met within the guards (nothing has been changed at that point).
    """
    n = len(units)
    removed = [[[], []] for _ in range(n)]
    if mode == "uniform":
        for li, u in enumerate(units):
            for k, (s, cap, label) in enumerate(
                (
                    (u.head_scores, u.max_head_units, "attention units"),
                    (u.channel_scores, u.max_channels, "MLP channels"),
                )
            ):
                if s is None:
                    continue
                want = int(round(ratio * s.numel()))
                if want > cap:
                    raise ValueError(
                        f"pruning_ratio={ratio} with allocation='uniform' would remove {want} of {s.numel()} "
                        f"{label} in layer {li}, more than the guards allow ({cap}); every head of the layer would "
                        "go. Lower `pruning_ratio`, or use allocation='global'."
                    )
                order = torch.sort(s.detach().double().cpu(), stable=True).indices[:want]
                removed[li][k] = sorted(order.tolist())
        return [r[0] for r in removed], [r[1] for r in removed]

    scores, costs, layer, kind, index = _flatten(units, head_weight if mode == "literal" else None)
    order = torch.sort(scores, stable=True).indices
    caps = [[u.max_head_units, u.max_channels] for u in units]
    target = ratio * total_cost
    if mode == "literal":
        budget = int(round(ratio * scores.numel()))
        for j in order.tolist():
            if budget <= 0:
                break
            li, k = int(layer[j]), int(kind[j])
            if len(removed[li][k]) < caps[li][k]:
                removed[li][k].append(int(index[j]))
                budget -= 1
    else:
        done = 0.0
        for j in order.tolist():
            li, k, c = int(layer[j]), int(kind[j]), float(costs[j])
            if len(removed[li][k]) >= caps[li][k]:
                continue
            if done + c / 2 > target:
                break
            removed[li][k].append(int(index[j]))
            done += c
        reachable = sum(
            u.max_head_units * u.head_cost * (u.head_scores is not None)
            + u.max_channels * u.channel_cost * (u.channel_scores is not None)
            for u in units
        )
        if target - done > max(float(costs.max()), 1e-3 * total_cost) and done >= reachable - 1e-6:
            raise ValueError(
                f"pruning_ratio={ratio} cannot be reached: the guards (min heads / channels per layer, skipped "
                f"layers) allow removing at most {reachable / total_cost:.3f} of the attention+MLP parameters. "
                "Lower `pruning_ratio` or relax `min_heads_per_layer` / `min_mlp_channels_per_layer`."
            )
    return [sorted(r[0]) for r in removed], [sorted(r[1]) for r in removed]


def outlier_fraction(metrics: list[torch.Tensor], threshold: float) -> float:
    """OWL's layer outlier ratio (Yin et al., ICML 2024): the fraction of a layer's weights whose metric (Wanda's
    `|W_ij|·‖X_j‖`) exceeds `threshold` × the mean metric over all of the layer's weights."""
    m = torch.cat([x.detach().double().flatten() for x in metrics])
    return float((m > threshold * m.mean()).double().mean())


def owl_layer_ratios(fractions: list[float], ratio: float, lam: float, max_ratio: float = 0.95) -> list[float]:
    """OWL's non-uniform layer ratios: the outlier fractions rescaled to `[0, 2λ]` and centred, so that a layer keeps
    `1 − ratio + (its share above the mean)`: outlier-rich layers are pruned less, the mean ratio stays `ratio`
    (clipped to `[0, max_ratio]`)."""
    f = torch.tensor(fractions, dtype=torch.float64)
    spread = (f - f.min()) / (f.max() - f.min()).clamp_min(1e-12) * 2 * lam
    return (ratio - (spread - spread.mean())).clamp(0.0, max_ratio).tolist()


def allocate_per_layer(units: list[LayerUnits], ratios: list[float], totals: list[float]):
    """[`allocate`] with one budget per layer: layer `l` loses `ratios[l]` of `totals[l]` (its attention + MLP
    parameters), its attention units and MLP channels ranked together by score and cost."""
    removed_heads, removed_channels = [], []
    for li, (u, r, total) in enumerate(zip(units, ratios, totals)):
        if r <= 0 or (u.head_scores is None and u.channel_scores is None):
            removed_heads.append([])
            removed_channels.append([])
            continue
        try:
            heads, chans = allocate([u], r, total)
        except ValueError as e:
            raise ValueError(f"layer {li}: {e}") from None
        removed_heads += heads
        removed_channels += chans
    return removed_heads, removed_channels


def round_kept_channels(scores: torch.Tensor, removed: list[int], multiple: int, max_remove: int) -> list[int]:
    """Adjust a layer's removed channels so the kept count is a multiple of `multiple` (nearest, within guards)."""
    total = scores.numel()
    if multiple <= 1 or total <= multiple:
        return removed
    kept = total - len(removed)
    target_kept = max(multiple, int(round(kept / multiple)) * multiple)
    target_kept = min(total, max(target_kept, total - max_remove))
    order = torch.sort(scores.detach().double().cpu(), stable=True).indices
    return sorted(order[: total - target_kept].tolist())


def channel_block_path(scores: list[torch.Tensor | None], block: int) -> list[tuple[int, list[int]]]:
    """The order in which `allocate_channel_blocks` removes MLP channel blocks, all of them: `(layer, channels)` per
    block, every prefix of it a servable allocation (see there). A layer's blocks come in its own score order."""
    blocks = []  # (mean score, layer, position, channels)
    for li, s in enumerate(scores):
        if s is None or s.numel() <= block:
            continue
        order = torch.sort(s.detach().double().cpu(), stable=True).indices
        first = s.numel() % block
        bounds = ([(0, first)] if first else []) + [(a, a + block) for a in range(first, s.numel() - block, block)]
        s_sorted = s.detach().double().cpu()[order]
        level = -float("inf")
        for pos, (a, b) in enumerate(bounds):
            level = max(level, float(s_sorted[a:b].mean()))  # nondecreasing (but for rounding): a layer's order kept
            blocks.append((level, li, pos, order[a:b].tolist()))
    blocks.sort(key=lambda t: (t[0], t[1], t[2]))  # ascending mean score, position breaking ties
    return [(li, chans) for _, li, _, chans in blocks]


def allocate_channel_blocks(
    scores: list[torch.Tensor | None], costs: list[float], budget: float, block: int
) -> list[list[int]]:
    """MLP channels removed in whole blocks, so that every layer keeps a positive multiple of `block` channels.

    Each layer's channels are sorted by score; its removable blocks are, in that order, the `I mod block` weakest
    channels (so the rest is a multiple of `block`) and then successive `block`s, never the last one. Blocks of every
    layer are ranked together by the mean score of their channels (cost-weighted like `allocate`'s global mode:
    walk them in ascending order (`channel_block_path`), stop where the removed cost is closest to `budget`).

    Args:
        scores (`list[torch.Tensor | None]`): per layer, `(I,)` channel scores (lower = removed first), or `None`
            for a layer whose MLP is not pruned.
        costs (`list[float]`): per layer, the parameters one channel removes.
        budget (`float`): parameters to remove.
        block (`int`): the multiple every kept width must be.

    Returns:
        Per layer, the sorted removed channel indices.
    """
    removed: list[list[int]] = [[] for _ in scores]
    done = 0.0
    for li, chans in channel_block_path(scores, block):
        c = costs[li] * len(chans)
        if done + c / 2 > budget:
            break
        removed[li].extend(chans)
        done += c
    return [sorted(r) for r in removed]


def allocate_servable(
    units: list[LayerUnits], ratio: float, total_cost: float, block: int, attention_layers: list[int] = ()
):
    """Units to remove with shapes the DeciLM format holds: the attention of `attention_layers` whole (every
    attention unit of those layers), the rest of the budget in MLP channel blocks (`allocate_channel_blocks`).

    Returns:
        `(removed_heads, removed_channels)` as `allocate`.
    """
    gone = set(attention_layers)
    heads = [list(range(u.head_scores.numel())) if i in gone else [] for i, u in enumerate(units)]
    attn = sum(u.head_cost * len(h) for u, h in zip(units, heads))
    chans = allocate_channel_blocks(
        [u.channel_scores for u in units], [u.channel_cost for u in units], max(ratio * total_cost - attn, 0.0), block
    )
    reachable = attn + sum(
        (u.channel_scores.numel() - block) * u.channel_cost
        for u in units
        if u.channel_scores is not None and u.channel_scores.numel() > block
    )
    if ratio * total_cost - reachable > block * max((u.channel_cost for u in units), default=0.0):
        raise ValueError(
            f"pruning_ratio={ratio} cannot be reached with allocation='servable': keeping one block of {block} MLP "
            f"channels in every pruned layer allows removing at most {reachable / total_cost:.3f} of the "
            "attention+MLP parameters. Lower `pruning_ratio`, or use allocation='global'."
        )
    return heads, chans
