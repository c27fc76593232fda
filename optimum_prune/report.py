"""`PruningReport`: what was asked, what was measured."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import transformers
from torch import nn

from .constants import HISTORY_ATTR
from .modeling.architectures import ArchitectureSpec, get_layers, layer_view, weight_oi
from .version import __version__

__all__ = ["PruningReport", "layer_table", "layer_row", "count_parameters", "linear_sparsity", "record_history"]


def count_parameters(model: nn.Module) -> int:
    """Parameters of the model, tied weights counted once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def layer_row(layer: nn.Module, index: int, spec: ArchitectureSpec, config) -> dict[str, Any]:
    """One decoder layer's heads, KV heads, head_dim, intermediate size (an MoE layer's: its experts' width, with
    `num_experts`), and which projections carry a bias; for a
    layer whose head dimensions were pruned (SPP) also `qk_head_dim`, `vo_head_dim`, the softmax scale and, on
    rotary models, the kept `rope_pairs` (`modeling.pair_attention`)."""
    v = layer_view(layer, index, spec, config)
    row = {
        "num_attention_heads": v.num_heads,
        "num_key_value_heads": v.num_kv_heads,
        "head_dim": v.head_dim,
        "intermediate_size": v.intermediate_size,
        "biases": sorted(p for p in spec.linear_paths if getattr(layer.get_submodule(p), "bias", None) is not None),
    }
    if v.is_moe:
        row["num_experts"] = v.num_experts
    if v.pair_shaped:
        attn = v.attn
        row.update(qk_head_dim=v.qk_head_dim, vo_head_dim=v.vo_head_dim, attn_scaling=float(attn.scaling))
        if getattr(attn, "rope_pairs", None) is not None:
            row["rope_pairs"] = list(attn.rope_pairs)
    return row


def layer_table(model: nn.Module, spec: ArchitectureSpec) -> list[dict[str, Any]]:
    """`layer_row` of every decoder layer."""
    return [layer_row(layer, i, spec, model.config) for i, layer in enumerate(get_layers(model, spec))]


def linear_sparsity(model: nn.Module, spec: ArchitectureSpec) -> dict[str, float]:
    """Fraction of exact zeros in every prunable projection, keyed `layers.<i>.<path>`."""
    out = {}
    for i, layer in enumerate(get_layers(model, spec)):
        for p in spec.linear_paths:
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
        return (
            f"PruningReport(method={self.method!r}, target={self.target:.3f}, measured={self.measured:.3f}, "
            f"params {self.params_before:,} -> {self.params_after:,})"
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
