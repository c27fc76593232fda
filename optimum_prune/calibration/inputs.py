"""The calibration inputs of a model: token ids for a text model, pixel values for an image model, checked against
the model before any weight changes."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import CalibrationConfig
from ..modeling.architectures import is_image_model
from .data import describe_calibration, get_calibration_batches
from .images import image_calibration, looks_like_images

__all__ = ["calibration_inputs"]


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
    ids = get_calibration_batches(calibration, tokenizer)
    desc = describe_calibration(calibration)  # without the tokenizer: no second tokenization pass
    return ids, desc


def calibration_inputs(
    model: nn.Module, calibration: Any, tokenizer: Any, methods: list[str] | None = None
) -> tuple[torch.Tensor | None, dict | None]:
    """Validated calibration inputs of `model` and their description, for the `methods` that need data (`(None,
    None)` when none does; `None`: needed): token ids `(num_samples, seq_len)`, or for an image model pixel values
    `(num_samples, C, H, W)` (see `optimum_prune.calibration.images`). Touches no weight."""
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
