"""Configuration of the data-free magnitude baseline."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import StructuredPruningConfig

__all__ = ["MagnitudePruningConfig"]


@dataclass
class MagnitudePruningConfig(StructuredPruningConfig):
    """Data-free structured magnitude pruning: a head (or KV group) / MLP channel scores the mean squared value of
    the weights it owns (its q/k/v rows and o columns; its gate/up rows and down column), so heads and channels are
    comparable in the global ranking. Inherits the `StructuredPruningConfig` fields.
    """

    method = "magnitude"
