"""Sequential prune: the pass kind of the unstructured / N:M methods (Wanda, SparseGPT, RIA, magnitude, FISTA, AMP,
SPP + RIA), one or several configs of a recipe at once.

On each decoder block, in order, every pruner's `prune_layer(run, view, dense)` writes the new weights
of its own targets (in list order); then the block runs again and its outputs feed the next block: the pruned
outputs, or the dense ones when every pruner asks for them (`dense_inter_layer`, FISTA's default). The pass also
hands each pruner what it asks for by its flags: an unpruned copy of the block (`needs_dense_layer`) and the dense
model's hidden states at the block's input (`needs_dense_stream`: AMP's refit against the dense model), carried
through the blocks an earlier, interrupted run finished as well. If anything fails, every weight written so far is
restored before the error propagates.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence

import torch
from torch import nn

from ...modeling.architectures import LayerView
from ...plan import LayerPlan, PruningPlan
from ...utils.phases import phase
from ..stage import Stage

__all__ = ["DenseStream", "layerwise_pass"]


class DenseStream:
    """The dense model's hidden states at the input of the next block to visit, carried from the embeddings: through
    each visited block's dense copy (its outputs handed back by `advance`) and through the blocks an earlier run
    finished, in the version this stage received (the session keeps it)."""

    def __init__(self, run, session) -> None:
        self.run, self.session = run, session
        self.index, self.hidden = 0, None

    def inputs(self, i: int):
        hidden = self.hidden
        if hidden is None:
            hidden = self.run.hidden if i == 0 else self.run.embeddings()
        for k in range(self.index, i):
            hidden = self.session.forward(self.run, k, "input", inputs=hidden)
        return hidden

    def advance(self, i: int, outputs) -> None:
        self.index, self.hidden = i + 1, outputs


def layerwise_pass(pruners: Sequence, stage: Stage) -> PruningPlan:
    """One layer-by-layer calibration pass in which every pruner prunes its targets of each block, in list order (see
    the module docstring). `plan.layers[i].info` holds each pruner's per-layer entries (keyed by its position when
    there are several); `plan.info["seconds"]` the time each pruner spent."""
    sess = stage.session
    needs_data = any(p.requires_calibration for p in pruners)
    todo = [i for i in range(len(stage.layers())) if not sess.done(i)]
    run = stage.runner() if (stage.runner is not None and needs_data and todo) else None
    for p in pruners:
        p.begin(stage.model, stage.spec)
    dense_next = all(p.dense_inter_layer for p in pruners)
    want_copy = dense_next or any(p.needs_dense_layer for p in pruners)
    stream = DenseStream(run, sess) if run is not None and any(p.needs_dense_stream for p in pruners) else None
    seconds = [0.0] * len(pruners)
    plan = PruningPlan()
    for i in range(len(stage.layers())):
        if sess.done(i):  # finished by an earlier run: only its outputs are needed
            plan.layers[i] = sess.restored_plan(i)
    backup: list[tuple[nn.Module, torch.Tensor]] = []  # original weights of what was written, to undo a failure

    def visit(view: LayerView):
        paths = {t.path for p in pruners for t in p.targets}
        if not sess.streaming:  # a low-memory block is written elsewhere: its source needs no undo
            backup.extend((view.module(path), view.module(path).weight.detach().clone()) for path in sorted(paths))
        dense = copy.deepcopy(view.layer) if (want_copy and run is not None) else None
        dense_inputs = stream.inputs(view.index) if stream is not None else None
        info: dict = {}
        for k, p in enumerate(pruners):
            t0 = time.perf_counter()
            with phase("decide", view.index):
                if p.needs_dense_stream:
                    entry = p.prune_layer(run, view, dense, dense_inputs)
                else:
                    entry = p.prune_layer(run, view, dense)
            seconds[k] += time.perf_counter() - t0
            if len(pruners) == 1:
                info = entry
            elif entry:
                info[str(k)] = entry
        plan.layers[view.index] = LayerPlan(info=info)
        if stream is not None:
            carried = [o for p in pruners if p.needs_dense_stream and (o := p.take_dense_stream_outputs()) is not None]
            stream.advance(view.index, carried[0])
        kept = [o for p in pruners if (o := p.take_dense_outputs()) is not None]
        outputs = None
        if run is not None:  # the outputs feed the next layer
            if dense_next and kept:  # a pruner already ran the dense copy over every chunk
                outputs = kept[0]
            else:
                outputs = run.run_layer(view.index, layer=dense if dense_next else None)
        del dense
        sess.finish(view.index, info=info)
        return outputs

    desc = "+".join(p.config.method for p in pruners)
    try:
        stage.walk(todo, visit, run=run, carry_version="input" if dense_next else "current", desc=f"{desc}: layers")
    except BaseException:
        with torch.no_grad():
            for module, weight in backup:
                module.weight.copy_(weight)
        raise
    plan.layers = dict(sorted(plan.layers.items()))
    plan.info["seconds"] = seconds
    for k, p in enumerate(pruners):
        extra = p.pass_info()
        if extra and len(pruners) == 1:
            plan.info.update(extra)
        elif extra:
            plan.info.setdefault("pruners", {})[str(k)] = extra
    return plan
