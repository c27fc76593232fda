"""Running statistics of layer inputs, always accumulated in fp32 or fp64 whatever the model dtype."""

from __future__ import annotations

import torch

__all__ = ["GramStats", "CrossGramStats", "MomentStats", "SquaredNormStats"]


class GramStats:
    """Running `H = Σ_t x_t x_tᵀ` over tokens; `.gram` is normalised by the token count (SPEC §1.5), `.mean` is the
    per-channel mean (for refits with an intercept)."""

    def __init__(self, dim: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.sum = torch.zeros(dim, dim, dtype=dtype, device=device)  # (D, D)
        self.vsum = torch.zeros(dim, dtype=torch.float64, device=device)  # (D,)
        self.count = 0

    def update(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(self.sum.dtype)  # (N, D)
        self.sum.addmm_(x.T, x)
        self.vsum += x.sum(0, dtype=torch.float64)
        self.count += x.shape[0]

    @property
    def gram(self) -> torch.Tensor:
        return self.sum / max(self.count, 1)  # (D, D)

    @property
    def mean(self) -> torch.Tensor:
        return self.vsum / max(self.count, 1)  # (D,) float64

    def to(self, device: torch.device | str) -> GramStats:
        self.sum, self.vsum = self.sum.to(device), self.vsum.to(device)
        return self


class MomentStats:
    """Running per-channel mean and variance (FLAP's fluctuation), accumulated in fp64."""

    def __init__(self, dim: int, device: torch.device | str = "cpu") -> None:
        self.sum = torch.zeros(dim, dtype=torch.float64, device=device)  # (D,)
        self.sumsq = torch.zeros(dim, dtype=torch.float64, device=device)  # (D,)
        self.count = 0

    def update(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(torch.float64)  # (N, D)
        self.sum += x.sum(0)
        self.sumsq += (x * x).sum(0)
        self.count += x.shape[0]

    @property
    def mean(self) -> torch.Tensor:
        return self.sum / max(self.count, 1)  # (D,)

    @property
    def var(self) -> torch.Tensor:
        n = max(self.count, 2)
        return ((self.sumsq - self.sum * self.sum / n) / (n - 1)).clamp_min(0)  # (D,) unbiased

    def to(self, device: torch.device | str) -> MomentStats:
        self.sum, self.sumsq = self.sum.to(device), self.sumsq.to(device)
        return self


class SquaredNormStats:
    """Running `Σ_t x_{t,j}²` per input channel (Wanda / RIA `scaler_row` numerator)."""

    def __init__(self, dim: int, device: torch.device | str = "cpu") -> None:
        self.sumsq = torch.zeros(dim, dtype=torch.float32, device=device)  # (D,)
        self.count = 0

    def update(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()  # (N, D)
        self.sumsq += (x * x).sum(0)
        self.count += x.shape[0]

    def to(self, device: torch.device | str) -> SquaredNormStats:
        self.sumsq = self.sumsq.to(device)
        return self


class CrossGramStats:
    """Running `C = Σ_t x_t x*_tᵀ` between dense inputs `x` and pruned-network inputs `x*` (FISTA, SPEC §1.3)."""

    def __init__(self, dim: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.sum = torch.zeros(dim, dim, dtype=dtype, device=device)  # (D, D)
        self.xsum = torch.zeros(dim, dtype=torch.float64, device=device)  # (D,) Σ x
        self.xssum = torch.zeros(dim, dtype=torch.float64, device=device)  # (D,) Σ x*
        self.count = 0

    def update(self, x: torch.Tensor, x_star: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(self.sum.dtype)  # (N, D)
        x_star = x_star.reshape(-1, x_star.shape[-1]).to(self.sum.dtype)  # (N, D)
        self.sum.addmm_(x.T, x_star)
        self.xsum += x.sum(0, dtype=torch.float64)
        self.xssum += x_star.sum(0, dtype=torch.float64)
        self.count += x.shape[0]

    @property
    def gram(self) -> torch.Tensor:
        return self.sum / max(self.count, 1)  # (D, D)

    @property
    def means(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel means of `x` and of `x*` (float64)."""
        n = max(self.count, 1)
        return self.xsum / n, self.xssum / n
