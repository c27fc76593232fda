"""Decide on the whole model, then refit: the pass kind of methods whose decision needs every block at once (SPP:
a search trained through the whole model, or a saved path, cut at the ratio).

`pruner.decide_model(model, spec)` returns the plan; where `pruner.refits`, one dense calibration pass
(`passes.refit.dense_refit_pass`) gives the kept weights their refit, and `pruner.refit_done(plan, entries,
seconds)` records what it reported.
"""

from __future__ import annotations

import time

from ...plan import PruningPlan
from ...utils.phases import phase
from ..stage import Stage
from .refit import dense_refit_pass

__all__ = ["whole_model_pass"]


def whole_model_pass(pruner, stage: Stage) -> PruningPlan:
    with phase("decide"):
        plan = pruner.decide_model(stage.model, stage.spec)
    if pruner.refits:
        t0 = time.perf_counter()
        entries = dense_refit_pass(pruner, stage, plan)
        pruner.refit_done(plan, entries, time.perf_counter() - t0)
    return plan
