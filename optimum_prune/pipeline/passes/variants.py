"""Score every variant → assemble under a target → refit: the pass kind of the serving-shape search
(`ServingConfig`).

1. **Score.** One pass over the dense model's blocks: each block runs once on the calibration hidden states while
   the accumulators of `pruner.block_stats(view)` observe their module inputs (`pruner.score_block` ranks the MLP
   channels); for each attention variant of `pruner.attention_variants(view)` (the zeroed form of a KV-head merge)
   a copy of the block carrying it runs on the same hidden states, and the pairs of dense / merged `o_proj` inputs
   feed `pruner.refit_stats`; for each plan of `pruner.probe_plans(view)` (a sublayer removed, zeroed form) the whole
   model runs on `pruner.probe_ids()` with the block carrying it, and its next-token KL divergence from the dense
   model's is measured. `pruner.variant_losses` turns all of it, with the energy of the block's outputs, into the
   loss of every variant.
2. **Assemble.** `pruner.decide_variants(...)` chooses one variant per block: `LayerPlan`s, no weight changed. It
   may measure candidate assemblies as a whole (`measure({key: [(view, plan), ...]})`: the whole model's KL
   divergence on the probe sequences with all those blocks carrying their plans at once).
3. **Refit.** The sequential refit pass (`passes.refit`), on the pruned network's inputs. Where
   `pruner.candidate_assemblies(...)` builds other assemblies, each is refitted too, every refitted assembly is
   measured as a whole on the probe sequences (its zeroed form with the refitted weights: the pruned model's
   outputs), and the one with the lowest KL divergence is kept (ties: the solve).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from ...modeling.architectures import LayerView, layer_view, weight_oi
from ...modeling.surgery import apply_layer_plan_
from ...plan import PruningPlan
from ...utils.phases import phase
from ..stage import Stage
from .observe import observe_block
from .refit import sequential_refit_pass

__all__ = ["variants_pass"]

logger = logging.getLogger(__name__)


def _energy(outputs) -> float:
    """`E‖h‖²` per token of a block's outputs (one tensor per calibration chunk)."""
    total, count = 0.0, 0
    for h in outputs:
        h = h.detach().double()
        total += float((h * h).sum())
        count += h.numel() // h.shape[-1]
    return total / max(count, 1)


def _merged_stats(pruner, run, config, view: LayerView, variants: dict) -> dict[Any, Any]:
    """Per variant: its `o_proj` inputs paired with the dense block's, fed to `pruner.refit_stats`."""
    out = {}
    path = view.spec.o_path
    dim = weight_oi(view.o_proj).shape[1]
    for key, lp in variants.items():
        layer = copy.deepcopy(view.layer)
        apply_layer_plan_(layer_view(layer, view.index, view.spec, config), lp, mode="zero")
        stats = pruner.refit_stats(dim)
        for x, xs in run.paired_inputs(view.index, path, view.layer, layer):
            stats.update(x, xs)
        out[key] = stats
        del layer
    return out


def _log_probs(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Next-token log-probabilities of every sequence of `ids` (one forward each, float32)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        return [torch.log_softmax(model(input_ids=row[None].to(device), use_cache=False).logits[0].float(), -1)
                for row in ids]  # fmt: skip


def _probe_kl(model, config, plans: dict, ids: torch.Tensor, dense: list[torch.Tensor]) -> dict:
    """Per key of `plans` (`{key: [(view, LayerPlan), ...]}`): the KL divergence (per token) of the whole model's
    next-token distribution from the dense one's with each of those blocks carrying its plan (zeroed form, with the
    weights and biases the plan writes), every block restored afterwards."""
    out = {}
    for key, pairs in plans.items():
        saved = [(view, {k: v.detach().clone() for k, v in view.layer.state_dict().items()},
                  [p for p in view.spec.linear_paths if getattr(view.module(p), "bias", None) is None])
                 for view, _ in pairs]  # fmt: skip
        try:
            for view, lp in pairs:
                apply_layer_plan_(layer_view(view.layer, view.index, view.spec, config), lp, mode="zero")
            total, count = 0.0, 0
            for logp_dense, logp in zip(dense, _log_probs(model, ids)):
                total += float((logp_dense.exp() * (logp_dense - logp)).sum())
                count += logp.shape[0]
            out[key] = max(total / max(count, 1), 0.0)
        finally:
            for view, state, unbiased in saved:
                for path in unbiased:  # a bias the plan added goes again
                    view.module(path).bias = None
                view.layer.load_state_dict(state)
    return out


def _measured_choice(pruner, stage: Stage, assemblies: dict, info: dict, ids, dense) -> PruningPlan:
    """Refit every assembly of `assemblies` (`{name: (plans, assembly record)}`, the solve first), measure each as a
    whole (`_probe_kl` of its refitted plans) and return the plan of the lowest (ties: the first); `info` records
    every measurement and takes the kept assembly's record."""
    measured, kept = {}, None
    for name, (plans, _) in assemblies.items():
        plan = PruningPlan(info=info)
        plan.layers = {i: copy.deepcopy(lp) for i, lp in plans.items() if lp.structured}
        if pruner.config.compensate:
            sequential_refit_pass(pruner, stage, plan, inputs=pruner.config.compensation_inputs)
        pairs = [(stage.view(i), lp) for i, lp in plan.layers.items()]
        measured[name] = _probe_kl(stage.model, stage.model.config, {name: pairs}, ids, dense)[name]
        logger.info("%s: candidate %r, KL divergence from the dense model on the probe sequences %.5g",
                    pruner.config.method, name, measured[name])  # fmt: skip
        if kept is None or measured[name] < measured[kept[0]]:
            kept = (name, plan)
    name, plan = kept
    info["candidates"] = {"probe_kl": measured, "chosen": name,
                          "assemblies": {n: record for n, (_, record) in assemblies.items()}}  # fmt: skip
    info["assembly"] = assemblies[name][1]
    return plan


def variants_pass(pruner, stage: Stage) -> PruningPlan:
    """See the module docstring; returns the plan (refitted)."""
    if getattr(pruner.config, "candidates", ()) and stage.session.active:
        raise ValueError(
            f"{type(pruner.config).__name__}(candidates={pruner.config.candidates!r}) refits every candidate "
            "assembly on the model in memory before keeping one, which a checkpointed run cannot record block by "
            "block: run without checkpoint_dir, or with candidates=(). Nothing was changed."
        )
    views = stage.views()
    run = stage.runner()
    scores: dict[int, tuple] = {}
    losses: dict[int, dict] = {}
    probe_ids = pruner.probe_ids()
    dense_logp = _log_probs(stage.model, probe_ids) if probe_ids is not None else None

    def visit(view: LayerView):
        i = view.index
        acc, outputs = observe_block(run, view, pruner.block_stats(view))
        with phase("decide", i):
            head, chan, _ = pruner.score_block(view, acc)
        scores[i] = (head, chan)
        merged = _merged_stats(pruner, run, stage.model.config, view, pruner.attention_variants(view))
        plans = {key: [(view, lp)] for key, lp in pruner.probe_plans(view).items()}
        probes = _probe_kl(stage.model, stage.model.config, plans, probe_ids, dense_logp) if plans else None
        with phase("decide", i), torch.no_grad():
            losses[i] = pruner.variant_losses(view, acc, chan, merged, _energy(outputs), probes)
        return outputs

    stage.walk(range(len(views)), visit, run=run, desc=f"{pruner.config.method}: scoring variants")
    info: dict[str, Any] = {}

    def measure(plans: dict) -> dict:
        return _probe_kl(stage.model, stage.model.config, plans, probe_ids, dense_logp)

    with phase("decide"):
        decided = pruner.decide_variants(stage.model, views, scores, losses, info,
                                         measure=measure if probe_ids is not None else None)  # fmt: skip
        others = pruner.candidate_assemblies(stage.model, views, scores, losses) if probe_ids is not None else {}
    others = {n: c for n, c in others.items() if c[1]["variants"] != info["assembly"]["variants"]}
    if others:
        return _measured_choice(pruner, stage, {"solve": (decided, info["assembly"]), **others}, info, probe_ids,
                                dense_logp)  # fmt: skip
    plan = PruningPlan(info=info)
    plan.layers = {i: lp for i, lp in decided.items() if lp.structured}
    if pruner.config.compensate:
        sequential_refit_pass(pruner, stage, plan, inputs=pruner.config.compensation_inputs)
    return plan
