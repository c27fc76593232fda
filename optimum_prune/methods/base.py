"""`BasePruner`: the contract every method implements.

A method decides; the pipeline (`optimum_prune.pipeline`) drives. Lifecycle:
  1. `resolve_config(model, spec)`: the config as it runs (defaults that depend on the model resolved; the pipeline freezes
     it), then `validate(model, spec)`: reject what cannot work, before any weight changes.
  2. The pipeline runs the pass kind the pruner names (`pass_kind`, `pipeline.passes`): it walks the blocks (in
     memory, streamed from disk, or resumed from a checkpoint), feeds the calibration data through them, and calls
     the pruner's hooks for each block: the hooks observe, score, decide and compute new weights; they never walk
     blocks, finish them or touch the session. Methods import nothing from the pipeline.
  3. The pipeline applies the plan (`modeling.surgery`), measures and reports.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from ..config import PruningConfig
from ..modeling.architectures import ArchitectureSpec, get_layers, layer_view, present_linear_paths, weight_oi

__all__ = ["BasePruner", "refuse_pruned_head_dims"]


def refuse_pruned_head_dims(model: nn.Module, spec: ArchitectureSpec, what: str) -> None:
    """Raise, before anything changes, if a layer's q/k or v/o head dimensions were pruned (by SPP): `what` (e.g.
    "removing attention heads") assumes heads of the original width."""

    for i, layer in enumerate(get_layers(model, spec)):
        if layer_view(layer, i, spec, model.config).pair_shaped:
            raise ValueError(
                f"Layer {i} has pruned q/k or v/o head dimensions (SPP), and {what} needs heads of the original width. "
                "Run it before SPP, or leave the attention to SPP (e.g. prune_attention=False, or targets without "
                "the attention projections). Nothing was changed."
            )


class BasePruner:
    """Base class of the pruners.

    Capability flags (read by the pipeline, never method names; a pruner whose flag depends on its config
    overrides it with a property):
        requires_calibration (`bool`): needs calibration data.
        structured (`bool`): removes heads / channels (the pipeline then changes shapes).
        pass_kind (`str`): the pass kind whose hooks the pruner implements (`pipeline.passes`: `"structured"`,
            `"experts"`, `"layerwise"`, `"whole_model"`).
        low_memory_refusal (`str | None`): why the method cannot run on a model loaded with `low_memory=True`
            (the pipeline raises it before anything changes); `None`: it can.
    """

    config_cls: ClassVar[type[PruningConfig]] = PruningConfig
    requires_calibration: bool = True
    structured: bool = False
    pass_kind: str = ""
    low_memory_refusal: str | None = None

    def __init__(self, config: PruningConfig) -> None:
        if not isinstance(config, self.config_cls):
            raise TypeError(f"{type(self).__name__} needs a {self.config_cls.__name__}, got {type(config).__name__}.")
        self.config = config

    def attach_calibration(self, data, description: dict | None = None, source=None) -> None:
        """Called by the pipeline, before its passes, with the calibration data itself (token ids of shape
        `(num_samples, seq_len)`), its description and the `calibration` argument it came from. Methods that train
        on whole-model batches (SPP) keep them; layer-wise methods use the runner instead. Default: nothing."""

    def resolve_config(self, model: nn.Module, spec: ArchitectureSpec) -> PruningConfig:
        """The config as it runs on `model`: every default that depends on the architecture or the model resolved
        (e.g. `allocation="auto"`). The pipeline calls it once, before `validate`, and runs on a frozen copy of the
        result (`PruningConfig.frozen`), recorded in the report. Default: the config as given."""
        return self.config

    def validate(self, model: nn.Module, spec: ArchitectureSpec) -> None:
        """Reject unusable models before anything is changed (`self.config` is the resolved config). The default checks that no sublayer was removed
        (methods read every projection) and that weights are finite."""
        for i, layer in enumerate(get_layers(model, spec)):
            if len(present_linear_paths(layer, spec)) < len(spec.linear_paths):
                raise ValueError(
                    f"Layer {i} has no attention or no MLP: a sublayer was removed (allocation='servable'), and "
                    f"{type(self).__name__} reads every projection. Prune the dense model once, with the final "
                    "ratio. Nothing was changed."
                )
            for path in spec.linear_paths:
                w = weight_oi(layer.get_submodule(path))
                if w.device.type != "meta" and not torch.isfinite(w).all():
                    raise ValueError(
                        f"Layer {i} `{path}` has NaN/Inf weights; pruning would spread them. Fix or reload the "
                        "model first. Nothing was changed."
                    )
