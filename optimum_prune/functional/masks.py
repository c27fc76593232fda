"""Sparsity masks: unstructured (per matrix or per row) and N:M semi-structured selection.

Conventions used by every function here:

- scores and weights use the PyTorch `nn.Linear` layout `(out_features, in_features)`;
- a *keep mask* is a boolean tensor that is `True` where the weight survives;
- N:M has NVIDIA's meaning: `N` nonzeros are **kept** in every group of `M` consecutive input entries of a row
  (2:4 keeps 2 of 4, i.e. 50 % sparsity). The Wanda/SparseGPT/RIA research code calls the number of *zeros* `prune_n`;
- ties are broken deterministically: among equal scores the entry with the lower (flattened) index is kept.
"""

from __future__ import annotations

import math
import re

import torch

__all__ = [
    "parse_pattern",
    "check_pattern_fits",
    "num_pruned",
    "keep_mask_for_count",
    "unstructured_keep_mask",
    "nm_keep_mask",
    "keep_mask",
    "measured_sparsity",
    "is_valid_nm",
]

_NM_RE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")
_PER_CHOICES = ("matrix", "row")


def parse_pattern(pattern: str | tuple[int, int] | None) -> tuple[int, int] | None:
    """Parses a sparsity pattern.

    Args:
        pattern (`str`, `tuple[int, int]` or `None`):
            `"unstructured"` (or `None`) for unstructured sparsity, `"N:M"` (e.g. `"2:4"`) or a tuple `(N, M)` for
            N:M sparsity with `N` nonzeros kept per group of `M` consecutive inputs.

    Returns:
        `None` for unstructured sparsity, otherwise the validated `(N, M)`.

    Raises:
        `ValueError` for malformed strings, `N < 1` or `N >= M`.
    """
    if pattern is None:
        return None
    if isinstance(pattern, str):
        if pattern.strip().lower() == "unstructured":
            return None
        match = _NM_RE.match(pattern)
        if match is None:
            raise ValueError(f"Invalid sparsity pattern {pattern!r}: expected 'unstructured' or 'N:M' such as '2:4'.")
        n, m = int(match.group(1)), int(match.group(2))
    elif isinstance(pattern, (tuple, list)) and len(pattern) == 2 and all(type(v) is int for v in pattern):
        n, m = pattern
    else:
        raise ValueError(f"Invalid sparsity pattern {pattern!r}: expected 'unstructured', 'N:M' or a tuple (N, M).")
    if n < 1:
        raise ValueError(f"Invalid N:M pattern {n}:{m}: N (nonzeros kept per group) must be at least 1.")
    if n >= m:
        raise ValueError(
            f"Invalid N:M pattern {n}:{m}: N (nonzeros kept per group of M) must be smaller than M, "
            f"otherwise nothing is pruned."
        )
    return n, m


def check_pattern_fits(in_features: int, pattern: str | tuple[int, int] | None, name: str | None = None) -> None:
    """Raises a `ValueError` when the group size `M` of an N:M pattern does not divide the layer width.

    Args:
        in_features (`int`): number of input features of the layer (the dimension the groups run along).
        pattern (`str`, `tuple[int, int]` or `None`): see [`parse_pattern`].
        name (`str`, *optional*): layer name used in the error message.
    """
    nm = parse_pattern(pattern)
    if nm is None:
        return
    n, m = nm
    if in_features % m != 0:
        where = f"layer {name!r}" if name else "the layer"
        raise ValueError(
            f"N:M pattern {n}:{m} needs in_features divisible by M={m}, but {where} has in_features={in_features} "
            f"({in_features} % {m} = {in_features % m}). Exclude this layer or use unstructured sparsity."
        )


def num_pruned(numel: int, sparsity: float) -> int:
    """Number of entries to zero: `round(sparsity * numel)`, rounding halves up.

    Args:
        numel (`int`): number of entries in the comparison group.
        sparsity (`float`): target fraction of zeros in `[0, 1]`.
    """
    if not 0.0 <= sparsity <= 1.0:
        raise ValueError(f"sparsity must be in [0, 1], got {sparsity}.")
    return min(numel, int(math.floor(sparsity * numel + 0.5)))


def _keep_largest_per_row(scores: torch.Tensor, n_prune: int, band: int = 1 << 22) -> torch.Tensor:
    """Per row of a 2-D tensor, prunes the `n_prune` lowest scores; ties keep the lower column index. Rows are
    independent: they are ranked `band` entries at a time, so the temporaries stay small whatever the matrix."""
    rows, cols = scores.shape
    if n_prune <= 0:
        return torch.ones(rows, cols, dtype=torch.bool, device=scores.device)
    if n_prune >= cols:
        return torch.zeros(rows, cols, dtype=torch.bool, device=scores.device)
    step = max(band // cols, 1)
    if rows > step:
        out = torch.empty(rows, cols, dtype=torch.bool, device=scores.device)
        for r in range(0, rows, step):
            out[r : r + step] = _keep_largest_per_row(scores[r : r + step], n_prune, band)
        return out
    # kthvalue is O(numel) and exact; the tie handling below makes the result independent of its internals.
    thresh = scores.kthvalue(n_prune, dim=1, keepdim=True).values  # (rows, 1) n_prune-th smallest score
    below = scores < thresh  # (rows, cols) pruned for sure
    tie = scores == thresh  # (rows, cols) candidates at the threshold
    n_tie_prune = n_prune - below.sum(dim=1, keepdim=True)  # (rows, 1) always >= 1
    idx_dtype = torch.int32 if cols < 2**31 else torch.int64
    tie_rank = tie.cumsum(dim=1, dtype=idx_dtype)  # (rows, cols) 1-based rank among ties, by column index
    n_keep_ties = tie_rank[:, -1:] - n_tie_prune  # (rows, 1) the lowest-index ties survive
    return ~(below | (tie & (tie_rank > n_keep_ties)))  # (rows, cols)


def _as_scores(scores: torch.Tensor) -> torch.Tensor:
    if scores.dim() != 2:
        raise ValueError(f"scores must be 2-D (out_features, in_features), got shape {tuple(scores.shape)}.")
    if scores.dtype in (torch.float16, torch.bfloat16):
        scores = scores.float()  # exact upcast, same order; half kthvalue is not available everywhere
    if torch.isnan(scores).any():
        raise ValueError("scores contain NaN; cannot rank them.")
    return scores


def keep_mask_for_count(scores: torch.Tensor, n_prune: int, per: str = "matrix") -> torch.Tensor:
    """Keep mask that zeros exactly `n_prune` lowest-scored entries per matrix or per row.

    Args:
        scores (`torch.Tensor` of shape `(out_features, in_features)`): importance scores, larger is kept.
        n_prune (`int`): entries to prune per comparison group (the whole matrix or each row).
        per (`str`, defaults to `"matrix"`): `"matrix"` for one global threshold, `"row"` for one per output row.
    """
    if per not in _PER_CHOICES:
        raise ValueError(f"per must be one of {_PER_CHOICES}, got {per!r}.")
    S = _as_scores(scores)
    if per == "row":
        return _keep_largest_per_row(S, n_prune)  # (out, in)
    return _keep_largest_per_row(S.reshape(1, -1), n_prune).reshape(S.shape)  # (out, in)


def unstructured_keep_mask(scores: torch.Tensor, sparsity: float, per: str = "matrix") -> torch.Tensor:
    """Keeps the largest scores and zeros exactly `round(sparsity * numel)` entries per matrix or per row.

    Args:
        scores (`torch.Tensor` of shape `(out_features, in_features)`): importance scores, larger is kept.
        sparsity (`float`): fraction of entries to prune, in `[0, 1]`.
        per (`str`, defaults to `"matrix"`): comparison group, `"matrix"` or `"row"` (Wanda uses `"row"`).
    """
    if per not in _PER_CHOICES:
        raise ValueError(f"per must be one of {_PER_CHOICES}, got {per!r}.")
    numel = scores.shape[-1] if per == "row" else scores.numel()
    return keep_mask_for_count(scores, num_pruned(numel, sparsity), per=per)


def nm_keep_mask(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Per row, keeps the `n` largest scores in each group of `m` consecutive inputs.

    Args:
        scores (`torch.Tensor` of shape `(out_features, in_features)`): importance scores, larger is kept.
        n (`int`): nonzeros kept per group.
        m (`int`): group size; must divide `in_features`.
    """
    parse_pattern((n, m))
    S = _as_scores(scores)
    rows, cols = S.shape
    check_pattern_fits(cols, (n, m))
    groups = S.reshape(rows, cols // m, m)  # (out, in/m, m)
    # A stable descending sort keeps the lower index first among equal scores.
    order = torch.sort(groups, dim=-1, descending=True, stable=True).indices  # (out, in/m, m)
    keep = torch.zeros(groups.shape, dtype=torch.bool, device=S.device)  # (out, in/m, m)
    keep.scatter_(-1, order[..., :n], True)
    return keep.reshape(rows, cols)  # (out, in)


def keep_mask(
    scores: torch.Tensor,
    sparsity: float | None = None,
    pattern: str | tuple[int, int] | None = None,
    per: str = "matrix",
) -> torch.Tensor:
    """Dispatches to [`nm_keep_mask`] when `pattern` is N:M, else to [`unstructured_keep_mask`].

    Args:
        scores (`torch.Tensor` of shape `(out_features, in_features)`): importance scores, larger is kept.
        sparsity (`float`, *optional*): unstructured target sparsity; required when `pattern` is unstructured.
        pattern (`str` or `tuple[int, int]`, *optional*): `"unstructured"`/`None`, `"N:M"` or `(N, M)`.
        per (`str`, defaults to `"matrix"`): comparison group for unstructured sparsity, `"matrix"` or `"row"`.
    """
    nm = parse_pattern(pattern)
    if nm is not None:
        return nm_keep_mask(scores, *nm)
    if sparsity is None:
        raise ValueError("sparsity is required for unstructured pruning.")
    return unstructured_keep_mask(scores, sparsity, per=per)


def measured_sparsity(t: torch.Tensor) -> float:
    """Fraction of exactly-zero entries of `t` (0.0 for an empty tensor).

    Args:
        t (`torch.Tensor`): any tensor, e.g. a pruned weight.
    """
    numel = t.numel()
    return 0.0 if numel == 0 else float((t == 0).sum().item()) / numel


def is_valid_nm(weight: torch.Tensor, n: int, m: int) -> bool:
    """Whether every group of `m` consecutive entries along the last dimension has at most `n` nonzeros.

    Args:
        weight (`torch.Tensor` of shape `(..., in_features)`): weight to check.
        n (`int`): maximum nonzeros per group.
        m (`int`): group size; `False` is returned when it does not divide `in_features`.
    """
    if weight.shape[-1] % m != 0:
        return False
    nonzeros = (weight != 0).reshape(-1, m).sum(dim=-1)  # (numel / m,)
    return bool((nonzeros <= n).all().item())
