"""RIA: relative importance and activations (Zhang et al., ICLR 2024), plus N:M channel reallocation.

`RIA_ij = (|W_ij| / Σ_k |W_kj| + |W_ij| / Σ_k |W_ik|) * ||X_j||_2^a`: the first term normalises over the column (all
outputs that read input `j`), the second over the row (all inputs of output `i`). Default `a = 0.5`.

Channel reallocation (N:M only) permutes input channels before the N:M selection so that every group of `M` holds
channels of different importance. The returned mask is valid N:M in the **permuted** column order only; realising a
speedup needs the inputs permuted the same way. The optional linear-sum-assignment refinement needs `scipy` (the `lsa` extra).
"""

from __future__ import annotations

import importlib.util

import torch

from ...functional.masks import check_pattern_fits, nm_keep_mask, parse_pattern

__all__ = ["ria_channel_reallocation", "nm_retained_score"]

_LSA_BUDGET = 1 << 26  # elements of the (out, chunk, G, m) candidate tensor evaluated at once


def nm_retained_score(scores: torch.Tensor, n: int, m: int) -> float:
    """Sum of the scores kept by an N:M selection in the given column order (the objective reallocation raises).

    Args:
        scores (`torch.Tensor` of shape `(out_features, in_features)`): importance scores.
        n (`int`): nonzeros kept per group.
        m (`int`): group size.
    """
    groups = scores.reshape(scores.shape[0], -1, m)  # (out, in/m, m)
    return float(groups.topk(n, dim=-1).values.sum().item())


def _interleave_strips(scores: torch.Tensor, m: int) -> torch.Tensor:
    """RIA heuristic: sort channels by summed score, cut into `m` strips, deal strip `s` to slot `s` of every group."""
    cols = scores.shape[1]
    strip = cols // m
    sorted_idx = torch.sort(scores.sum(dim=0), stable=True).indices  # (in,) ascending channel importance
    perm = torch.empty_like(sorted_idx)  # (in,)
    for s in range(m):
        chunk = sorted_idx[s * strip : (s + 1) * strip]  # (in/m,)
        perm[s::m] = chunk if s % 2 == 0 else chunk.flip(0)  # alternate ascending / descending strips
    return perm


def _lsa_round(scores: torch.Tensor, seg: torch.Tensor, n: int, m: int, slot: int, chunk: int | None) -> torch.Tensor:
    """One linear-sum-assignment pass: re-assigns the channel in `slot` of every group of `seg` optimally."""
    from scipy.optimize import linear_sum_assignment  # noqa: PLC0415  (optional dep: the `lsa` extra, checked by the caller)

    S = scores[:, seg]  # (out, L)
    rows, L = S.shape
    n_groups = L // m
    grp = S.reshape(rows, n_groups, m)  # (out, G, m)
    others = grp[..., [j for j in range(m) if j != slot]]  # (out, G, m-1) channels that stay in their group
    cand = grp[..., slot]  # (out, G) the movable channel of each group
    chunk = chunk or max(1, _LSA_BUDGET // (rows * n_groups * m))
    value = torch.empty(n_groups, n_groups, dtype=torch.float64)  # (G_target, G_source)
    for g0 in range(0, n_groups, chunk):
        g1 = min(g0 + chunk, n_groups)
        fixed = others[:, g0:g1, None, :].expand(rows, g1 - g0, n_groups, m - 1)  # (out, c, G, m-1)
        moved = cand[:, None, :, None].expand(rows, g1 - g0, n_groups, 1)  # (out, c, G, 1)
        combo = torch.cat([fixed, moved], dim=-1)  # (out, c, G, m)
        value[g0:g1] = combo.topk(n, dim=-1).values.sum(dim=(0, -1)).double().cpu()  # (c, G)
    _, source = linear_sum_assignment(value.numpy(), maximize=True)  # source group for each target group
    source = torch.as_tensor(source, device=seg.device)  # (G,)
    new_seg = seg.clone()  # (L,)
    targets = torch.arange(n_groups, device=seg.device) * m + slot  # (G,)
    new_seg[targets] = seg[source * m + slot]
    return new_seg


def ria_channel_reallocation(
    scores: torch.Tensor, n: int, m: int, lsa: bool = False, lsa_blocks: int = 1, lsa_chunk: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """N:M mask after RIA's heuristic channel reallocation, optionally refined by linear sum assignment.

    Args:
        scores (`torch.Tensor` of shape `(out_features, in_features)`): importance scores (e.g. [`ria_scores`]).
        n (`int`): nonzeros kept per group.
        m (`int`): group size; must divide `in_features`.
        lsa (`bool`, defaults to `False`): refine the permutation with one linear-sum-assignment pass per slot
            (needs `scipy`, the `lsa` extra; the total retained score never decreases).
        lsa_blocks (`int`, defaults to `1`): split the channels into this many independent assignment problems
            (RIA's "fast" mode), trading quality for an `O((in/m/blocks)^3)` cost.
        lsa_chunk (`int`, *optional*): target groups evaluated at once; by default sized to about 2**26 elements.

    Returns:
        `(keep_mask, perm)`: `keep_mask` of shape `(out_features, in_features)` in the original column order, and
        `perm` of shape `(in_features,)` such that `keep_mask[:, perm]` is valid N:M (and `W[:, perm]` is the weight
        in the layout a sparse kernel needs).
    """
    parse_pattern((n, m))
    check_pattern_fits(scores.shape[1], (n, m))
    S = scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores
    perm = _interleave_strips(S, m)  # (in,)
    if lsa:
        if importlib.util.find_spec("scipy") is None:
            raise ImportError("lsa=True solves linear sum assignments with scipy: pip install 'optimum-prune[lsa]'.")
        n_groups = S.shape[1] // m
        if lsa_blocks < 1 or n_groups % lsa_blocks != 0:
            raise ValueError(f"lsa_blocks={lsa_blocks} must divide the number of groups ({n_groups}).")
        seg_len = S.shape[1] // lsa_blocks
        for slot in range(m):
            for b in range(lsa_blocks):
                seg = perm[b * seg_len : (b + 1) * seg_len]  # (L,)
                perm[b * seg_len : (b + 1) * seg_len] = _lsa_round(S, seg, n, m, slot, lsa_chunk)
    keep_perm = nm_keep_mask(S[:, perm], n, m)  # (out, in) valid N:M in the permuted order
    keep = torch.empty_like(keep_perm)  # (out, in)
    keep[:, perm] = keep_perm
    return keep, perm
