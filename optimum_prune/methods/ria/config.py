"""Configuration of RIA (Zhang et al., ICLR 2024, "Plug-and-Play")."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import UnstructuredPruningConfig, choice

__all__ = ["RIAConfig"]


@dataclass
class RIAConfig(UnstructuredPruningConfig):
    """RIA: relative importance `|W_ij|/Σ_k|W_kj| + |W_ij|/Σ_k|W_ik|` times `‖X_j‖^a`. https://openreview.net/forum?id=Tr0lPx9woF

    Args:
        sparsity (`float`, defaults to `0.5`) / pattern (`str`, defaults to `"unstructured"`): see
            `UnstructuredPruningConfig`.
        a (`float`, defaults to `0.5`): exponent of the activation norm.
        per (`str`, defaults to `"matrix"`): comparison group of the unstructured mask (`"matrix"`, the RIA code's
            default, or `"row"`).
        reconstruction (`bool`, defaults to `False`): after choosing the mask, update the kept weights with the
            SparseGPT OBS sweep (the RIA code's optional reconstruction).
    """

    method = "ria"

    a: float = 0.5
    per: str = "matrix"
    reconstruction: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        choice("per", self.per, ("row", "matrix"))
