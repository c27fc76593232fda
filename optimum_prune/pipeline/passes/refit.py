"""Refit passes: a method decided which units go; these passes gather what its closed-form refit of the remaining
weights needs and hand it over, block by block.

- `sequential_refit_pass` (NP's `compensation_inputs="sequential"`): each block is refitted on the inputs of the
  network pruned so far: two streams of hidden states are carried (the dense model's, the pruned one's), the
  block's removal is applied as zeros, and for each projection to refit (attention first, so the MLP's refit sees the
  refitted attention) the pairs of dense / pruned inputs feed `pruner.refit_stats`, from which
  `pruner.refit_projection` gives the new weight (weights the decision wrote, e.g. merged keys / values, stay). The model is restored after each block (deciding changes nothing:
  the runner applies the plan).
- `dense_refit_pass` (SPP's compensation): one pass over the dense model; each block's accumulators
  (`pruner.refit_block_stats`) observe the inputs of the projections to refit, and `pruner.refit_layer` writes the
  new weights into the block's plan.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ...modeling.access import plus_bias
from ...modeling.architectures import LayerView, weight_oi
from ...modeling.surgery import apply_layer_plan_
from ...plan import LayerPlan, PruningPlan
from ...utils.phases import phase
from ..stage import Stage
from .observe import observe_block

__all__ = ["dense_refit_pass", "sequential_refit_pass"]


def sequential_refit_pass(pruner, stage: Stage, plan: PruningPlan, *, inputs: str = "sequential") -> None:
    """See the module docstring; a low-memory or checkpointed run finishes each block here. `inputs="dense"` starts
    every block from the dense network's inputs instead (the refit then sees only its own block's removals, as NP's
    dense refit does: for a block whose attention is whole, exactly that refit)."""
    if inputs not in ("sequential", "dense"):
        raise ValueError(f"inputs must be 'sequential' or 'dense', got {inputs!r}")
    run, sess = stage.runner(), stage.session
    streams = [run.hidden, run.hidden]  # the dense and the pruned network's inputs of the next block

    dense = inputs == "dense"  # the pruned stream is then never carried: every block starts from the dense one

    def carry(i: int) -> None:  # finished by an earlier run: both streams through its recorded versions
        streams[:] = (sess.forward(run, i, "input", streams[0]),
                      None if dense else sess.forward(run, i, "current", streams[1]))  # fmt: skip

    def visit(view: LayerView) -> None:
        i = view.index
        streams[:] = _refit_block(pruner, run, view, plan.layers.get(i), streams[0],
                                  streams[0] if dense else streams[1], carry_pruned=not dense)  # fmt: skip
        sess.finish(i, plan.layers.get(i) or LayerPlan())

    todo = [i for i in range(len(stage.layers())) if not sess.done(i)]
    stage.walk(todo, visit, carry=carry, desc=f"{pruner.config.method}: sequential refit")


def _refit_block(pruner, run, view: LayerView, lp: LayerPlan | None, dense_h, pruned_h, *, carry_pruned=True):
    """One block of `sequential_refit_pass`: its plan gets the refitted weights; returns the next inputs (the pruned
    stream's `None` without `carry_pruned`)."""
    i, layer = view.index, view.layer
    dense = copy.deepcopy(layer)
    if lp is not None:
        removal = LayerPlan(
            keep_heads=lp.keep_heads,
            keep_kv_heads=lp.keep_kv_heads,
            merge_kv=lp.merge_kv,
            keep_channels=lp.keep_channels,
            weights=dict(lp.weights),
        )  # (e.g. merged keys / values)
        apply_layer_plan_(view, removal, mode="zero")
        for path, keep in pruner.refit_targets(view, lp):
            W = weight_oi(dense.get_submodule(path)).detach()  # (d_out, D) dense weight
            stats = pruner.refit_stats(W.shape[1])
            for x, xs in run.paired_inputs(i, path, dense, layer, dense_h, pruned_h):
                stats.update(x, xs)
            with phase("refit", i):
                W_new, b = pruner.refit_projection(view, path, W, stats, keep.to(W.device))
            lp.weights[path] = W_new
            mod = layer.get_submodule(path)
            with torch.no_grad():
                weight_oi(mod).copy_(W_new)
                if b is not None:
                    lp.biases[path] = plus_bias(b, dense.get_submodule(path))
                    if getattr(mod, "bias", None) is None:
                        mod.bias = nn.Parameter(torch.zeros_like(b))
                    mod.bias.copy_(lp.biases[path])
    dense_h = run.run_layer(i, inputs=dense_h, layer=dense)
    pruned_h = run.run_layer(i, inputs=pruned_h) if carry_pruned else None
    for path in view.spec.linear_paths:  # deciding changes nothing: the runner applies the plan
        if getattr(dense.get_submodule(path), "bias", None) is None:
            layer.get_submodule(path).bias = None
    layer.load_state_dict(dense.state_dict())
    return dense_h, pruned_h


def dense_refit_pass(pruner, stage: Stage, plan: PruningPlan) -> dict:
    """See the module docstring: every block visited in order; returns the entries `pruner.refit_layer` reported,
    merged (e.g. the residuals)."""
    run, entries = stage.runner(), {}

    def visit(view: LayerView):
        lp = plan.layers.get(view.index)
        stats, outputs = observe_block(run, view, pruner.refit_block_stats(view, lp))
        with phase("refit", view.index):
            entries.update(pruner.refit_layer(view, stats, lp) or {})
        return outputs

    stage.walk(range(len(stage.layers())), visit, run=run, desc=f"{pruner.config.method}: compensation")
    return entries
