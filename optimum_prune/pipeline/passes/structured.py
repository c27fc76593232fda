"""Score → allocate → apply: the pass kind of the structured methods that remove heads / KV groups / MLP channels
(NP, FLAP, magnitude).

1. **Score.** One pass over the dense model's blocks: each block runs once on the calibration hidden states while
   the accumulators of `pruner.block_stats(view)` observe the module inputs they name; `pruner.score_block` turns
   them into per-head and per-channel scores (and OWL's outlier fraction). A resumed run reads the scores of the
   blocks an earlier run finished from the checkpoint; a `CalibrationStatsCache` can hand the whole pass over.
2. **Allocate.** `pruner.decide(...)` picks the units every block loses: `LayerPlan`s, no weight read.
3. **Apply.** A second pass: `pruner.finalize_layer` writes each block's compensated weights into its plan (the
   statistics of the first pass, or observed again where they were not kept), and the session finishes the block
   (a low-memory or checkpointed run writes it at once; in memory the runner applies the whole plan at the end).
   Where `pruner.refit_inputs == "sequential"`, the refit pass (`passes.refit`) replaces this one.
"""

from __future__ import annotations

import logging
from typing import Any

from ...modeling.architectures import LayerView
from ...modeling.shapes import attention_mlp_params
from ...plan import PruningPlan
from ...utils.phases import phase
from ..stage import Stage
from .observe import observe_block
from .refit import sequential_refit_pass

__all__ = ["score_pass", "structured_pass"]

logger = logging.getLogger(__name__)


def score_pass(pruner, stage: Stage, views: list[LayerView]) -> tuple[dict, dict, dict]:
    """The first pass: `(statistics kept per block, (head scores, channel scores) per block, OWL outlier fraction
    per block)`, from one dense calibration pass over the blocks or from the stage's `stats_cache` (never in an
    active session), or what the pruner was given (`pruner.given_scores`)."""
    given = pruner.given_scores(views)
    if given is not None:
        return given
    cache = stage.stats_cache
    key = None if (cache is None or stage.session.active) else cache.key(pruner, stage.calibration_digest, views)
    if key is None:
        return _score_blocks(pruner, stage, views)
    hit = cache.get(key)
    if hit is not None:
        logger.info("%s: calibration pass reused (%d stored)", pruner.config.method, len(cache))
        return hit
    result = _score_blocks(pruner, stage, views)
    cache.put(key, result)
    return result


def _score_blocks(pruner, stage: Stage, views: list[LayerView]):
    sess = stage.session
    stats, scores, outliers = {}, {}, {}
    for v in views:
        cached = sess.cached_scores(v.index)
        if cached is not None:
            scores[v.index] = cached[:2]
            if cached[2] is not None:
                outliers[v.index] = cached[2]
    skip = pruner.config.skip_layers
    todo = [v.index for v in views if v.index not in scores and v.index not in skip]
    run = stage.runner() if (stage.runner is not None and pruner.requires_calibration and todo) else None
    keep = pruner.keep_stats() and pruner.refit_inputs == "dense"

    def visit(view: LayerView):
        i = view.index
        acc, outputs = observe_block(run, view, pruner.block_stats(view))
        with phase("decide", i):
            head, chan, outliers[i] = pruner.score_block(view, acc)
        if outliers[i] is None:
            del outliers[i]
        scores[i] = (head, chan)
        sess.save_scores(i, head, chan, outlier=outliers.get(i))
        if keep and sess.keep_stats(acc):
            stats[i] = {k: (a.to("cpu") if hasattr(a, "to") else a) for k, a in acc.items()}
        return outputs

    stage.walk(todo, visit, run=run, desc=f"{pruner.config.method}: scoring layers")
    return stats, scores, outliers


def structured_pass(pruner, stage: Stage) -> PruningPlan:
    """Score every block (one dense pass), allocate, then finish every block with its compensation (see the module
    docstring); returns the plan."""
    views = stage.views()
    stats, scores, outliers = score_pass(pruner, stage, views)
    info: dict[str, Any] = {}
    with phase("decide"):
        decided = pruner.decide(views, scores, outliers, attention_mlp_params(stage.model, stage.spec), info)
    sess = stage.session
    plan = PruningPlan(info=info)
    for v in views:
        lp = sess.restored_plan(v.index) if sess.done(v.index) else decided[v.index]
        if lp.structured:
            plan.layers[v.index] = lp
    if pruner.refit_inputs == "sequential":
        sequential_refit_pass(pruner, stage, plan)
        return plan
    todo = sorted(v.index for v in views if not sess.done(v.index))
    recompute = set()  # statistics not kept after the first pass (low-memory Grams, a resumed first pass)
    if pruner.keep_stats():
        recompute = {i for i in todo if decided[i].structured and i not in stats}
    run = stage.runner() if (stage.runner is not None and recompute) else None
    last = max(recompute, default=-1)

    def visit(view: LayerView):
        i, lp = view.index, decided[view.index]
        layer_stats, outputs = stats.pop(i, {}), None
        if run is not None and i <= last:
            if i in recompute:
                layer_stats, outputs = observe_block(run, view, pruner.block_stats(view, scoring=False))
            else:
                outputs = run.run_layer(i)
        if lp.structured:
            with phase("refit", i):
                pruner.finalize_layer(view, layer_stats, lp)
        sess.finish(i, lp)
        return outputs

    stage.walk(todo, visit, run=run, carry_until=last, desc=f"{pruner.config.method}: compensating")
    return plan
