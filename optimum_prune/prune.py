"""`prune_`: the one functional entry point."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ._deprecation import deprecated_getattr
from .calibration.sequential import runner_factory
from .config import PruningConfig
from .methods.registry import prepare_pruner
from .methods.structured import attention_mlp_params
from .methods.unstructured import target_sparsity
from .modeling.surgery import apply_plan_
from .recipe import prune_recipe_
from .report import PruningReport, count_parameters, layer_table, record_history
from .runtime.session import open_session, zero_fraction
from .utils.distributed import init_from_env

__all__ = [
    "prune_",
]

logger = logging.getLogger(__name__)


def _compute_plan(model: nn.Module, config: PruningConfig, calibration: Any = None, tokenizer: Any = None, **kwargs):
    """Decide without executing the removal: returns `(spec, plan)` (the tests use it to verify "removed ≡ zeroed";
    internal: a plan's layout is no public contract).

    Unstructured methods write their new weights while deciding (later layers must see them).
    """
    spec, pruner, ids, _ = prepare_pruner(model, config, calibration, tokenizer)
    bs = kwargs.get("batch_size") or getattr(calibration, "batch_size", 8)
    device = kwargs.get("device")
    with open_session(model, spec, configs=[config], ids=ids, batch_size=bs, device=device) as sess:
        with sess.stage(0):
            return spec, pruner.compute_plan(
                model, spec, runner_factory(model, spec, ids, bs, device, sess.activations)
            )


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
) -> PruningReport:
    """Prune `model` in place with the method chosen by `config`.

    Args:
        model (`PreTrainedModel`): a supported `*ForCausalLM` model, or image model (ViT / DeiT / Dinov2
            classifier or backbone; see `supported_model_types()`), in memory or loaded with
            `AutoPruner.from_pretrained(path, low_memory=True)` (blocks on disk, one in memory at a time).
        config (`PruningConfig | list[PruningConfig]`): e.g. `NumericalConfig(pruning_ratio=0.2)`, or a
            recipe: a list of configs (see `optimum_prune.recipe`), e.g. AMP on q/k and Wanda on the rest, run in
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
            different model or config in the directory is an error). See `optimum_prune.runtime.checkpoint`.
        activation_memory (`int | str | None`): memory for the calibration activations between blocks (e.g.
            `"4GB"`); beyond it they go to disk. Default: unlimited in memory; low-memory, half of what is free
            after the block and its statistics.

    Returns:
        `PruningReport` with measured ratios and per-layer shapes. All validation happens before any weight is
        touched; a failure then leaves the model unchanged. In a `torch.distributed` process group (`torchrun`,
        `accelerate launch`), the ranks split the calibration samples and all-reduce the statistics.
    """
    init_from_env()
    if isinstance(config, (list, tuple)):
        return prune_recipe_(model, list(config), calibration, tokenizer, batch_size=batch_size, device=device,
                             checkpoint_dir=checkpoint_dir, activation_memory=activation_memory)  # fmt: skip
    t0 = time.perf_counter()
    spec, pruner, ids, calib_desc = prepare_pruner(model, config, calibration, tokenizer)
    bs = batch_size or getattr(calibration, "batch_size", 8)
    params_before, prunable_before = count_parameters(model), attention_mlp_params(model, spec)
    session = {"ids": ids, "batch_size": bs, "device": device, "checkpoint_dir": checkpoint_dir}
    with open_session(model, spec, configs=[config], activation_memory=activation_memory, **session) as sess:
        with sess.stage(0):
            plan = sess.completed_plan()
            if plan is None:
                plan = pruner.compute_plan(model, spec, runner_factory(model, spec, ids, bs, device, sess.activations))
            t1 = time.perf_counter()
            apply_plan_(model, spec, plan)
        t2 = time.perf_counter()
        prunable_after = attention_mlp_params(model, spec)
        sparsity = {}
        if pruner.is_structured:
            measured = 1 - prunable_after / prunable_before
            target = config.pruning_ratio
        else:
            per_target = target_sparsity(model, spec, pruner.resolve(model, spec))
            sparsity = {k: s for k, (s, _) in per_target.items()}
            measured = sum(s * n for s, n in per_target.values()) / max(sum(n for _, n in per_target.values()), 1)
            target = config.sparsity
            plan.info["whole_model_sparsity"] = zero_fraction(model, params_before)
        sess.mark_complete(0, plan)
    report = PruningReport(
        method=config.method,
        config=pruner.config.to_dict(),  # with the defaults it resolved for this architecture
        target=float(target),
        measured=float(measured),
        params_before=params_before,
        params_after=count_parameters(model),
        prunable_params_before=prunable_before,
        prunable_params_after=prunable_after,
        layers=layer_table(model, spec),
        sparsity=sparsity,
        timings={"decide_s": t1 - t0, "apply_s": t2 - t1, "total_s": t2 - t0},
        calibration=calib_desc,
        info={**plan.info, **sess.summary(), "layers": {i: lp.info for i, lp in plan.layers.items() if lp.info}},
        artifacts=plan.artifacts,
    )
    record_history(model, config.method, config.config_version, pruner.config.to_dict(), calib_desc, report)
    logger.info("%s", report)
    return report


# old public name, kept for one release
__getattr__ = deprecated_getattr(
    __name__, globals(), {"compute_plan": ("_compute_plan", "`prune_` (planning without pruning is internal)")}
)
