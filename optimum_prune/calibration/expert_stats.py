"""Running statistics of a mixture-of-experts layer's routing, per expert (raw sums, so that they add across
calibration chunks and, through `RunningSums`, across data-parallel ranks).

- `RoutingStats`: over the tokens routed to each expert, how many, the sum of their router probabilities and
  weights, of the expert's output norm, and of the output norm weighted by the probability / weight (REAP).
- `ExpertGramStats`: per expert, the Gram `Σ w_t² h_t h_tᵀ` and mean of the input `h` of its down projection over the
  tokens routed to it (`w_t`: the routing weight the layer multiplies the expert's output by, or 1).
"""

from __future__ import annotations

import torch

from .stats import RunningSums

__all__ = ["RoutingStats", "ExpertGramStats"]


class RoutingStats(RunningSums):
    """Per-expert routing sums of one MoE layer; `count` is the number of tokens seen (routed or not)."""

    _fields = ("_routed", "_prob", "_weight", "_norm", "_prob_norm", "_weight_norm")

    def __init__(self, num_experts: int, device: torch.device | str = "cpu") -> None:
        super().__init__()
        for name in self._fields:
            setattr(self, name, torch.zeros(num_experts, dtype=torch.float64, device=device))  # (E,)

    def add_tokens(self, x: torch.Tensor) -> None:
        """Count the tokens of `x` (`(..., H)`): the layer saw them whichever experts they went to."""
        self._add(x)

    def update(self, j: int, prob: torch.Tensor, weight: torch.Tensor, norm: torch.Tensor) -> None:
        """Tokens routed to expert `j`: their router probability `prob (n,)` (softmax over every expert), routing weight
        `weight (n,)` and the norm of the expert's output `norm (n,)`."""
        prob, weight, norm = (t.to(self._routed.device, torch.float64) for t in (prob, weight, norm))
        self._routed[j] += prob.numel()
        self._prob[j] += prob.sum()
        self._weight[j] += weight.sum()
        self._norm[j] += norm.sum()
        self._prob_norm[j] += (prob * norm).sum()
        self._weight_norm[j] += (weight * norm).sum()

    def sums(self) -> dict[str, torch.Tensor]:
        """Every per-expert sum (`routed`, `prob`, `weight`, `norm`, `prob_norm`, `weight_norm`), summed over ranks."""
        return {name[1:]: self._get(name) for name in self._fields}


class ExpertGramStats(RunningSums):
    """Per-expert Gram and mean of the down-projection inputs over the tokens routed to each expert, each token
    weighted by `w²` (`weighted=True`: the squared routing weight, so that the Gram measures the layer's output error)."""

    _fields = ("_sum", "_vsum", "_wsum")

    def __init__(self, num_experts: int, dim: int, dtype: torch.dtype = torch.float32, device="cpu") -> None:
        super().__init__()
        self._sum = torch.zeros(num_experts, dim, dim, dtype=dtype, device=device)  # (E, I, I)
        self._vsum = torch.zeros(num_experts, dim, dtype=torch.float64, device=device)  # (E, I)
        self._wsum = torch.zeros(num_experts, dtype=torch.float64, device=device)  # (E,)

    def update(self, j: int, h: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        """Tokens routed to expert `j`: its down-projection inputs `h (n, I)` and their weights `weight (n,)`."""
        h = self._add(h)  # (n, I)
        w2 = torch.ones(h.shape[0], dtype=torch.float64, device=h.device) if weight is None else weight.double() ** 2
        hw = h.to(self._sum.dtype) * w2.to(self._sum.dtype)[:, None]  # (n, I)
        self._sum[j].addmm_(hw.T, h.to(self._sum.dtype))
        self._vsum[j] += (h.double() * w2[:, None]).sum(0)
        self._wsum[j] += w2.sum()

    def weight_sum(self) -> torch.Tensor:
        """`(E,)` the summed token weights of each expert (0: no token was routed to it)."""
        return self._get("_wsum")

    def gram(self, j: int) -> torch.Tensor:
        """`(I, I)` weighted Gram of expert `j`, normalised by its summed weights."""
        return self._get("_sum")[j] / max(float(self._get("_wsum")[j]), 1e-30)

    def mean(self, j: int) -> torch.Tensor:
        """`(I,)` weighted mean of expert `j`'s down-projection inputs (float64)."""
        return self._get("_vsum")[j] / max(float(self._get("_wsum")[j]), 1e-30)
