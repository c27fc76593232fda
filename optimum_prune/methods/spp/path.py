"""`SolutionPath`: what one SPP search found (statistics, not weights), saved, checked and cut at any ratio.

A saved path is a directory with `solution_path.json` (model identity, search settings, calibration, units,
timings) and `solution_path.safetensors` (per layer and unit kind: entry step, step_record, Z, Γ, final mask; per
step: units in the support). Tens of kilobytes per layer; no pickles. Loading checks the format; extraction checks
that the model is the one searched (architecture, shapes and a fingerprint of the weights) and that the config does
not ask for another search.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ...modeling.architectures import ArchitectureSpec, base_model_type, get_layers, layer_view, weight_oi
from ...utils.scratch import check_target, publish_directory
from ...version import __version__
from .config import SEARCH_FIELDS

__all__ = ["SolutionPath", "SolutionPathError", "model_identity", "PATH_CONFIG_NAME", "PATH_TENSORS_NAME"]

logger = logging.getLogger(__name__)

PATH_CONFIG_NAME = "solution_path.json"
PATH_TENSORS_NAME = "solution_path.safetensors"
PATH_FORMAT_VERSION = 1
_STATS = ("entry", "record", "z", "gamma", "mask")
_FINGERPRINT_RTOL = 1e-4


class SolutionPathError(ValueError):
    """A solution path that cannot serve this model / config / ratio (raised before anything changes)."""


def model_identity(model: nn.Module, spec: ArchitectureSpec) -> dict[str, Any]:
    """What a path is tied to: model type, per-layer geometry and, per projection, `Σ|W|` (a weight fingerprint that
    survives a change of dtype but not another model or a fine-tuned one)."""
    layers, fingerprint = [], []
    for i, layer in enumerate(get_layers(model, spec)):
        v = layer_view(layer, i, spec, model.config)
        layers.append([v.num_heads, v.num_kv_heads, v.head_dim, v.qk_head_dim, v.vo_head_dim, v.intermediate_size])
        fingerprint.append([float(weight_oi(v.module(p)).detach().double().abs().sum()) for p in spec.linear_paths])
    base = base_model_type(model.config.model_type)
    return {"model_type": base, "num_layers": len(layers), "layers": layers, "fingerprint": fingerprint}


class SolutionPath:
    """The solution path of one SPP search: for every unit (a QK pair / dimension, a VO dimension, an MLP channel
    of a layer) when it entered the support, how long it stayed (`step_record`), and the final `Z`, `Γ`, mask.

    Made by `AutoPruner.search_solution_path` / `optimum_prune.methods.spp.search_solution_path`; `save_pretrained` /
    `from_pretrained` write and read it; `SPPConfig(pruning_ratio=r, solution_path=dir)` extracts a model from it.

    Args:
        stats (`dict[tuple[int, str], dict[str, torch.Tensor]]`): per `(layer, kind)`: `entry` (−1 = never), `record`,
            `z`, `gamma`, `mask`, each of shape `(units,)`.
        meta (`dict`): model identity, search settings, units, steps, timings, calibration.
        support (`dict[str, torch.Tensor]`): per kind, the number of units in the support after every step.
    """

    def __init__(self, stats: dict, meta: dict, support: dict[str, torch.Tensor]) -> None:
        self.stats, self.meta, self.support = stats, meta, support

    # ------------------------------------------------------------------------------------------------ summary
    @property
    def steps(self) -> int:
        return int(self.meta["steps"])

    @property
    def kinds(self) -> list[str]:
        return sorted({k for _, k in self.stats}, key=("qk", "vo", "mlp").index)

    def entered_fraction(self, kind: str | None = None) -> float:
        """Fraction of the units (of one kind, or all) that entered the support during the search."""
        vals = [s["entry"] for (_, k), s in self.stats.items() if kind is None or k == kind]
        n = sum(v.numel() for v in vals)
        return sum(int((v >= 0).sum()) for v in vals) / max(n, 1)

    def summary(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "search_seconds": self.meta.get("search_seconds"),
            "search_cpu_seconds": self.meta.get("search_cpu_seconds"),
            "entered": {k: round(self.entered_fraction(k), 4) for k in self.kinds},
            "model_type": self.meta["model"]["model_type"],
        }

    def __repr__(self) -> str:
        s = self.summary()
        return f"SolutionPath(model_type={s['model_type']!r}, steps={s['steps']}, entered={s['entered']})"

    # --------------------------------------------------------------------------------------------- save / load
    def save_pretrained(self, save_directory: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the path to `save_directory` atomically (a temporary directory renamed into place)."""
        target = Path(save_directory).absolute()
        where = check_target(target, overwrite)
        tensors = {f"layers.{i}.{kind}.{name}": t.contiguous() for (i, kind), st in self.stats.items()
                   for name, t in st.items()}  # fmt: skip
        tensors.update({f"support.{kind}": t.long().contiguous() for kind, t in self.support.items()})
        meta = {"format_version": PATH_FORMAT_VERSION, "optimum_prune_version": __version__, **self.meta}
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=where))
        try:
            save_file(tensors, str(tmp / PATH_TENSORS_NAME), metadata={"format": "pt"})
            (tmp / PATH_CONFIG_NAME).write_text(json.dumps(meta, indent=2, default=str) + "\n", encoding="utf-8")
            publish_directory(tmp, target, where)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return target

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> SolutionPath:
        """Read a path written by `save_pretrained`."""
        path = Path(path)
        meta_file, tensor_file = path / PATH_CONFIG_NAME, path / PATH_TENSORS_NAME
        if not meta_file.is_file() or not tensor_file.is_file():
            raise FileNotFoundError(
                f"{path} is not a saved solution path (it needs {PATH_CONFIG_NAME} and {PATH_TENSORS_NAME}); make one "
                "with `AutoPruner.search_solution_path(...).save_pretrained(dir)` or `optimum-prune search`."
            )
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
        if meta.get("format_version") != PATH_FORMAT_VERSION:
            raise SolutionPathError(f"{path}: solution-path format {meta.get('format_version')!r} is not supported.")
        tensors = load_file(str(tensor_file))
        stats: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for layer, per in meta["units"].items():
            for kind, n in per.items():
                st = {name: tensors[f"layers.{layer}.{kind}.{name}"] for name in _STATS}
                if any(t.numel() != n for t in st.values()):
                    raise SolutionPathError(f"{path}: layer {layer} {kind} statistics do not have {n} entries.")
                stats[(int(layer), kind)] = st
        support = {k[len("support.") :]: t for k, t in tensors.items() if k.startswith("support.")}
        return cls(stats, meta, support)

    # ----------------------------------------------------------------------------------------------- checks
    def check_model(self, model: nn.Module, spec: ArchitectureSpec) -> None:
        """Raise `SolutionPathError` unless `model` is the model this path was searched on."""
        want, have = self.meta["model"], model_identity(model, spec)
        if want["model_type"] != have["model_type"] or want["num_layers"] != have["num_layers"]:
            raise SolutionPathError(
                f"This solution path was searched on a {want['model_type']} model with {want['num_layers']} layers, "
                f"not this {have['model_type']} model with {have['num_layers']} layers. Search this model instead."
            )
        for i, (a, b) in enumerate(zip(want["layers"], have["layers"])):
            if a != b:
                raise SolutionPathError(
                    f"Layer {i} has shape (heads, kv heads, head_dim, q/k dim, v/o dim, MLP) {tuple(b)}; the path "
                    f"was searched on {tuple(a)}. Extract from the model the path was searched on."
                )
        for i, (a, b) in enumerate(zip(want["fingerprint"], have["fingerprint"])):
            for path, x, y in zip(spec.linear_paths, a, b):
                if not math.isclose(x, y, rel_tol=_FINGERPRINT_RTOL):
                    raise SolutionPathError(
                        f"Layer {i} `{path}` holds other weights than the model this path was searched on "
                        f"(Σ|W| {y:.6g} vs {x:.6g}): another model, or a fine-tuned one. Search this model instead."
                    )

    def check_config(self, config) -> None:
        """Raise `SolutionPathError` when `config` asks for a search other than this path's, or for units it lacks."""

        defaults = type(config)()
        path_settings = json.loads(json.dumps(self.meta["search"]))
        for name in SEARCH_FIELDS:
            value = json.loads(json.dumps(getattr(config, name)))
            if value != json.loads(json.dumps(getattr(defaults, name))) and value != path_settings.get(name):
                raise SolutionPathError(
                    f"The config asks for {name}={value!r} but the solution path was searched with "
                    f"{name}={path_settings.get(name)!r}. Drop `solution_path` to search again with these settings, "
                    f"or drop `{name}` to extract from this path."
                )
        kinds = set(self.kinds)
        wanted = ({"qk", "vo"} if config.prune_attention else set()) | ({"mlp"} if config.prune_mlp else set())
        missing = sorted(wanted - kinds)
        if missing:
            part = "attention" if "qk" in missing else "MLP"
            raise SolutionPathError(
                f"The solution path holds no {part} units (it was searched with prune_{part.lower()}=False); set "
                f"prune_{part.lower()}=False or search again."
            )
        searched = {i for i, _ in self.stats}
        n = self.meta["model"]["num_layers"]
        lacking = sorted(i for i in range(n) if i not in config.skip_layers and i not in searched)
        if lacking:
            raise SolutionPathError(
                f"The solution path has no units for layers {lacking} (skipped by its search); add them to "
                "`skip_layers` or search again."
            )
