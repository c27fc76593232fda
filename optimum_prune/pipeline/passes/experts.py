"""Score → allocate → apply for the experts of mixture-of-experts layers (`ExpertConfig`).

1. **Score** (`pruner.scores_experts`): each MoE block runs on the calibration hidden states while `pruner.observe`
   records its routing, and `pruner.saliency` ranks its experts. With a global allocation (`pruner.allocates_globally`)
   every block is scored in a first pass and `pruner.global_keep` picks the experts kept in all of them at once;
   otherwise each block is scored in the apply pass and `pruner.layer_keep` decides it alone.
2. **Apply**: each block's plan (the experts kept and, where `pruner.prunes_channels`, the channels inside them,
   `pruner.channels`, which runs the block again with its experts removed), finished by the session.
A resumed run reads the scores and plans of the blocks an earlier run finished from the checkpoint.
"""

from __future__ import annotations

import torch

from ...modeling.architectures import LayerView
from ...plan import LayerPlan, PruningPlan
from ...utils.phases import phase
from ..stage import Stage

__all__ = ["experts_pass"]


def experts_pass(pruner, stage: Stage) -> PruningPlan:
    sess = stage.session
    views = pruner.moe_views(stage.model, stage.spec)
    data = stage.runner is not None and pruner.requires_calibration
    saliency: dict[int, torch.Tensor] = {}
    keep: dict[int, list[int]] = {}

    def score(view: LayerView, run) -> torch.Tensor | None:
        """Rank the experts of `view`; returns the block's outputs when it ran."""
        cached = sess.cached_scores(view.index)
        stats = outputs = None
        if cached is not None:
            saliency[view.index] = cached[1]
            return None
        if run is not None and pruner.observes_routing:
            stats, outputs = pruner.observe(run, view)
        with phase("decide", view.index):
            saliency[view.index] = pruner.saliency(view, stats)
        sess.save_scores(view.index, None, saliency[view.index])
        return outputs

    if pruner.allocates_globally:
        run = stage.runner() if data and pruner.observes_routing else None

        def visit(view: LayerView):  # a block scored by an earlier (resumed) run still feeds the next one
            out = score(view, run)
            return out if out is not None or run is None else run.run_layer(view.index)

        stage.walk([v.index for v in views], visit, run=run, desc="experts: scoring")
        keep = pruner.global_keep(views, saliency)
    plan = PruningPlan(info=pruner.plan_info())
    todo = [v.index for v in views if not sess.done(v.index)]
    scoring = pruner.scores_experts and not keep and pruner.observes_routing
    run = stage.runner() if data and todo and (scoring or pruner.prunes_channels) else None

    def finish(view: LayerView):
        lp, outputs = LayerPlan(), None
        if pruner.scores_experts:
            if view.index not in keep:
                outputs = score(view, run)
                keep[view.index] = pruner.layer_keep(view, saliency[view.index])
            if len(keep[view.index]) < view.num_experts:
                lp.keep_experts = keep[view.index]
            lp.info["expert_saliency"] = [float(s) for s in saliency[view.index]]
        if pruner.prunes_channels:
            with phase("decide", view.index):
                pruner.channels(run, view, lp, stage.model.config)
        if outputs is None and run is not None and view.index < todo[-1]:
            outputs = run.run_layer(view.index)
        sess.finish(view.index, lp)
        if lp.structured:
            plan.layers[view.index] = lp
        return outputs

    stage.walk(todo, finish, run=run, desc="experts: pruning")
    for i in (v.index for v in views if v.index not in todo):
        lp = sess.restored_plan(i)
        if lp.structured:
            plan.layers[i] = lp
    return plan
