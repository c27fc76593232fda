"""Recipes: several pruning configs applied to one model, e.g. AMP on q/k and Wanda on everything else.

`prune_(model, [config, ...])` runs a recipe:
  - structured configs (heads / channels removed) run first, each as its own stage, in list order;
  - then every unstructured / N:M config runs in ONE layer-wise calibration pass (`methods.unstructured.layerwise_pass`):
    on each decoder layer every config prunes its own targets, in list order, and the layer's pruned output feeds
    the next layer.
Checked before any weight changes: an empty list, a non-config entry, two structured stages pruning the same part
(attention / MLP), unstructured configs whose targets overlap, and each config's own validation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .calibration.inputs import calibration_inputs
from .calibration.sequential import runner_factory
from .config import PruningConfig
from .methods.registry import get_pruner_class
from .methods.structured import attention_mlp_params
from .methods.unstructured import layerwise_pass, target_sparsity
from .modeling.architectures import ArchitectureSpec, get_spec
from .modeling.surgery import apply_plan_
from .report import PruningReport, count_parameters, layer_table, record_history
from .runtime.session import open_session, resident_blocks, zero_fraction

__all__ = ["prune_recipe_", "check_recipe", "RECIPE_METHOD"]

logger = logging.getLogger(__name__)

RECIPE_METHOD = "recipe"
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


def check_recipe(configs: Any, model: nn.Module, spec: ArchitectureSpec | None = None) -> list:
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
        if not p.is_structured:
            continue
        cfg = p.config
        for part, on in (("attention", cfg.prune_attention), ("mlp", cfg.prune_mlp)):
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
        if p.is_structured:
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
    for p in pruners:
        p.validate(model, spec)
    return pruners


def prune_recipe_(
    model: nn.Module,
    configs: Sequence[PruningConfig],
    calibration: Any = None,
    tokenizer: Any = None,
    *,
    batch_size: int | None = None,
    device: torch.device | str | None = None,
    checkpoint_dir: Any = None,
    activation_memory: int | str | None = None,
) -> PruningReport:
    """Run a recipe (see the module docstring); called by `prune_` when it is given a list of configs. Each structured
    config is one stage of a low-memory or checkpointed run, the unstructured pass the last one."""
    t0 = time.perf_counter()
    spec = get_spec(model)
    pruners = check_recipe(configs, model, spec)
    ids, calib_desc = calibration_inputs(model, calibration, tokenizer,
                                         [p.config.method for p in pruners if p.needs_calibration])  # fmt: skip
    if ids is not None:
        for p in pruners:
            p.attach_calibration(ids, calib_desc, source=calibration)
    bs = batch_size or getattr(calibration, "batch_size", 8)
    params_before, prunable_before = count_parameters(model), attention_mlp_params(model, spec)
    sections: list[dict] = [{} for _ in pruners]
    expected = 0.0
    session = {"ids": ids, "batch_size": bs, "device": device, "checkpoint_dir": checkpoint_dir}
    with open_session(model, spec, configs=list(configs), activation_memory=activation_memory, **session) as sess:
        runner = runner_factory(model, spec, ids, bs, device, sess.activations)
        structured = [k for k, p in enumerate(pruners) if p.is_structured]
        for stage, k in enumerate(structured):
            p = pruners[k]
            ts, before = time.perf_counter(), attention_mlp_params(model, spec)
            with sess.stage(stage):
                plan = sess.completed_plan() or p.compute_plan(model, spec, runner)
                apply_plan_(model, spec, plan)
            sess.mark_complete(stage, plan)
            expected += p.config.pruning_ratio * prunable_before
            sections[k] = {
                "target": p.config.pruning_ratio,
                "measured": (before - attention_mlp_params(model, spec)) / prunable_before,
                "seconds": time.perf_counter() - ts,
                "info": plan.info,
            }
        flat = [k for k, p in enumerate(pruners) if not p.is_structured]
        if flat:
            if len(flat) < len(pruners):
                for k in flat:  # shapes changed: N:M widths are checked again before the pass
                    pruners[k].validate(model, spec)
            with sess.stage(len(structured)):
                plan = sess.completed_plan() or layerwise_pass([pruners[k] for k in flat], model, spec, runner)
            sess.mark_complete(len(structured), plan)
            for j, k in enumerate(flat):
                per = target_sparsity(model, spec, pruners[k].resolve(model, spec))
                numel = sum(n for _, n in per.values())
                expected += pruners[k].config.sparsity * numel
                key = str(j) if len(flat) > 1 else None
                sections[k] = {
                    "target": pruners[k].config.sparsity,
                    "measured": sum(s * n for s, n in per.values()) / max(numel, 1),
                    "sparsity": {name: s for name, (s, _) in per.items()},
                    "seconds": plan.info["seconds"][j],
                    "layers": {
                        i: (lp.info.get(key, {}) if key else lp.info) for i, lp in plan.layers.items() if lp.info
                    },
                }
        zeros_prunable = _zero_or_removed(model, spec, prunable_before)
        whole = zero_fraction(model, params_before)
        extra = sess.summary()
    for k, p in enumerate(pruners):
        sections[k] = {"method": p.config.method, "config": p.config.to_dict(), **sections[k]}
    sparsity = {name: s for sec in sections for name, s in sec.get("sparsity", {}).items()}
    total = time.perf_counter() - t0
    report = PruningReport(
        method=RECIPE_METHOD,
        config={"recipe": [c.to_dict() for c in configs]},
        target=expected / max(prunable_before, 1),
        measured=zeros_prunable,
        params_before=params_before,
        params_after=count_parameters(model),
        prunable_params_before=prunable_before,
        prunable_params_after=attention_mlp_params(model, spec),
        layers=layer_table(model, spec),
        sparsity=sparsity,
        timings={"total_s": total, **{f"section_{k}_s": s["seconds"] for k, s in enumerate(sections)}},
        calibration=calib_desc,
        info={"whole_model_sparsity": whole, **extra},
        sections=sections,
    )
    record_history(model, RECIPE_METHOD, 1, [c.to_dict() for c in configs], calib_desc, report)
    logger.info("%s", report)
    return report


def _zero_or_removed(model: nn.Module, spec: ArchitectureSpec, prunable_before: int) -> float:
    """Fraction of the original attention + MLP parameters that are now removed or exactly zero."""
    nonzero = 0
    for _, layer in resident_blocks(model, spec):
        for path in spec.linear_paths:
            nonzero += sum(int((p != 0).sum()) for p in layer.get_submodule(path).parameters(recurse=False))
    return 1 - nonzero / max(prunable_before, 1)
