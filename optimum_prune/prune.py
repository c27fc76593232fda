"""`prune_`: the one functional entry point."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
import transformers
from torch import nn

from ._deprecation import deprecated_getattr
from .calibration.sequential import LayerwiseRunner
from .config import CalibrationConfig, PruningConfig
from .distributed import init_from_env
from .methods.structured import attention_mlp_params
from .methods.unstructured import target_sparsity
from .modeling.architectures import get_layers, get_spec, is_image_model, layer_view
from .modeling.surgery import apply_layer_plan_
from .registry import get_pruner_class
from .report import PruningReport, count_parameters, layer_table
from .session import open_session, resident_blocks
from .streaming import get_store
from .version import __version__

__all__ = [
    "prune_",
    "apply_plan_",
    "calibration_inputs",
    "runner_factory",
    "HISTORY_ATTR",
    "record_history",
    "zero_fraction",
]

logger = logging.getLogger(__name__)

HISTORY_ATTR = "_optimum_prune_history"


def _calibration_ids(calibration: Any, tokenizer: Any) -> tuple[torch.Tensor, dict | None]:
    if isinstance(calibration, torch.Tensor):
        if calibration.dim() != 2 or calibration.dtype not in (torch.long, torch.int32, torch.int64):
            raise ValueError("Calibration token ids must be an integer tensor of shape (num_samples, seq_len).")
        return calibration.long(), {
            "source": "token ids",
            "num_samples": calibration.shape[0],
            "seq_len": calibration.shape[1],
        }
    if not isinstance(calibration, CalibrationConfig):
        raise TypeError(
            f"`calibration` must be a CalibrationConfig or a (num_samples, seq_len) LongTensor, got {type(calibration).__name__}."
        )
    if tokenizer is None:
        raise ValueError("Calibration text needs a tokenizer: pass `tokenizer=` (AutoPruner loads it for you).")
    from .calibration.data import describe_calibration, get_calibration_batches

    ids = get_calibration_batches(calibration, tokenizer)
    desc = describe_calibration(calibration)  # without the tokenizer: no second tokenization pass
    return ids, desc


def calibration_inputs(
    model: nn.Module, calibration: Any, tokenizer: Any, methods: list[str] | None = None
) -> tuple[torch.Tensor | None, dict | None]:
    """Validated calibration inputs of `model` and their description, for the `methods` that need data (`(None,
    None)` when none does; `None`: needed): token ids `(num_samples, seq_len)`, or for an image model pixel values
    `(num_samples, C, H, W)` (see `optimum_prune.calibration.images`). Touches no weight."""
    from .calibration.images import image_calibration, looks_like_images

    if methods is not None and not methods:
        return None, None
    if calibration is None:
        methods = methods or ["this"]
        what = f"Method {methods[0]!r} needs" if len(methods) == 1 else f"The recipe's {sorted(set(methods))} need"
        raise ValueError(f"{what} calibration data: pass `calibration=CalibrationConfig(dataset=...)`.")
    if is_image_model(model):
        return image_calibration(model, calibration)
    if looks_like_images(calibration):
        raise ValueError(
            f"{type(model).__name__} is a text model: calibration takes text (`CalibrationConfig(dataset=...)`) or "
            "token ids of shape (num_samples, seq_len), not images."
        )
    ids, desc = _calibration_ids(calibration, tokenizer)
    vocab = model.get_input_embeddings().weight.shape[0]
    if int(ids.max()) >= vocab or int(ids.min()) < 0:
        raise ValueError(f"Calibration token ids fall outside the model's vocabulary (size {vocab}); wrong tokenizer?")
    return ids, desc


def runner_factory(model: nn.Module, spec, ids, batch_size: int, device, activations=None):
    """A factory of `LayerwiseRunner`s over `ids` (`None` without calibration data)."""
    if ids is None:
        return None

    def factory():
        return LayerwiseRunner(model, spec, ids, batch_size=batch_size, device=device, activations=activations)

    return factory


def _prepare(model: nn.Module, config: PruningConfig, calibration: Any, tokenizer: Any):
    """Validate everything and build what the pruner needs; touches no weight."""
    if not isinstance(config, PruningConfig):
        raise TypeError(f"`config` must be a PruningConfig subclass instance, got {type(config).__name__}.")
    spec = get_spec(model)
    pruner = get_pruner_class(config.method)(config)
    pruner.validate(model, spec)
    ids, calib_desc = calibration_inputs(model, calibration, tokenizer, [config.method] * pruner.needs_calibration)
    if ids is not None:
        pruner.attach_calibration(ids, calib_desc, source=calibration)
    return spec, pruner, ids, calib_desc


def _compute_plan(model: nn.Module, config: PruningConfig, calibration: Any = None, tokenizer: Any = None, **kwargs):
    """Decide without executing the removal: returns `(spec, plan)` (the tests use it to verify "removed ≡ zeroed";
    internal: a plan's layout is no public contract).

    Unstructured methods write their new weights while deciding (later layers must see them).
    """
    spec, pruner, ids, _ = _prepare(model, config, calibration, tokenizer)
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
            different model or config in the directory is an error). See `optimum_prune.checkpoint`.
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
        from .recipe import prune_recipe_

        return prune_recipe_(model, list(config), calibration, tokenizer, batch_size=batch_size, device=device,
                             checkpoint_dir=checkpoint_dir, activation_memory=activation_memory)  # fmt: skip
    t0 = time.perf_counter()
    spec, pruner, ids, calib_desc = _prepare(model, config, calibration, tokenizer)
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
        config=config.to_dict(),
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
    record_history(model, config.method, config.config_version, config.to_dict(), calib_desc, report)
    logger.info("%s", report)
    return report


def apply_plan_(model: nn.Module, spec, plan) -> None:
    """Execute a plan's layer decisions in place (those a low-memory or resumed run has already written are
    restored by the session instead)."""
    layers = get_layers(model, spec)
    for idx, lp in plan.layers.items():
        if not lp.applied:
            apply_layer_plan_(layer_view(layers[idx], idx, spec, model.config), lp, mode="remove")


def zero_fraction(model: nn.Module, params: int) -> float:
    """Exact zeros among all parameters (tied weights once), relative to `params` (blocks of a low-memory model
    are read one at a time; tensors it keeps on disk are read from there)."""
    spec = get_spec(model)
    in_blocks = {id(p) for layer in get_layers(model, spec) for p in layer.parameters()}
    unique = {id(p): (n, p) for n, p in model.named_parameters() if id(p) not in in_blocks}.values()
    on_disk = [n for n, p in unique if p.device.type == "meta"]
    zeros = sum(float((p == 0).sum()) for _, p in unique if p.device.type != "meta")
    if on_disk:
        zeros += sum(float((t == 0).sum()) for t in get_store(model).source.read(on_disk).values())
    for _, layer in resident_blocks(model, spec):
        zeros += sum(float((p == 0).sum()) for p in layer.parameters())
    return zeros / max(params, 1)


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


# old public name, kept for one release
__getattr__ = deprecated_getattr(
    __name__, globals(), {"compute_plan": ("_compute_plan", "`prune_` (planning without pruning is internal)")}
)
