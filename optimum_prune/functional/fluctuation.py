"""FLAP metrics and bias compensation (as the official code computes them). `W` is `(d_out, D)` (PyTorch layout)."""

from __future__ import annotations

import torch

__all__ = ["bias_compensation", "fluctuation_metric", "fluctuation_scores", "standardize"]


def fluctuation_metric(W: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, metric: str = "wifv") -> torch.Tensor:
    """Per-input-channel metric `(D,)` from the channel mean / variance of the module's input."""
    W = W.double()
    if metric == "wifv":
        return var.double() * (W * W).sum(0)  # (D,)
    if metric == "ifv":
        return var.double().clone()  # (D,)
    if metric == "wifn":
        sq_mean = var.double() + mean.double() ** 2  # E[x²]
        return W.abs().mean(0) * sq_mean.sqrt()  # (D,)
    raise ValueError(f"unknown FLAP metric {metric!r}")


def standardize(x: torch.Tensor) -> torch.Tensor:
    """`(x − mean) / std` over the channels of one layer."""
    return (x - x.mean()) / x.std().clamp_min(1e-12)


def fluctuation_scores(
    W: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    metric: str = "wifv",
    square: bool = False,
    standardized: bool = True,
    head_dim: int | None = None,
) -> torch.Tensor:
    """FLAP's score of each input channel of a module `(D,)`, or of each head `(D // head_dim,)`: the metric, squared
    if `square` (the official code squares the attention metric), standardised over the module if `standardized`,
    and averaged over each head's channels when `head_dim` is given."""
    m = fluctuation_metric(W, mean, var, metric)
    if square:
        m = m * m
    if standardized:
        m = standardize(m)
    return m if head_dim is None else m.view(-1, head_dim).mean(1)


def bias_compensation(W: torch.Tensor, mean: torch.Tensor, pruned: torch.Tensor) -> torch.Tensor:
    """`b = Σ_{j ∈ pruned} mean(X_j) · W[:, j]` — the expected contribution of the removed channels. `(d_out,)`."""
    return W.double()[:, pruned] @ mean.double()[pruned]
