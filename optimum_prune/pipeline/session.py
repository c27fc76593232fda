"""The prune session: how the passes over the decoder blocks find them, finish them, and resume.

Every pass visits the blocks through `Stage.walk` (`pipeline.stage`), which asks the stage's session:

    if sess.done(i):                              # finished by an earlier, interrupted run
        run.advance(sess.forward(run, i, "input"))
    else:
        with sess.resident(i, "input"):           # the block as this stage received it
            ... decide, prune ...
            sess.finish(i, plan, info)            # the block as this stage leaves it

Without a checkpoint directory, with the model in memory, the session is a `NullSession`: every call is a no-op and
the passes run exactly as without this module. With a low-memory model (`streaming.load_low_memory`), `resident`
loads the block from disk and puts it back afterwards, and `finish` applies a structured decision to the block at once
and writes it out. With a `checkpoint_dir` (`checkpoint.RunCheckpoint`), `finish` records the block atomically, and a
rerun skips the blocks recorded there: `done(i)` is true and `forward` reproduces the block's outputs from its
recorded version, so the rest of the run sees exactly what the first run saw.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Iterator

import torch
from torch import nn

from ..calibration.offload import ActivationBudget, parse_bytes
from ..modeling.architectures import ArchitectureSpec, get_layers, layer_view
from ..modeling.shapes import layer_row
from ..modeling.surgery import apply_layer_plan_, apply_plan_
from ..plan import LayerPlan, PruningPlan
from ..storage.memory import available_memory, check_device, check_memory
from ..storage.streaming import get_store, layer_prefix, load_block_, write_safetensors
from ..storage.tensorfile import FileTensor, tensor_chunks
from ..utils.distributed import broadcast_object, world_size
from ..utils.phases import phased
from .checkpoint import RunCheckpoint, run_fingerprint
from .progress import BlockProgress

__all__ = ["NullSession", "PruneSession", "open_session"]

logger = logging.getLogger(__name__)


class NullSession:
    """No checkpoint, model in memory: nothing to do (the loops' behaviour without sessions)."""

    active = False
    streaming = False
    stage_index = 0

    def __init__(self, activations: ActivationBudget | None = None) -> None:
        self.activations = activations

    def stage(self, k: int):
        return contextlib.nullcontext(self)

    def completed_plan(self) -> PruningPlan | None:
        return None

    def mark_complete(self, k: int, plan: PruningPlan) -> None:
        return None

    def summary(self) -> dict:
        a = self.activations
        return {"activations": a.summary()} if a is not None and a.spilled_chunks else {}

    def done(self, i: int) -> bool:
        return False

    def resident(self, i: int, which: str = "current"):
        return contextlib.nullcontext()

    def forward(self, run, i: int, which: str = "current", inputs=None):
        return run.run_layer(i, inputs=inputs)

    def finish(self, i: int, plan: LayerPlan | None = None, info: dict | None = None) -> None:
        return None

    def apply(self, model: nn.Module, spec: ArchitectureSpec, plan: PruningPlan) -> None:
        """Execute a stage's plan on the model: every block decision not executed yet (a low-memory or checkpointed
        run executes each block's in `finish`, as soon as it is decided; a resumed one restores it). The one place
        the pipeline applies plans."""
        apply_plan_(model, spec, plan)

    def cached_scores(self, i: int) -> tuple | None:
        return None

    def save_scores(
        self, i: int, head: torch.Tensor | None, chan: torch.Tensor | None, outlier: float | None = None
    ) -> None:
        return None

    def restored_plan(self, i: int) -> LayerPlan:
        raise KeyError(i)

    def keep_stats(self, stats: dict) -> bool:
        return True

    def value_chunks(self, name: str, tensor: torch.Tensor) -> Iterator[torch.Tensor]:
        """The values of tensor `name` (outside the blocks), flat, a bounded number of bytes at a time."""
        return tensor_chunks(tensor)


class PruneSession(NullSession):
    """See the module docstring.

    Args:
        model (`PreTrainedModel`): the model being pruned (possibly low-memory).
        spec (`ArchitectureSpec`): its architecture entry.
        checkpoint (`RunCheckpoint | None`): where finished blocks are recorded.
        activations (`ActivationBudget | None`): in-memory budget of the calibration activations.
    """

    active = True

    def __init__(
        self,
        model: nn.Module,
        spec: ArchitectureSpec,
        checkpoint: RunCheckpoint | None = None,
        activations: ActivationBudget | None = None,
    ) -> None:
        super().__init__(activations)
        self.model, self.spec, self.checkpoint = model, spec, checkpoint
        self.store = get_store(model)
        self.streaming = self.store is not None
        self.num_layers = len(get_layers(model, spec))
        self.stage_index = -1
        # low-memory: versions of the blocks are numbered across `prune_` calls on the same model (a second call
        # starts from the blocks the first one wrote); the checkpoint numbers the stages of this call
        self._base = 1 + max((max(v) for v in self.store.versions), default=-1) if self.streaming else 0
        self.records: dict[int, dict] = {}
        self._pending: set[int] = set()  # in memory: finished blocks restored from the checkpoint at the stage's end
        self.progress = BlockProgress(self.num_layers)

    # ------------------------------------------------------------------------------------------------- stages
    @contextlib.contextmanager
    def stage(self, k: int) -> Iterator[PruneSession]:
        """One pruning stage (one config of a recipe): its finished blocks are read from the checkpoint; on success,
        in memory, they are restored into the model at the end; on failure, a low-memory model's blocks go back to
        their version before the stage (the checkpoint keeps what was finished, for a rerun)."""
        self.stage_index, self.version = k, self._base + k
        records = self.checkpoint.finished(k, self.num_layers) if self.checkpoint is not None else {}
        self.records = broadcast_object(records)
        changed = {i for i, rec in self.records.items() if rec.get("bytes") is not None}
        if self.streaming:
            for i in changed:
                self.store.record(i, self.version, self.checkpoint.block_file(k, i), self.records[i]["shapes"])
        else:
            self._pending = changed
        if self.records:
            logger.info("stage %d: %d of %d blocks already finished in %s", k, len(self.records), self.num_layers,
                        self.checkpoint.directory)  # fmt: skip
        try:
            yield self
        except BaseException:
            if self.streaming:
                self.store.forget(self.version)
            raise
        for i in sorted(self._pending):
            self._restore(get_layers(self.model, self.spec)[i], i)
        self._pending = set()

    def completed_plan(self) -> PruningPlan | None:
        """The plan of the current stage when an earlier run finished it entirely (its blocks are in the checkpoint)."""
        if self.checkpoint is None or len(self.records) < self.num_layers:
            return None
        done = broadcast_object(self.checkpoint.complete(self.stage_index))
        if done is None:
            return None
        plan = PruningPlan(info=done.get("info") or {})
        for i in range(self.num_layers):
            lp = self.restored_plan(i)
            if lp.structured or lp.info:
                plan.layers[i] = lp
        logger.info("stage %d was finished by an earlier run: restored from %s", self.stage_index,
                    self.checkpoint.directory)  # fmt: skip
        return plan

    def mark_complete(self, k: int, plan: PruningPlan) -> None:
        if self.checkpoint is not None:
            self.checkpoint.mark_complete(k, {"info": plan.info})

    def summary(self) -> dict:
        out = super().summary()
        if self.streaming:
            out["low_memory"] = True
            out["block_io"] = dict(self.store.io)
        if self.checkpoint is not None:
            out["checkpoint_dir"] = str(self.checkpoint.directory)
        if self.progress.records:
            out["progress"] = self.progress.summary()
        return out

    # ------------------------------------------------------------------------------------------------- blocks
    def done(self, i: int) -> bool:
        return i in self.records

    def restored_plan(self, i: int) -> LayerPlan:
        """The structured decision recorded for finished block `i` (already applied: the block file holds it)."""
        rec = self.records[i]
        return LayerPlan(info=rec.get("info") or {}, applied=True, **(rec.get("plan") or {}))

    @contextlib.contextmanager
    def resident(self, i: int, which: str = "current") -> Iterator[None]:
        """Block `i` in memory for the duration: `"input"` = as this stage received it, `"current"` = its latest
        version. In memory the block is always there (and is the input version until the stage ends)."""
        self.progress.start(i)
        try:
            if not self.streaming:
                yield
                return
            self.store.load(i, self.version - 1 if which == "input" else self.version)
            try:
                yield
            finally:
                self.store.offload(i)
        finally:
            self.progress.stop(i)

    def forward(self, run, i: int, which: str = "current", inputs=None):
        """Outputs of block `i` (`which` version) on `inputs` (default: the runner's current hidden states)."""
        if not self.streaming and which == "current" and i in self._pending:
            layer = copy.deepcopy(get_layers(self.model, self.spec)[i])
            self._restore(layer, i)
            return run.run_layer(i, inputs=inputs, layer=layer)
        with self.resident(i, which):
            return run.run_layer(i, inputs=inputs)

    def _restore(self, layer: nn.Module, i: int) -> None:
        device = next(layer.parameters()).device
        path = self.checkpoint.block_file(self.stage_index, i)
        load_block_(layer, i, self.spec, self.model.config, path, self.records[i]["shapes"], device)

    @phased("write block", block_arg=1)
    def finish(self, i: int, plan: LayerPlan | None = None, info: dict | None = None) -> None:
        """Block `i` is final for this stage: with a structured `plan`, apply it (low-memory: to the resident block,
        whose plan tensors are then dropped; in memory: to a copy, the model itself is changed by `prune_` as
        without a session); record the block in the checkpoint and, low-memory, as the block's new version."""
        layer = get_layers(self.model, self.spec)[i]
        changes = plan is not None and (plan.structured or plan.weights or plan.biases)
        if changes:
            if not self.streaming:
                if self.checkpoint is None:
                    return
                layer = copy.deepcopy(layer)
            apply_layer_plan_(layer_view(layer, i, self.spec, self.model.config), plan, mode="remove")
            if self.streaming:
                plan.weights, plan.biases, plan.applied = {}, {}, True
        modified = changes or plan is None  # an unstructured block is changed in place
        shapes = layer_row(layer, i, self.spec, self.model.config)
        tensors = None
        if modified:
            prefix = layer_prefix(self.spec, i)
            tensors = {prefix + n: t for n, t in layer.state_dict().items()}
        path = None
        if self.checkpoint is not None:
            record = {"shapes": shapes, "info": info if info is not None else (plan.info if plan else {})}
            if plan is not None:
                record["plan"] = {k: getattr(plan, k) for k in ("keep_heads", "keep_kv_heads", "keep_channels")}
                if plan.merge_kv:
                    record["plan"]["merge_kv"] = plan.merge_kv
                record["plan"].update({k: v for k, v in plan.expert_decision.items() if v is not None})
            path = self.checkpoint.write_block(self.stage_index, i, tensors, record)
            if not self.checkpoint.writer:
                path = None
        if self.streaming and tensors is not None:
            if path is None:
                path = self.store.work_dir() / f"version{self.version}_block{i:05d}.safetensors"
                write_safetensors(tensors, path)
            self.store.record(i, self.version, path, shapes)
            self.store.io["bytes_written"] += sum(t.numel() * t.element_size() for t in tensors.values())

    # ------------------------------------------------------------------------------------- structured stages
    def cached_scores(self, i: int) -> tuple | None:
        """`(head_scores, channel_scores, outlier_fraction)` of block `i` recorded by an earlier run of this stage's
        first pass (the outlier fraction: OWL allocation only, else `None`)."""
        if self.checkpoint is None:
            return None
        t = broadcast_object(self.checkpoint.read_scores(self.stage_index, i))
        if t is None:
            return None
        return t.get("head"), t.get("chan"), (float(t["owl"]) if "owl" in t else None)

    def save_scores(
        self, i: int, head: torch.Tensor | None, chan: torch.Tensor | None, outlier: float | None = None
    ) -> None:
        if self.checkpoint is not None:
            owl = None if outlier is None else torch.tensor(outlier, dtype=torch.float64)
            t = {k: v for k, v in (("head", head), ("chan", chan), ("owl", owl)) if v is not None}
            self.checkpoint.write_scores(self.stage_index, i, t)

    def keep_stats(self, stats: dict) -> bool:
        """Whether a structured method keeps a block's statistics between its two passes: low-memory, only per-channel
        vectors (what the ranking needs); matrices (Grams) are computed again in the second pass."""
        return not self.streaming or all(
            getattr(acc, name).dim() <= 1 for acc in stats.values() for name in getattr(acc, "_fields", ("?",))
        )

    def blocks(self) -> Iterator[tuple[int, nn.Module]]:
        """Every decoder block in turn, resident at its latest version (for measurements after a stage)."""
        for i, layer in enumerate(get_layers(self.model, self.spec)):
            with self.resident(i):
                yield i, layer

    def value_chunks(self, name: str, tensor: torch.Tensor) -> Iterator[torch.Tensor]:
        """As `NullSession.value_chunks`; a low-memory model's tensors still as in the source (kept on disk, or
        memory-mapped: a whole read would make every page resident) are read from their file."""
        value = self.store.nonblock_value(name, tensor) if self.streaming else tensor
        return value.chunks() if isinstance(value, FileTensor) else tensor_chunks(value)


@contextlib.contextmanager
def open_session(
    model: nn.Module,
    spec: ArchitectureSpec,
    *,
    configs: list = (),
    ids: torch.Tensor | None = None,
    batch_size: int = 8,
    device: torch.device | str | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    activation_memory: int | str | None = None,
) -> Iterator[NullSession]:
    """What a `prune_` call needs around its stages: the activation budget, the checkpoint, and the session (a plain
    `NullSession` when neither low-memory nor checkpointing: nothing changes), handed to every stage. The model runs in
    eval mode without gradients inside; its training flag is restored on exit, error or not."""
    device = check_device(device)
    store = get_store(model)
    limit = parse_bytes(activation_memory)
    if store is not None:
        store.device = device if device is not None else torch.device("cpu")
        spare = check_memory(model, spec, ids is not None, store.device)
        if limit is None and spare is not None and ids is not None:
            limit = max(spare // 2, 0)
    elif limit is None and ids is not None:  # in memory: spill rather than exhaust what the model left free
        free = available_memory()
        limit = None if free is None else free // 2
    activations = None
    if ids is not None and limit is not None:
        where = checkpoint_dir if checkpoint_dir is not None else (store.work_parent if store is not None else None)
        activations = ActivationBudget(limit, where)
        per_copy = ids.numel() // world_size() * model.config.hidden_size * (torch.finfo(model.dtype).bits // 8)
        logger.info("calibration activations: %.2f GB per copy between blocks; in-memory budget %.2f GB%s",
                    per_copy / 1e9, limit / 1e9, " (the rest goes to disk)" if 2 * per_copy > limit else "")  # fmt: skip
    checkpoint = None
    if checkpoint_dir is not None:
        checkpoint = RunCheckpoint(checkpoint_dir, run_fingerprint(model, spec, configs, ids, batch_size, device))
    if checkpoint is None and store is None:
        sess: NullSession = NullSession(activations)
    else:
        sess = PruneSession(model, spec, checkpoint, activations)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield sess
    finally:
        model.train(was_training)
        if activations is not None:
            if activations.spilled_chunks:
                logger.warning("calibration activations: %.2f GB were written to disk in %d chunks",
                               activations.spilled_bytes / 1e9, activations.spilled_chunks)  # fmt: skip
            activations.cleanup()
