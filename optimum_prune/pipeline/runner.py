"""The staged runner behind `prune_`: every call is a recipe, a list of configs (one config is a recipe of one).

  - structured configs (heads / channels removed) run first, each as its own stage, in list order;
  - then every unstructured / N:M config runs in ONE layer-wise calibration pass (`passes.layerwise`): on each
    decoder layer every config prunes its own targets, in list order, and the layer's pruned output feeds the next
    layer.
Each stage runs the pass kind of its pruner (`passes`) on a `Stage` (`stage`: the model, the calibration runner, the
session of low-memory blocks and the run checkpoint, the cache of calibration passes); the pruner's hooks decide, and
the session applies the plan (`session.apply`, the one place plans are executed). Checked before any weight changes: an empty
list, a non-config entry, two structured stages pruning the same part (attention / MLP), unstructured configs whose
targets overlap, a method that cannot run on a low-memory model, and each config's own validation.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..calibration.inputs import calibration_inputs
from ..config import PruningConfig
from ..methods.base import BasePruner
from ..methods.registry import get_pruner_class
from ..modeling.architectures import ArchitectureSpec, get_spec
from ..modeling.shapes import attention_mlp_params
from ..plan import PruningPlan
from ..storage.streaming import get_store
from .passes import run_pass
from .stage import Stage

__all__ = ["StageRecord", "check_recipe", "prepare_recipe", "run_stages"]

_FUSED_ROLES = ("q_proj", "k_proj", "v_proj")


def _name(k: int, config: PruningConfig) -> str:
    return f"config #{k} ({type(config).__name__})"


def _roles(pruner, model: nn.Module, spec: ArchitectureSpec) -> dict[str, str]:
    """role → module key for every projection an unstructured pruner targets (a whole fused q|k|v covers three)."""
    out = {}
    for t in pruner.resolve(model, spec):
        for role in _FUSED_ROLES if t.role == "qkv" else (t.role,):
            out[role] = t.key
    return out


def check_recipe(configs: Any, model: nn.Module, spec: ArchitectureSpec | None = None) -> list[BasePruner]:
    """Validate a recipe against `model` without changing it; returns the pruners, in list order."""
    if not isinstance(configs, (list, tuple)) or not configs:
        raise ValueError("A recipe is a non-empty list of pruning configs, e.g. [AMPConfig(), WandaConfig(...)].")
    for k, c in enumerate(configs):
        if not isinstance(c, PruningConfig):
            raise TypeError(f"Recipe entry #{k} must be a PruningConfig, got {type(c).__name__}.")
    spec = spec or get_spec(model)
    pruners = [get_pruner_class(c.method)(c) for c in configs]
    parts: dict[str, int] = {}
    for k, p in enumerate(pruners):
        if not p.structured:
            continue
        cfg = p.config
        for part, on in (("attention", cfg.cuts_attention(spec.modality)), ("mlp", cfg.prune_mlp)):
            if on and part in parts:
                j = parts[part]
                raise ValueError(
                    f"{_name(j, configs[j])} and {_name(k, cfg)} are both structured and both prune the {part}; "
                    "a recipe may hold several structured stages only if they prune different parts (set "
                    "`prune_attention=False` or `prune_mlp=False` on one of them), or merge them into one config."
                )
            if on:
                parts[part] = k
    owner: dict[str, int] = {}
    for k, p in enumerate(pruners):
        if p.structured:
            continue
        for role in _roles(p, model, spec):
            if role in owner:
                j = owner[role]
                raise ValueError(
                    f"{_name(j, configs[j])} and {_name(k, configs[k])} both target {role!r}; the targets of the "
                    "unstructured configs of a recipe must be disjoint (set `targets=` on each, e.g. AMP on "
                    "['q_proj', 'k_proj'] and Wanda on ['v_proj', 'o_proj', 'mlp'])."
                )
            owner[role] = k
    low_memory = get_store(model) is not None
    for p in pruners:
        if low_memory and p.low_memory_refusal:
            raise ValueError(p.low_memory_refusal)
        p.config = p.resolve_config(model, spec).frozen()  # as it runs: resolved once, never changed
        p.validate(model, spec)
    return pruners


def prepare_recipe(model: nn.Module, configs: Sequence[PruningConfig], calibration: Any, tokenizer: Any):
    """Validate everything and build what the pruners need, touching no weight: `(spec, pruners, calibration
    inputs or None, their description)`."""
    spec = get_spec(model)
    pruners = check_recipe(configs, model, spec)
    needing = [p.config.method for p in pruners if p.requires_calibration]
    ids, calib_desc = calibration_inputs(model, calibration, tokenizer, needing)
    if ids is not None:
        for p in pruners:
            p.attach_calibration(ids, calib_desc, source=calibration)
    return spec, pruners, ids, calib_desc


@dataclass
class StageRecord:
    """What one stage did.

    Args:
        members (`list[int]`): positions in the recipe of the configs it ran.
        plan (`PruningPlan`): its decision (unstructured: the per-layer reports; the weights are already written).
        started / decided / finished (`float`): `time.perf_counter()` when it began, when its plan was decided, and
            when it was applied.
        prunable_before / prunable_after (`int`): attention + MLP parameters before and after it.
    """

    members: list[int]
    plan: PruningPlan
    started: float
    decided: float
    finished: float
    prunable_before: int
    prunable_after: int


def run_stages(stage: Stage, pruners: Sequence[BasePruner], apply: bool = True) -> list[StageRecord]:
    """Run the stages of a validated recipe on `stage.model` (see the module docstring), inside an open session.
    `apply=False` decides without removing anything (unstructured methods still write their weights while deciding,
    since later layers must see them)."""
    model, spec, sess = stage.model, stage.spec, stage.session
    structured = [[k] for k, p in enumerate(pruners) if p.structured]
    flat = [k for k, p in enumerate(pruners) if not p.structured]
    records = []
    for index, members in enumerate(structured + ([flat] if flat else [])):
        started, before = time.perf_counter(), attention_mlp_params(model, spec)
        if not pruners[members[0]].structured and len(flat) < len(pruners):
            for k in flat:  # shapes changed: N:M widths are checked again before the pass
                pruners[k].validate(model, spec)
        with sess.stage(index):
            plan = sess.completed_plan()
            if plan is None:
                plan = run_pass([pruners[k] for k in members], stage)
            decided = time.perf_counter()
            if apply:
                sess.apply(model, spec, plan)
        finished = time.perf_counter()
        sess.mark_complete(index, plan)
        after = attention_mlp_params(model, spec)
        records.append(StageRecord(members, plan, started, decided, finished, before, after))
    return records
