"""SparseGPT (Frantar & Alistarh, ICML 2023): OBS column sweep with lazy block updates.

With `U` the upper Cholesky factor of `H⁻¹` (`H = X Xᵀ` damped), columns are processed left to right. For column `j`
the pruned entries `w_j - q_j` are removed and the error is spread over the not-yet-processed columns:
`e = (w_j - q_j) / U_jj`, `W[:, j+1:] -= e U[j, j+1:]`. Updates inside a block of `blocksize` columns are applied
immediately; the update of the columns right of the block is applied once per block (one GEMM).

Mask selection: unstructured masks are chosen per block with the saliency `w² / U_jj²`; N:M masks are chosen at the
first column of every group of `M` with the saliency of the (already updated) weights of the group.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .hessian import cholesky_inverse_upper, dead_channels
from .masks import (
    check_pattern_fits,
    keep_mask_for_count,
    nm_keep_mask,
    num_pruned,
    parse_pattern,
)

__all__ = ["sparsegpt_prune"]

logger = logging.getLogger(__name__)


def _block_budgets(total: int, cols: int, bounds: list[tuple[int, int]]) -> list[int]:
    """Splits `total` pruned entries over column blocks proportionally, summing exactly to `total`."""
    return [round(total * i2 / cols) - round(total * i1 / cols) for i1, i2 in bounds]


def _validate(weight: torch.Tensor, H: torch.Tensor, mask: torch.Tensor | None) -> None:
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}.")
    cols = weight.shape[1]
    if H.shape != (cols, cols):
        raise ValueError(f"H must have shape ({cols}, {cols}) to match the weight, got {tuple(H.shape)}.")
    if mask is not None and mask.shape != weight.shape:
        raise ValueError(f"mask must have the weight's shape {tuple(weight.shape)}, got {tuple(mask.shape)}.")


@torch.no_grad()
def sparsegpt_prune(
    weight: torch.Tensor,
    H: torch.Tensor,
    sparsity: float | None = None,
    pattern: str | tuple[int, int] | None = None,
    blocksize: int = 128,
    percdamp: float = 0.01,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Prunes one linear layer with SparseGPT and reconstructs the kept weights.

    Args:
        weight (`torch.Tensor` of shape `(out_features, in_features)`): dense weight `W`.
        H (`torch.Tensor` of shape `(in_features, in_features)`): input Hessian `2 X Xᵀ` (any positive scale).
        sparsity (`float`, *optional*): unstructured target sparsity; the total number of zeros is exactly
            `round(sparsity * numel)` (split over blocks in proportion to their width), plus any extra zeros of
            dead channels beyond that budget.
        pattern (`str` or `tuple[int, int]`, *optional*): `"unstructured"`/`None`, `"N:M"` or `(N, M)` with `N`
            nonzeros kept per group of `M` inputs.
        blocksize (`int`, defaults to `128`): lazy-update block width (rounded down to a multiple of `M` for N:M).
        percdamp (`float`, defaults to `0.01`): damping `percdamp * mean(diag H)`, retried with 10x on failure.
        mask (`torch.Tensor` of shape `(out_features, in_features)`, *optional*): a fixed boolean keep mask (e.g.
            from Wanda or RIA); only the OBS reconstruction is run and `sparsity`/`pattern` are ignored.

    Returns:
        `(new_weight, info)`: `new_weight` has the dtype and device of `weight`; `info` holds `keep_mask`
        (`(out, in)` bool), `loss` (OBS estimate `Σ (w - q)² / (2 U_jj²)`), `dead_channels` and `blocksize`.
    """
    _validate(weight, H, mask)
    nm = parse_pattern(pattern)
    rows, cols = weight.shape
    if mask is None and nm is None and sparsity is None:
        raise ValueError("sparsegpt_prune needs `sparsity`, an N:M `pattern` or a fixed `mask`.")
    if blocksize < 1:
        raise ValueError(f"blocksize must be positive, got {blocksize}.")
    if mask is None and nm is not None:
        check_pattern_fits(cols, nm)
        blocksize = max(nm[1], blocksize - blocksize % nm[1])  # groups must not straddle blocks
    dtype = torch.float64 if torch.float64 in (weight.dtype, H.dtype) else torch.float32
    W = weight.to(dtype=dtype, copy=True)  # (out, in)
    dead = dead_channels(H).to(W.device)  # (in,)
    W[:, dead] = 0
    U = cholesky_inverse_upper(H.to(W.device), percdamp=percdamp, dtype=dtype)  # (in, in) Uᵀ U = H⁻¹

    bounds = [(i1, min(i1 + blocksize, cols)) for i1 in range(0, cols, blocksize)]
    budgets = _block_budgets(num_pruned(rows * cols, sparsity), cols, bounds) if mask is None and nm is None else None
    keep = torch.ones(rows, cols, dtype=torch.bool, device=W.device)  # (out, in)
    losses = torch.zeros(rows, dtype=dtype, device=W.device)  # (out,)
    for b, (i1, i2) in enumerate(bounds):
        W1 = W[:, i1:i2].clone()  # (out, B)
        Q1 = torch.zeros_like(W1)  # (out, B) pruned + reconstructed block
        Err1 = torch.zeros_like(W1)  # (out, B) scaled errors e
        U1 = U[i1:i2, i1:i2]  # (B, B)
        d1 = torch.diagonal(U1)  # (B,)
        if mask is not None:
            keep1 = mask[:, i1:i2].to(device=W.device, dtype=torch.bool)  # (out, B)
        elif nm is None:
            keep1 = keep_mask_for_count(W1.square() / d1.square(), budgets[b])  # (out, B) per-block saliency
        else:
            keep1 = torch.ones_like(W1, dtype=torch.bool)  # (out, B) filled group by group below
        for i in range(i2 - i1):
            if mask is None and nm is not None and i % nm[1] == 0:
                sal = W1[:, i : i + nm[1]].square() / d1[i : i + nm[1]].square()  # (out, M)
                keep1[:, i : i + nm[1]] = nm_keep_mask(sal, *nm)
            w = W1[:, i]  # (out,)
            q = torch.where(keep1[:, i], w, torch.zeros_like(w))  # (out,)
            err = (w - q) / U1[i, i]  # (out,)
            losses += err.square() / 2
            W1[:, i:].addr_(err, U1[i, i:], alpha=-1.0)  # OBS update of the rest of the block
            Q1[:, i] = q
            Err1[:, i] = err
        W[:, i1:i2] = Q1
        W[:, i2:].addmm_(Err1, U[i1:i2, i2:], alpha=-1.0)  # lazy update of the columns right of the block
        keep[:, i1:i2] = keep1
    info = {"keep_mask": keep, "loss": float(losses.sum().item()), "dead_channels": int(dead.sum().item())}
    info["blocksize"] = blocksize
    logger.debug("SparseGPT: loss %.4g, %d dead channels", info["loss"], info["dead_channels"])
    return W.to(weight.dtype), info
