"""`PruningReport`: what was asked, what was measured; and the measurements it is made of (parameter counts, zeros).

The measurements that read weights take the model's decoder blocks as an iterable of `(index, block)`, each in memory
while it is yielded: a low-memory model's blocks come from disk one at a time (`Stage.blocks()`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import transformers
from torch import nn

from .constants import HISTORY_ATTR
from .modeling.access import read_target
from .modeling.architectures import ArchitectureSpec, Target, get_layers, layer_view, present_linear_paths, weight_oi
from .utils.phases import phased
from .version import __version__

__all__ = [
    "PruningReport",
    "count_parameters",
    "linear_sparsity",
    "target_sparsity",
    "zero_fraction",
    "zero_or_removed",
    "record_history",
]

Blocks = Iterable[tuple[int, nn.Module]]


def count_parameters(model: nn.Module) -> int:
    """Parameters of the model, tied weights counted once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@phased("measure")
def target_sparsity(model: nn.Module, spec: ArchitectureSpec, targets: Sequence[Target], blocks: Blocks) -> dict:
    """`layers.<i>.<key>` → (fraction of zeros, numel) of every target of every block."""
    out = {}
    for i, layer in blocks:
        view = layer_view(layer, i, spec, model.config)
        for t in targets:  # no local keeps a weight: a low-memory block is released when the loop moves on
            out[f"layers.{i}.{t.key}"] = _zeros(read_target(view, t))
    return out


def _zeros(w: torch.Tensor) -> tuple[float, int]:
    return float((w == 0).sum()) / max(w.numel(), 1), w.numel()


def zero_or_removed(spec: ArchitectureSpec, prunable_before: int, blocks: Blocks) -> float:
    """Fraction of the original attention + MLP parameters that are now removed or exactly zero."""
    nonzero = 0
    for _, layer in blocks:
        for path in present_linear_paths(layer, spec):
            nonzero += sum(int((p != 0).sum()) for p in layer.get_submodule(path).parameters(recurse=False))
    return 1 - nonzero / max(prunable_before, 1)


@phased("measure")
def zero_fraction(
    model: nn.Module,
    spec: ArchitectureSpec,
    params: int,
    blocks: Blocks,
    value_chunks: Callable[[str, torch.Tensor], Iterable[torch.Tensor]] | None = None,
) -> float:
    """Exact zeros among all parameters (tied weights once), relative to `params`; the tensors outside the blocks
    are read as `value_chunks(name, tensor)` gives them (a low-memory model's from their files, in chunks)."""
    in_blocks = {id(p) for layer in get_layers(model, spec) for p in layer.parameters()}
    unique = {id(p): (n, p) for n, p in model.named_parameters() if id(p) not in in_blocks}.values()
    zeros = 0
    for n, p in unique:
        zeros += sum(int((c == 0).sum()) for c in (value_chunks(n, p) if value_chunks is not None else [p]))
    for _, layer in blocks:
        zeros += sum(int((p == 0).sum()) for p in layer.parameters())
    return zeros / max(params, 1)


def linear_sparsity(model: nn.Module, spec: ArchitectureSpec) -> dict[str, float]:
    """Fraction of exact zeros in every prunable projection, keyed `layers.<i>.<path>`."""
    out = {}
    for i, layer in enumerate(get_layers(model, spec)):
        for p in present_linear_paths(layer, spec):
            w = weight_oi(layer.get_submodule(p))
            out[f"layers.{i}.{p}"] = float((w == 0).sum()) / max(w.numel(), 1)
    return out


@dataclass
class PruningReport:
    """Result of one `prune_` call.

    Args:
        method (`str`): registered method name.
        config (`dict`): the applied config.
        target (`float`): requested ratio (structured) or sparsity (unstructured).
        measured (`float`): measured fraction of attention + MLP parameters removed (structured) or zeroed.
        params_before / params_after (`int`): whole-model parameter counts.
        prunable_params_before / prunable_params_after (`int`): attention + MLP projection parameters.
        layers (`list[dict]`): per-layer shapes after pruning.
        sparsity (`dict[str, float]`): per-projection fraction of zeros (unstructured methods).
        timings (`dict[str, float]`): seconds spent in calibration capture, decision and surgery.
        calibration (`dict | None`): description of the calibration data.
        info (`dict`): method diagnostics.
        sections (`list[dict]`): for a recipe, one entry per config (method, config, target, measured, per-target
            sparsity, seconds, per-layer diagnostics); empty for a single config.
        artifacts (`dict`): objects the method made besides the pruned model, not serialised (SPP: its
            `"solution_path"`, a `SolutionPath`).
    """

    method: str
    config: dict
    target: float
    measured: float
    params_before: int
    params_after: int
    prunable_params_before: int
    prunable_params_after: int
    layers: list[dict] = field(default_factory=list)
    sparsity: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    calibration: dict | None = None
    info: dict = field(default_factory=dict)
    sections: list[dict] = field(default_factory=list)
    artifacts: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def whole_model_ratio(self) -> float:
        return 1 - self.params_after / max(self.params_before, 1)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(replace(self, artifacts={}))
        del out["artifacts"]
        out["whole_model_ratio"] = self.whole_model_ratio
        return out

    def to_json_file(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, default=str)
            f.write("\n")

    def __str__(self) -> str:
        seconds = self.timings.get("total_s")
        return (
            f"PruningReport(method={self.method!r}, target={self.target:.3f}, measured={self.measured:.3f}, "
            f"params {self.params_before:,} -> {self.params_after:,}"
            + (f", {seconds:.1f} s" if seconds is not None else "")
            + ")"
        )


def record_history(model: nn.Module, method: str, version: int, config: Any, calib_desc, report) -> None:
    """Append one entry to the history that `save_pruned_model` writes into `pruning_config.json`."""
    history = getattr(model, HISTORY_ATTR, [])
    history.append(
        {
            "method": method,
            "config_version": version,
            "config": config,
            "optimum_prune_version": __version__,
            "transformers_version": transformers.__version__,
            "calibration": calib_desc,
            "report": {
                k: v
                for k, v in report.to_dict().items()
                if k not in ("config", "layers", "sparsity", "info", "sections")
            },
        }
    )
    setattr(model, HISTORY_ATTR, history)
