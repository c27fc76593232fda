"""Configuration of the data-free magnitude baseline."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import StructuredPruningConfig, choice, validate_sparsity, validate_targets
from ...functional.masks import parse_pattern

__all__ = ["MagnitudeConfig"]


@dataclass
class MagnitudeConfig(StructuredPruningConfig):
    """Data-free magnitude pruning, structured or unstructured / N:M.

    Structured (`pattern="structured"`, the default): a head (or KV group) / MLP channel scores the mean squared
    value of the weights it owns (its q/k/v rows and o columns; its gate/up rows and down column), so heads and
    channels are comparable in the global ranking; `pruning_ratio` and the other `StructuredPruningConfig` fields
    apply. Unstructured: the `sparsity` smallest-|w| weights of every projection are zeroed.

    Args:
        pattern (`str`, defaults to `"structured"`): `"structured"`, `"unstructured"` or `"N:M"` (e.g. `"2:4"`).
        sparsity (`float`, defaults to `0.5`): fraction zeroed per projection (unstructured / N:M only).
        per (`str`, defaults to `"matrix"`): unstructured comparison group, `"matrix"` or `"row"`.
        targets (`tuple[str, ...] | None`, defaults to `None`): unstructured / N:M only: the projections to prune,
            by role (see `UnstructuredPruningConfig`); `None` = all.
    """

    method = "magnitude"

    pattern: str = "structured"
    sparsity: float = 0.5
    per: str = "matrix"
    targets: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        choice("per", self.per, ("matrix", "row"))
        if self.pattern != "structured":
            validate_sparsity(self.sparsity, self.pattern)
        elif self.targets is not None:
            raise ValueError(
                "`targets` applies to unstructured / N:M magnitude pruning; structured pruning selects parts with "
                "`prune_attention` / `prune_mlp`."
            )
        self.targets = validate_targets(self.targets)

    @property
    def nm(self) -> tuple[int, int] | None:
        return None if self.pattern in ("structured", "unstructured") else parse_pattern(self.pattern)
