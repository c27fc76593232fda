"""Activation-aware weight scores shared by several methods: Wanda's (Sun et al., "A Simple and Effective Pruning
Approach for Large Language Models") and RIA's (Zhang et al., ICLR 2024), both from the calibration inputs' norms.

Wanda: `S_ij = |W_ij| * ||X_j||_2`, compared within each output row (`per="row"`) or within N:M groups.
RIA: `(|W_ij| / Σ_k |W_kj| + |W_ij| / Σ_k |W_ik|) * ||X_j||_2^a`: the first term normalises over the column (all
outputs that read input `j`), the second over the row (all inputs of output `i`).
There is no weight update; selection lives in `optimum_prune.functional.masks`.
"""

from __future__ import annotations

import torch

__all__ = ["wanda_scores", "ria_scores", "input_norms"]


def wanda_scores(weight: torch.Tensor, sumsq: torch.Tensor, nsamples: int | float = 1) -> torch.Tensor:
    """Wanda score `S_ij = |W_ij| * sqrt(sumsq_j / nsamples)`.

    The official code keeps `scaler_row = Σ_tokens x_j² / nsamples` and uses `sqrt(scaler_row)`. The normalisation
    by `nsamples` multiplies every score by the same constant, so it never changes which weights are pruned.

    Args:
        weight (`torch.Tensor` of shape `(out_features, in_features)`): dense weight `W`.
        sumsq (`torch.Tensor` of shape `(in_features,)`): sum over calibration tokens of the squared input, `Σ x_j²`.
        nsamples (`int` or `float`, defaults to `1`): normaliser of `sumsq` (number of samples or tokens).

    Returns:
        `torch.Tensor` of shape `(out_features, in_features)`: scores in float32 (float64 for float64 input).
    """
    dtype, x_norm = input_norms(weight, sumsq, nsamples)
    return weight.to(dtype).abs() * x_norm.unsqueeze(0)  # (out, in)


def input_norms(
    weight: torch.Tensor, sumsq: torch.Tensor, nsamples: int | float = 1
) -> tuple[torch.dtype, torch.Tensor]:
    """Checks the arguments of an activation-aware score and returns `(dtype, ||X_j||_2)`.

    The working dtype is float64 for float64 weights, else float32; the norms `sqrt(sumsq_j / nsamples)` are in it,
    on the weight's device.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}.")
    if sumsq.shape != (weight.shape[1],):
        raise ValueError(f"sumsq must have shape ({weight.shape[1]},) to match the weight, got {tuple(sumsq.shape)}.")
    if nsamples <= 0:
        raise ValueError(f"nsamples must be positive, got {nsamples}.")
    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    return dtype, (sumsq.to(device=weight.device, dtype=dtype).clamp_min(0) / nsamples).sqrt()  # (in,)


def ria_scores(weight: torch.Tensor, sumsq: torch.Tensor, a: float = 0.5, nsamples: int | float = 1) -> torch.Tensor:
    """RIA score `(|W_ij| / Σ_k |W_kj| + |W_ij| / Σ_k |W_ik|) * (sqrt(sumsq_j / nsamples)) ** a`.

    A row or column whose absolute sum is zero contributes `0` (instead of `0 / 0`).

    Args:
        weight (`torch.Tensor` of shape `(out_features, in_features)`): dense weight `W`.
        sumsq (`torch.Tensor` of shape `(in_features,)`): sum over calibration tokens of the squared input.
        a (`float`, defaults to `0.5`): exponent of the activation norm.
        nsamples (`int` or `float`, defaults to `1`): normaliser of `sumsq` (a common factor; ranking unchanged).

    Returns:
        `torch.Tensor` of shape `(out_features, in_features)`: scores in float32 (float64 for float64 input).
    """
    dtype, x_norm = input_norms(weight, sumsq, nsamples)  # (in,) ||X_j||_2
    W_abs = weight.to(dtype).abs()  # (out, in)
    col_sum = W_abs.sum(dim=0, keepdim=True)  # (1, in)  Σ_k |W_kj|
    row_sum = W_abs.sum(dim=1, keepdim=True)  # (out, 1) Σ_k |W_ik|
    col_sum = torch.where(col_sum == 0, torch.ones_like(col_sum), col_sum)
    row_sum = torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)
    return (W_abs / col_sum + W_abs / row_sum) * x_norm.pow(a).unsqueeze(0)  # (out, in)
