"""`transformers.Trainer` plumbing shared by every training loop of the library (recovery fine-tuning, SPP's mask
search): `TrainingArguments` on a fixed base, and a Trainer that logs instead of printing."""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback, ProgressCallback

__all__ = ["build_training_arguments", "cpu_has_native_bf16", "quiet"]

logger = logging.getLogger(__name__)


def build_training_arguments(kwargs: dict[str, Any], extra: dict[str, Any], owner: str) -> TrainingArguments:
    """`TrainingArguments` from a loop's own `kwargs` plus the user's `extra` ones (which win), on the library's
    fixed base: no checkpoints, no reporting integrations, every dataset column kept, no dataloader workers."""
    base = {
        "save_strategy": "no",
        "report_to": [],
        "remove_unused_columns": False,
        "dataloader_num_workers": 0,
        "dataloader_pin_memory": torch.cuda.is_available(),
    }
    try:
        args = TrainingArguments(**{**base, **kwargs, **extra})
    except TypeError as e:
        raise ValueError(f"{owner}.training_args: {e}") from e
    if args.bf16 and args.device.type == "cpu" and not cpu_has_native_bf16():
        logger.warning(
            "%s.training_args asks for bf16 autocast on a CPU without native bf16 (no AVX512-BF16 / AMX): "
            "PyTorch emulates it, which we measured ~15x slower than fp32 (AMD EPYC, AVX2); drop 'bf16' here.",
            owner,
        )
    return args


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 matrix products natively (AVX512-BF16 or AMX), where bf16 autocast is faster
    than fp32 rather than emulated."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


class _QuietProgress(ProgressCallback):
    """Trainer's tqdm bar (on stderr) without printing the log dicts to stdout; `_LossLogger` logs them instead."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        pass


class _LossLogger(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and state.is_world_process_zero:
            logger.info(
                "step %d: %s",
                state.global_step,
                {k: round(v, 4) if isinstance(v, float) else v for k, v in logs.items()},
            )


def quiet(trainer: Trainer) -> Trainer:
    """Library code never prints: swap Trainer's printing callbacks for a tqdm bar and `logging`."""
    trainer.remove_callback(PrinterCallback)
    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(_QuietProgress)
    trainer.add_callback(_LossLogger)
    return trainer
