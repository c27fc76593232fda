"""Running one block on the calibration hidden states while accumulators observe module inputs."""

from __future__ import annotations

from typing import Any

from ...calibration.stats import feed
from ...modeling.architectures import LayerView

__all__ = ["observe_block"]


def observe_block(run, view: LayerView, layer_stats: dict[str, tuple[Any, Any]]) -> tuple[dict[str, Any], Any]:
    """Run block `view.index` once with `run` (the calibration runner), feeding each accumulator of `layer_stats`
    (`{name: (module whose input it observes, accumulator with .update(x))}`) with its module's inputs; returns the
    accumulators and the block's outputs (`run=None`: the accumulators unfed, no outputs)."""
    accumulators = {name: a for name, (_, a) in layer_stats.items()}
    outputs = None
    if run is not None:
        observe = {name: mod for name, (mod, _) in layer_stats.items()}
        outputs = run.run_layer(view.index, observe=observe, callback=feed(accumulators))
    return accumulators, outputs
