"""`prune_`: the one functional entry point. It validates, opens the session, runs the stages
(`pipeline.runner.run_stages`) and measures the result into a `PruningReport`."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .calibration.sequential import runner_factory
from .config import PruningConfig
from .methods.base import BasePruner
from .modeling.shapes import attention_mlp_params, layer_table
from .pipeline.runner import StageRecord, prepare_recipe, run_stages
from .pipeline.session import open_session
from .pipeline.stage import Stage
from .pipeline.stats_cache import CalibrationStatsCache, calibration_digest
from .plan import PruningPlan
from .report import PruningReport, count_parameters, record_history, target_sparsity, zero_fraction, zero_or_removed
from .utils.distributed import init_from_env

__all__ = ["prune_", "RECIPE_METHOD"]

logger = logging.getLogger(__name__)

RECIPE_METHOD = "recipe"


def prune_(
    model: nn.Module,
    config: PruningConfig | Sequence[PruningConfig],
    calibration: Any = None,
    tokenizer: Any = None,
    *,
    batch_size: int | None = None,
    device: torch.device | str | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    activation_memory: int | str | None = None,
    stats_cache: CalibrationStatsCache | None = None,
) -> PruningReport:
    """Prune `model` in place with the method chosen by `config`.

    Args:
        model (`PreTrainedModel`): a supported `*ForCausalLM` model, or image model (ViT / DeiT / Dinov2
            classifier or backbone; see `supported_model_types()`), in memory or loaded with
            `AutoPruner.from_pretrained(path, low_memory=True)` (blocks on disk, one in memory at a time).
        config (`PruningConfig | list[PruningConfig]`): e.g. `NumericalConfig(pruning_ratio=0.2)`, or a
            recipe: a list of configs (see `optimum_prune.pipeline.runner`), e.g. AMP on q/k and Wanda on the rest, run in
            one layer-wise calibration pass.
        calibration (`CalibrationConfig | torch.LongTensor | None`): calibration text (or token ids); required by
            data-driven methods. Image models take images instead: a `datasets.Dataset` with `pixel_values`, a list
            of `{"pixel_values", "labels"}` examples, an `(N, C, H, W)` tensor, or a `CalibrationConfig` around one.
        tokenizer (`PreTrainedTokenizerBase | None`): tokenizes the calibration text.
        batch_size (`int | None`): sequences per block forward (default: `calibration.batch_size`).
        device (`torch.device | str | None`): where each block runs during calibration (default: the model's); with
            a low-memory model, where each block is loaded while the rest stays on disk.
        checkpoint_dir (`str | os.PathLike | None`): record every finished block there, atomically; running the
            same call again after a crash continues at the first unfinished block and gives the same model (a
            different model or config in the directory is an error). See `optimum_prune.pipeline.checkpoint`.
        activation_memory (`int | str | None`): memory for the calibration activations between blocks (e.g.
            `"4GB"`); beyond it they go to disk. Default: half of the memory available when the run starts (low-memory:
            of what is left after a block and its statistics).
        stats_cache (`CalibrationStatsCache | None`): stored calibration passes of the structured methods (NP, FLAP,
            magnitude): a prune that differs from a stored one only in what acts after the pass (`pruning_ratio`,
            `allocation` other than OWL, `round_to`, `owl_lambda`), on the same weights and calibration data, reuses
            it (see `CalibrationStatsCache`).

    Returns:
        `PruningReport` with measured ratios and per-layer shapes. All validation happens before any weight is
        touched; a failure then leaves the model unchanged. In a `torch.distributed` process group (`torchrun`,
        `accelerate launch`), the ranks split the calibration samples and all-reduce the statistics.
    """
    init_from_env()
    t0 = time.perf_counter()
    single = not isinstance(config, (list, tuple))
    if single and not isinstance(config, PruningConfig):
        raise TypeError(f"`config` must be a PruningConfig subclass instance, got {type(config).__name__}.")
    configs = [config] if single else list(config)
    options = {"batch_size": batch_size, "device": device, "checkpoint_dir": checkpoint_dir}
    options.update(activation_memory=activation_memory, stats_cache=stats_cache)
    with _staged(model, configs, calibration, tokenizer, **options) as (stage, pruners, calib_desc, params_before):
        records = run_stages(stage, pruners)
        if single:
            report = _single_report(stage, pruners[0], records[0], params_before, t0)
        else:
            report = _recipe_report(stage, pruners, records, params_before, t0)
    report.calibration = calib_desc
    resolved = [p.config.to_dict() for p in pruners]  # the configs as they ran: defaults resolved per architecture
    if single:
        record_history(model, config.method, config.config_version, resolved[0], calib_desc, report)
    else:
        record_history(model, RECIPE_METHOD, 1, resolved, calib_desc, report)
    logger.info("%s", report)
    return report


@contextlib.contextmanager
def _staged(model: nn.Module, configs: list[PruningConfig], calibration: Any, tokenizer: Any, *, batch_size=None,
            device=None, checkpoint_dir=None, activation_memory=None, stats_cache=None):  # fmt: skip
    """Validate the recipe (no weight touched), open the session and yield `(stage, pruners, calibration description,
    parameters before)`: what `run_stages` runs on, with the session open while the caller measures."""
    spec, pruners, ids, calib_desc = prepare_recipe(model, configs, calibration, tokenizer)
    bs = batch_size or getattr(calibration, "batch_size", 8)
    params_before = count_parameters(model)
    session = {"ids": ids, "batch_size": bs, "device": device, "checkpoint_dir": checkpoint_dir}
    with open_session(model, spec, configs=configs, activation_memory=activation_memory, **session) as sess:
        runner = runner_factory(model, spec, ids, bs, device, sess.activations)
        stage = Stage(model, spec, runner, sess, stats_cache, calibration_digest(ids))
        yield stage, pruners, calib_desc, params_before


def _single_report(stage: Stage, pruner: BasePruner, rec: StageRecord, params_before: int, t0: float):
    """The report of one config: its target and measured ratio (structured) or sparsity (unstructured)."""
    model, spec, plan, config = stage.model, stage.spec, rec.plan, pruner.config
    sparsity = {}
    if pruner.structured:
        measured = 1 - rec.prunable_after / rec.prunable_before
        target = config.pruning_ratio
    else:
        per_target = target_sparsity(model, spec, pruner.resolve(model, spec), stage.blocks())
        sparsity = {k: s for k, (s, _) in per_target.items()}
        measured = sum(s * n for s, n in per_target.values()) / max(sum(n for _, n in per_target.values()), 1)
        target = config.sparsity
        chunks = stage.session.value_chunks
        plan.info["whole_model_sparsity"] = zero_fraction(model, spec, params_before, stage.blocks(), chunks)
    return PruningReport(
        method=config.method,
        config=config.to_dict(),
        target=float(target),
        measured=float(measured),
        params_before=params_before,
        params_after=count_parameters(model),
        prunable_params_before=rec.prunable_before,
        prunable_params_after=rec.prunable_after,
        layers=layer_table(model, spec),
        sparsity=sparsity,
        timings={"decide_s": rec.decided - t0, "apply_s": rec.finished - rec.decided, "total_s": rec.finished - t0},
        info={**plan.info, **stage.session.summary(), **_components(config), "layers": _layer_info(plan)},
        artifacts=plan.artifacts,
    )


def _components(config: PruningConfig) -> dict:
    """`{"components": ...}` of a structured config (what runs: scores, allocation, refit), else nothing."""
    return {"components": config.components()} if hasattr(config, "components") else {}


def _layer_info(plan: PruningPlan, key: str | None = None) -> dict:
    return {i: (lp.info.get(key, {}) if key else lp.info) for i, lp in plan.layers.items() if lp.info}


def _recipe_report(stage: Stage, pruners: Sequence[BasePruner], records: list[StageRecord], params_before, t0):
    """The report of a recipe: one section per config, the zeros or removals of the whole recipe."""
    model, spec = stage.model, stage.spec
    prunable_before = records[0].prunable_before
    sections: list[dict] = [{} for _ in pruners]
    expected = 0.0
    for rec in records:
        if len(rec.members) == 1 and pruners[rec.members[0]].structured:
            k = rec.members[0]
            expected += pruners[k].config.pruning_ratio * prunable_before
            sections[k] = {
                "target": pruners[k].config.pruning_ratio,
                "measured": (rec.prunable_before - rec.prunable_after) / prunable_before,
                "seconds": rec.finished - rec.started,
                "info": rec.plan.info,
            }
            continue
        for j, k in enumerate(rec.members):
            per = target_sparsity(model, spec, pruners[k].resolve(model, spec), stage.blocks())
            numel = sum(n for _, n in per.values())
            expected += pruners[k].config.sparsity * numel
            sections[k] = {
                "target": pruners[k].config.sparsity,
                "measured": sum(s * n for s, n in per.values()) / max(numel, 1),
                "sparsity": {name: s for name, (s, _) in per.items()},
                "seconds": rec.plan.info["seconds"][j],
                "layers": _layer_info(rec.plan, str(j) if len(rec.members) > 1 else None),
            }
    zeros_prunable = zero_or_removed(spec, prunable_before, stage.blocks())
    whole = zero_fraction(model, spec, params_before, stage.blocks(), stage.session.value_chunks)
    for k, p in enumerate(pruners):
        sections[k] = {"method": p.config.method, "config": p.config.to_dict(), **sections[k]}
    sparsity = {name: s for sec in sections for name, s in sec.get("sparsity", {}).items()}
    total = time.perf_counter() - t0
    return PruningReport(
        method=RECIPE_METHOD,
        config={"recipe": [p.config.to_dict() for p in pruners]},
        target=expected / max(prunable_before, 1),
        measured=zeros_prunable,
        params_before=params_before,
        params_after=count_parameters(model),
        prunable_params_before=prunable_before,
        prunable_params_after=attention_mlp_params(model, spec),
        layers=layer_table(model, spec),
        sparsity=sparsity,
        timings={"total_s": total, **{f"section_{k}_s": s["seconds"] for k, s in enumerate(sections)}},
        info={"whole_model_sparsity": whole, **stage.session.summary()},
        sections=sections,
    )


def _compute_plan(model: nn.Module, config: PruningConfig, calibration: Any = None, tokenizer: Any = None, **kwargs):
    """Decide without executing the removal: returns `(spec, plan)` (the tests use it to verify "removed ≡ zeroed";
    internal: a plan's layout is no public contract).

    Unstructured methods write their new weights while deciding (later layers must see them).
    """
    with _staged(model, [config], calibration, tokenizer, **kwargs) as (stage, pruners, _, _):
        (record,) = run_stages(stage, pruners, apply=False)
    return stage.spec, record.plan
