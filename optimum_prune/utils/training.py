"""`transformers.Trainer` plumbing shared by every training loop of the library (recovery fine-tuning, SPP's mask
search): `TrainingArguments` on a fixed base, and a Trainer that logs instead of printing."""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback, ProgressCallback

__all__ = ["build_training_arguments", "quiet"]

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
        return TrainingArguments(**{**base, **kwargs, **extra})
    except TypeError as e:
        raise ValueError(f"{owner}.training_args: {e}") from e


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
