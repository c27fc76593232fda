"""The pass kinds a method plugs into, chosen by its `pass_kind`:

- `"structured"`: score → allocate → apply (`structured`; NP, FLAP, structured magnitude), with NP's sequential refit
  (`refit`) in place of the apply pass where it asks for one;
- `"experts"`: the same three steps for the experts of MoE layers (`experts`);
- `"layerwise"`: sequential prune, every block pruned in order on the outputs of the pruned ones (`layerwise`; the
  unstructured / N:M methods, several configs of a recipe in one pass);
- `"whole_model"`: decide on the whole model, then a dense refit pass (`whole_model`; SPP);
- `"variants"`: score every sublayer variant, assemble one per layer under a target, then the sequential refit
  (`variants`; the serving-shape search).
"""

from __future__ import annotations

from collections.abc import Sequence

from ...plan import PruningPlan
from ..stage import Stage
from .experts import experts_pass
from .layerwise import layerwise_pass
from .structured import structured_pass
from .variants import variants_pass
from .whole_model import whole_model_pass

__all__ = ["PASSES", "run_pass"]

PASSES = {
    "structured": structured_pass,
    "experts": experts_pass,
    "layerwise": lambda pruner, stage: layerwise_pass([pruner], stage),
    "whole_model": whole_model_pass,
    "variants": variants_pass,
}


def run_pass(pruners: Sequence, stage: Stage) -> PruningPlan:
    """The plan of one stage: a structured config alone, or the unstructured configs of a recipe in one pass."""
    if len(pruners) > 1:
        return layerwise_pass(pruners, stage)
    pruner = pruners[0]
    kind = pruner.pass_kind
    if kind not in PASSES:
        raise ValueError(f"{type(pruner).__name__}.pass_kind is {kind!r}; the pipeline runs {sorted(PASSES)}.")
    return PASSES[kind](pruner, stage)
