"""The stage context and the block loop: what one pruning stage runs on, and the one loop every pass over the decoder
blocks runs.

The runner (`pipeline.runner`) opens a session and runs each stage's pass kind (`pipeline.passes`) on a `Stage`: the
model, its architecture entry, the calibration runner, the session and the cache of calibration passes. `Stage.walk`
runs every pass: it visits the blocks a pass works on, each resident at the version the stage
received, and carries the calibration hidden states through the blocks in between (finished by an earlier run, or
skipped), so that every pass of every method works the same with an in-memory, low-memory or resumed model.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from ..calibration.sequential import LayerwiseRunner
from ..modeling.architectures import ArchitectureSpec, LayerView, get_layers, layer_view
from .session import NullSession, PruneSession
from .stats_cache import CalibrationStatsCache

__all__ = ["RunnerFactory", "Stage"]

RunnerFactory = Callable[[], LayerwiseRunner]
Visit = Callable[[LayerView], "Sequence[torch.Tensor] | None"]


@dataclass
class Stage:
    """One pruning stage, as its pruner receives it.

    Args:
        model (`PreTrainedModel`): the model being pruned (possibly low-memory: its blocks on disk).
        spec (`ArchitectureSpec`): its architecture entry.
        runner (`Callable[[], LayerwiseRunner] | None`): builds a calibration runner positioned at block 0 (each call
            captures the block-0 inputs again); `None` without calibration data.
        session (`NullSession`): finished blocks, block residency and the run checkpoint (`pipeline.session`).
        stats_cache (`CalibrationStatsCache | None`): stored calibration passes of structured methods (`None`: off).
        calibration_digest (`str | None`): sha256 of the calibration inputs (part of a stats-cache key; `None`:
            none, or not a tensor).
    """

    model: nn.Module
    spec: ArchitectureSpec
    runner: RunnerFactory | None = None
    session: NullSession = field(default_factory=NullSession)
    stats_cache: CalibrationStatsCache | None = None
    calibration_digest: str | None = None

    def layers(self) -> nn.ModuleList:
        return get_layers(self.model, self.spec)

    def view(self, i: int) -> LayerView:
        """The current geometry of block `i`."""
        return layer_view(self.layers()[i], i, self.spec, self.model.config)

    def views(self) -> list[LayerView]:
        return [self.view(i) for i in range(len(self.layers()))]

    def blocks(self) -> Iterator[tuple[int, nn.Module]]:
        """`(index, block)` of every decoder block, each in memory while it is yielded (low-memory models too)."""
        sess = self.session
        if isinstance(sess, PruneSession) and sess.model is self.model:
            yield from sess.blocks()
        else:
            yield from enumerate(self.layers())

    def walk(
        self,
        visited: Collection[int],
        visit: Visit,
        *,
        run: LayerwiseRunner | None = None,
        carry_until: int | None = None,
        carry_version: str = "input",
        carry: Callable[[int], None] | None = None,
        desc: str | None = None,
    ) -> None:
        """One pass over the decoder blocks: `visit(view)` on each block of `visited`, in order, with the block resident
        at the version this stage received.

        `visit` returns the block's outputs (they become `run`'s hidden states, the next block's inputs) or `None`.
        Past the blocks not visited, up to block `carry_until` (default: the last visited one), `run`'s hidden states
        are carried by the blocks' recorded version (`carry_version`: `"input"`, as this stage received them, or
        `"current"`, as it left them); `carry(i)` replaces that for a pass that carries streams of its own.
        """
        sess = self.session
        last = max(visited, default=-1) if carry_until is None else carry_until
        layers = self.layers()
        indices = range(len(layers)) if desc is None else tqdm(range(len(layers)), desc=desc, leave=False)
        for i in indices:
            if i not in visited:
                if carry is not None:
                    carry(i)
                elif run is not None and i < last:
                    run.advance(sess.forward(run, i, carry_version))
                continue
            with sess.resident(i, "input"):
                outputs = visit(layer_view(layers[i], i, self.spec, self.model.config))
            if outputs is not None and run is not None:
                run.advance(outputs)
