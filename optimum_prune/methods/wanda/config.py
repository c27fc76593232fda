"""Configuration of Wanda (Sun et al., ICLR 2024, arXiv 2306.11695)."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import UnstructuredPruningConfig, choice

__all__ = ["WandaConfig"]


@dataclass
class WandaConfig(UnstructuredPruningConfig):
    """Wanda: prune the weights with the smallest `|W_ij|·‖X_j‖₂`, no weight update. https://arxiv.org/abs/2306.11695

    Args:
        sparsity (`float`, defaults to `0.5`) / pattern (`str`, defaults to `"unstructured"`): see
            `UnstructuredPruningConfig`.
        per (`str`, defaults to `"row"`): comparison group of the unstructured mask, `"row"` (paper) or `"matrix"`.
    """

    method = "wanda"

    per: str = "row"

    def __post_init__(self) -> None:
        super().__post_init__()
        choice("per", self.per, ("row", "matrix"))
