"""Running statistics of layer inputs, always accumulated in fp32 or fp64 whatever the model dtype.

Every statistic is a set of raw sums over tokens (plus the token count), so that it adds across calibration chunks
and across data-parallel ranks: in a `torch.distributed` process group, the first read of any statistic sums the
raw sums over the ranks (`distributed.all_reduce_sum_`), once. Every rank runs the same code and reads the same
statistics in the same order, so the collectives match; the methods never see the difference. The sums live on the
device of the first update (the block's working device), whatever `device` they were created with.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..utils.distributed import all_reduce_sum_, world_size

__all__ = ["GramStats", "CrossGramStats", "MomentStats", "SquaredNormStats", "RunningSums", "feed"]


def feed(accumulators: Mapping[str, Any]) -> Callable[[str, torch.Tensor], None]:
    """The runner's `callback` (`LayerwiseRunner.run_layer`) that adds each observed input `x` of the module named
    `name` to `accumulators[name]` (its `.update(x)`)."""
    return lambda name, x: accumulators[name].update(x)


class RunningSums:
    """Base of the statistics: `_fields` names the tensor attributes (sums over tokens), `count` the token count.

    Reading a statistic (`sum`, `gram`, `count`, ...) first sums the fields over the ranks of a process group
    (a no-op in one process); updating after that read is an error in a process group (it would be counted twice).
    """

    _fields: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._count = 0
        self._synced = False

    def _add(self, x: torch.Tensor) -> torch.Tensor:
        """Bookkeeping of one update; returns `x` flattened to `(N, D)` on the sums' device."""
        if self._synced and world_size() > 1:
            raise RuntimeError("internal error: a statistic was updated after it was read (and summed over ranks).")
        self._synced = False
        first = getattr(self, self._fields[0])
        if first.device != x.device:
            if self._count == 0:
                self.to(x.device)  # follow the block's working device
            else:
                x = x.to(first.device)
        x = x.reshape(-1, x.shape[-1])
        self._count += x.shape[0]
        return x

    def _sync(self) -> None:
        if self._synced:
            return
        if world_size() > 1:
            for name in self._fields:
                all_reduce_sum_(getattr(self, name))
            count = torch.tensor([self._count], dtype=torch.float64)
            self._count = int(all_reduce_sum_(count).item())
        self._synced = True

    @property
    def count(self) -> int:
        self._sync()
        return self._count

    def _get(self, name: str) -> torch.Tensor:
        self._sync()
        return getattr(self, name)

    def to(self, device: torch.device | str):
        for name in self._fields:
            setattr(self, name, getattr(self, name).to(device))
        return self

    def state_dict(self) -> dict[str, torch.Tensor | int]:
        """The raw sums and the token count (as accumulated in this process), e.g. to store a statistic on disk."""
        return {**{name.lstrip("_"): getattr(self, name) for name in self._fields}, "count": self._count}

    @classmethod
    def from_state_dict(cls, state: dict) -> RunningSums:
        """A statistic holding the sums and count of `state` (a `state_dict()`; names may carry a leading `_`),
        summed over no other rank."""
        data = {k.lstrip("_"): v for k, v in state.items()}
        obj = cls.__new__(cls)
        RunningSums.__init__(obj)
        obj._count = int(data["count"])
        for name in cls._fields:
            setattr(obj, name, data[name.lstrip("_")])
        return obj


class GramStats(RunningSums):
    """Running `H = Σ_t x_t x_tᵀ` over tokens; `.gram` is normalised by the token count (so that relative dampings
    transfer across set sizes), `.mean` is the per-channel mean (for refits with an intercept).

    With `normalize_in_place=True`, the first read of `.gram` divides the sums in place and every read returns that
    one tensor (read-only for the caller): a `(D, D)` matrix held once instead of twice. The raw `.sum` cannot be read
    after, nor can the statistic be updated."""

    _fields = ("_sum", "_vsum")
    _in_place = False  # class defaults: a statistic rebuilt by `from_state_dict` holds its raw sums
    _normalized = False

    def __init__(
        self,
        dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        normalize_in_place: bool = False,
    ) -> None:
        super().__init__()
        self._sum = torch.zeros(dim, dim, dtype=dtype, device=device)  # (D, D)
        self._vsum = torch.zeros(dim, dtype=torch.float64, device=device)  # (D,)
        self._in_place, self._normalized = normalize_in_place, False

    def update(self, x: torch.Tensor) -> None:
        if self._normalized:
            raise RuntimeError("internal error: a Gram normalised in place was updated.")
        x = self._add(x).to(self._sum.dtype)  # (N, D)
        self._sum.addmm_(x.T, x)
        self._vsum += x.sum(0, dtype=torch.float64)

    @property
    def sum(self) -> torch.Tensor:
        if self._normalized:
            raise RuntimeError("internal error: the raw sums of a Gram normalised in place were read.")
        return self._get("_sum")  # (D, D)

    @property
    def gram(self) -> torch.Tensor:
        if not self._in_place:
            return self.sum / max(self.count, 1)  # (D, D)
        if not self._normalized:
            self.sum.div_(max(self.count, 1))
            self._normalized = True
        return self._sum  # (D, D)

    @property
    def mean(self) -> torch.Tensor:
        return self._get("_vsum") / max(self.count, 1)  # (D,) float64

    def moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel mean and variance (E[x²] − E[x]², from the Gram's diagonal), float64 on the CPU: FLAP's
        fluctuation metric reads them."""
        mean = self.mean.double().cpu()
        return mean, (self.gram.diagonal().double().cpu() - mean * mean).clamp_min(0)


class MomentStats(RunningSums):
    """Running per-channel mean and variance (FLAP's fluctuation), accumulated in fp64."""

    _fields = ("_sum", "_sumsq")

    def __init__(self, dim: int, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self._sum = torch.zeros(dim, dtype=torch.float64, device=device)  # (D,)
        self._sumsq = torch.zeros(dim, dtype=torch.float64, device=device)  # (D,)

    def update(self, x: torch.Tensor) -> None:
        x = self._add(x).to(torch.float64)  # (N, D)
        self._sum += x.sum(0)
        self._sumsq += (x * x).sum(0)

    @property
    def sum(self) -> torch.Tensor:
        return self._get("_sum")

    @property
    def sumsq(self) -> torch.Tensor:
        return self._get("_sumsq")

    @property
    def mean(self) -> torch.Tensor:
        return self.sum / max(self.count, 1)  # (D,)

    @property
    def var(self) -> torch.Tensor:
        n = max(self.count, 2)
        return ((self.sumsq - self.sum * self.sum / n) / (n - 1)).clamp_min(0)  # (D,) unbiased


class SquaredNormStats(RunningSums):
    """Running `Σ_t x_{t,j}²` per input channel (Wanda / RIA `scaler_row` numerator)."""

    _fields = ("_sumsq",)

    def __init__(self, dim: int, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self._sumsq = torch.zeros(dim, dtype=torch.float32, device=device)  # (D,)

    def update(self, x: torch.Tensor) -> None:
        x = self._add(x).float()  # (N, D)
        self._sumsq += (x * x).sum(0)

    @property
    def sumsq(self) -> torch.Tensor:
        return self._get("_sumsq")


class CrossGramStats(RunningSums):
    """Running `C = Σ_t x_t x*_tᵀ` between dense inputs `x` and pruned-network inputs `x*` (FISTA's intra-layer error
    correction); `x` may have another width `dim` than `x*` (`dim_star`), e.g. dense outputs `W x` instead of
    inputs."""

    _fields = ("_sum", "_xsum", "_xssum")

    def __init__(
        self,
        dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        dim_star: int | None = None,
    ) -> None:
        super().__init__()
        dim_star = dim if dim_star is None else dim_star
        self._sum = torch.zeros(dim, dim_star, dtype=dtype, device=device)  # (D, D*)
        self._xsum = torch.zeros(dim, dtype=torch.float64, device=device)  # (D,) Σ x
        self._xssum = torch.zeros(dim_star, dtype=torch.float64, device=device)  # (D*,) Σ x*

    def update(self, x: torch.Tensor, x_star: torch.Tensor) -> None:
        x = self._add(x).to(self._sum.dtype)  # (N, D)
        x_star = x_star.reshape(-1, x_star.shape[-1]).to(device=x.device, dtype=self._sum.dtype)  # (N, D)
        self._sum.addmm_(x.T, x_star)
        self._xsum += x.sum(0, dtype=torch.float64)
        self._xssum += x_star.sum(0, dtype=torch.float64)

    @property
    def sum(self) -> torch.Tensor:
        return self._get("_sum")

    @property
    def gram(self) -> torch.Tensor:
        return self.sum / max(self.count, 1)  # (D, D)

    @property
    def means(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel means of `x` and of `x*` (float64)."""
        n = max(self.count, 1)
        return self._get("_xsum") / n, self._get("_xssum") / n
