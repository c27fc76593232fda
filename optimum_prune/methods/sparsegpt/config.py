"""Configuration of SparseGPT (Frantar & Alistarh, ICML 2023, arXiv 2301.00774)."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import UnstructuredPruningConfig

__all__ = ["SparseGPTConfig"]


@dataclass
class SparseGPTConfig(UnstructuredPruningConfig):
    """SparseGPT: OBS column sweep with lazy block updates; masks chosen per block of columns.
    https://arxiv.org/abs/2301.00774

    Args:
        sparsity (`float`, defaults to `0.5`) / pattern (`str`, defaults to `"unstructured"`): see
            `UnstructuredPruningConfig`.
        blocksize (`int`, defaults to `128`): columns per lazy-update block (and per mask-selection block).
        percdamp (`float`, defaults to `0.01`): damping, as a fraction of mean(diag H); 10× on Cholesky failure.
    """

    method = "sparsegpt"

    blocksize: int = 128
    percdamp: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.blocksize, int) or self.blocksize < 1:
            raise ValueError(f"`blocksize` must be a positive int, got {self.blocksize!r}.")
        if not self.percdamp >= 0:
            raise ValueError(f"`percdamp` must be >= 0, got {self.percdamp!r}.")
