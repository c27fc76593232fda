"""Image examples for image models (ViT, DeiT, Dinov2): calibration, fine-tuning and evaluation data.

What a `transformers.Trainer` takes is accepted: a `datasets.Dataset` (or `DatasetDict`, indexed by `split`) with a
`pixel_values` column (and optionally `labels` / `label`), a list of `{"pixel_values": tensor, "labels": int}`
examples, or a stacked float tensor of shape `(N, C, H, W)`; any of them also as `CalibrationConfig(dataset=...)`,
whose `num_samples` then picks a seeded subset (`seed`: the same seed gives the same images for every method).
Pixel values are what the model's image processor produces (resized and normalised); nothing is resized here.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

import torch
from torch import nn

from ..config import CalibrationConfig

__all__ = [
    "IMAGE_COLUMN",
    "LabelledImages",
    "load_image_examples",
    "looks_like_images",
    "image_calibration",
    "calibration_labels",
    "check_images_fit",
    "check_labels",
    "require_classifier",
]

logger = logging.getLogger(__name__)

IMAGE_COLUMN = "pixel_values"
LABEL_COLUMNS = ("labels", "label")
_FORMS = (
    "a `datasets.Dataset` with a `pixel_values` column (and optional `labels`), a list of "
    '`{"pixel_values": tensor, "labels": int}` examples, or a float tensor of shape (N, C, H, W) — the pixel values '
    "the model's image processor produces"
)


def _is_dataset(obj: Any) -> bool:
    return type(obj).__module__.startswith("datasets") and hasattr(obj, "column_names")


def looks_like_images(source: Any) -> bool:
    """Whether `source` (or `CalibrationConfig.dataset`) holds images rather than text / token ids."""
    source = getattr(source, "dataset", source)
    if isinstance(source, torch.Tensor):
        return source.is_floating_point()
    if isinstance(source, (list, tuple)) and source:
        first = source[0]
        return (isinstance(first, dict) and IMAGE_COLUMN in first) or isinstance(first, torch.Tensor)
    if _is_dataset(source):
        columns = source.column_names
        columns = next(iter(columns.values())) if isinstance(columns, dict) else columns  # DatasetDict
        return IMAGE_COLUMN in columns
    return False


def _as_tensor(x: Any, where: str) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
    if t.dim() == 4 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 3 or not t.is_floating_point():
        raise ValueError(
            f"{where} must be float pixel values of shape (C, H, W), got {tuple(t.shape)} {t.dtype}. Run the images "
            "through the model's image processor first (it resizes and normalises them)."
        )
    return t.float()


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    shapes = sorted({tuple(t.shape) for t in tensors})
    if len(shapes) > 1:
        raise ValueError(
            f"The images have different shapes ({shapes[:3]}{' ...' if len(shapes) > 3 else ''}); resize them to one "
            "size with the model's image processor."
        )
    return torch.stack(tensors)  # (N, C, H, W)


def _labels(values: list[Any]) -> torch.Tensor | None:
    if all(v is None for v in values):
        return None
    if any(v is None for v in values):
        raise ValueError("Some examples have `labels` and some do not; give a label to every example or to none.")
    return torch.as_tensor([int(v) for v in values], dtype=torch.long)


def _subset(n: int, num_samples: int | None, seed: int) -> list[int]:
    if num_samples is None or num_samples >= n:
        if num_samples is not None and num_samples > n:
            logger.info("Only %d images for num_samples=%d: using all of them.", n, num_samples)
        return list(range(n))
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:num_samples].tolist()


def load_image_examples(
    source: Any, *, num_samples: int | None = None, seed: int = 0, split: str = "train"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pixel values and labels from any accepted image source (see the module docstring).

    Args:
        source: a `datasets.Dataset` / `DatasetDict`, a list of examples, or a `(N, C, H, W)` float tensor.
        num_samples (`int | None`): keep a seeded random subset of this many examples (`None`: all, in order).
        seed (`int`): subset seed.
        split (`str`): split of a `DatasetDict`.

    Returns:
        `(pixel_values, labels)`: a float32 tensor `(N, C, H, W)` and a long tensor `(N,)`, or `None` when the
        examples carry no labels.
    """
    if _is_dataset(source) and isinstance(source.column_names, dict):
        if split not in source:
            raise ValueError(f"DatasetDict has no split {split!r}; available splits: {sorted(source)}.")
        source = source[split]
    if isinstance(source, torch.Tensor):
        if source.dim() != 4 or not source.is_floating_point():
            raise ValueError(f"Pixel values must be a float tensor of shape (N, C, H, W), got {tuple(source.shape)} "
                             f"{source.dtype}. Accepted: {_FORMS}.")  # fmt: skip
        keep = _subset(source.shape[0], num_samples, seed)
        return source[keep].float(), None
    if _is_dataset(source):
        if IMAGE_COLUMN not in source.column_names:
            raise ValueError(
                f"The dataset has no {IMAGE_COLUMN!r} column (columns: {source.column_names}). Map the images "
                f"through the model's image processor into `pixel_values` first. Accepted: {_FORMS}."
            )
        rows = source.select(_subset(len(source), num_samples, seed)).with_format("torch")
        label_col = next((c for c in LABEL_COLUMNS if c in source.column_names), None)
        images = [_as_tensor(x, f"{IMAGE_COLUMN}[{i}]") for i, x in enumerate(rows[IMAGE_COLUMN])]
        labels = torch.as_tensor([int(v) for v in rows[label_col]], dtype=torch.long) if label_col else None
        return _stack(images), labels
    if isinstance(source, (list, tuple)) and source:
        keep = _subset(len(source), num_samples, seed)
        images, labels = [], []
        for i in keep:
            ex = source[i]
            if isinstance(ex, dict):
                if IMAGE_COLUMN not in ex:
                    raise ValueError(
                        f"Example {i} has no {IMAGE_COLUMN!r} key (keys: {sorted(ex)}). Accepted: {_FORMS}."
                    )
                images.append(_as_tensor(ex[IMAGE_COLUMN], f"Example {i}'s {IMAGE_COLUMN}"))
                labels.append(next((ex[c] for c in LABEL_COLUMNS if c in ex), None))
            else:
                images.append(_as_tensor(ex, f"Example {i}"))
                labels.append(None)
        return _stack(images), _labels(labels)
    raise TypeError(f"Unsupported image source {type(source).__name__}. Accepted: {_FORMS}.")


@torch.no_grad()
def check_images_fit(model: nn.Module, pixel_values: torch.Tensor) -> None:
    """Raise a `ValueError` (before anything changes) unless the model's embeddings take these pixel values."""
    if not torch.isfinite(pixel_values).all():
        raise ValueError("The pixel values contain NaN or Inf; fix the images or their preprocessing.")
    config = model.config
    channels = getattr(config, "num_channels", None)
    if channels is not None and pixel_values.shape[1] != channels:
        raise ValueError(
            f"The images have {pixel_values.shape[1]} channels but {type(model).__name__} expects {channels} "
            f"(tensor shape {tuple(pixel_values.shape)}, expected (N, {channels}, H, W)); convert them (e.g. to RGB) "
            "and run them through the model's image processor."
        )
    embeddings = model.base_model.embeddings
    sample = pixel_values[:1].to(next(embeddings.parameters()).device)
    try:
        embeddings(sample)
    except (ValueError, RuntimeError) as e:
        raise ValueError(
            f"The images ({tuple(pixel_values.shape[1:])}) do not fit {type(model).__name__} (image_size="
            f"{getattr(config, 'image_size', '?')}, patch_size={getattr(config, 'patch_size', '?')}): {e} Resize "
            "them with the model's image processor."
        ) from e


def _describe(source: Any, pixel_values: torch.Tensor, num_samples: int | None, seed: int) -> dict[str, Any]:
    kind = "tensor" if isinstance(source, torch.Tensor) else "hf_dataset" if _is_dataset(source) else "examples"
    digest = hashlib.sha256(pixel_values.contiguous().numpy().tobytes()).hexdigest()
    return {"source": {"kind": kind, "sha256": digest}, "num_samples": pixel_values.shape[0],
            "image_shape": list(pixel_values.shape[1:]), "requested_samples": num_samples, "seed": seed}  # fmt: skip


def _unpack(calibration: Any) -> tuple[Any, int | None, int, str]:
    """`(source, num_samples, seed, split)` of an image source or a `CalibrationConfig` holding one."""

    if isinstance(calibration, CalibrationConfig):
        return calibration.dataset, calibration.num_samples, calibration.seed, calibration.split
    return calibration, None, 0, "train"


def require_classifier(model: nn.Module, what: str) -> None:
    """Raise a `ValueError` unless `model` is an image classifier: `what` (e.g. "fine-tuning", "SPP's search")
    trains on its cross-entropy."""
    if not hasattr(model, "classifier") or getattr(model.config, "num_labels", 0) < 1:
        raise ValueError(
            f"{type(model).__name__} has no classification head: {what} trains an image classifier with "
            "cross-entropy on labels. Load the `*ForImageClassification` model (a backbone such as `Dinov2Model` "
            "has no labels to learn)."
        )


def check_labels(model: nn.Module, labels: torch.Tensor | None, what: str) -> None:
    """Raise a `ValueError` unless `model` is an image classifier and `labels` are class indices of it."""
    require_classifier(model, what)
    num_labels = model.config.num_labels
    if labels is None:
        raise ValueError(
            f"The images have no labels: {what} trains on the cross-entropy of an image classifier and needs a "
            "`labels` (or `label`) class index per example (a Dataset column or a key of every example dict)."
        )
    bad = labels[(labels < 0) | (labels >= num_labels)]
    if bad.numel():
        raise ValueError(f"Labels {sorted(set(bad.tolist()))[:5]} are outside the model's {num_labels} classes.")


def calibration_labels(calibration: Any) -> torch.Tensor | None:
    """The labels of the images `image_calibration` picks from `calibration` (same subset, same order), or `None`."""
    source, num_samples, seed, split = _unpack(calibration)
    return load_image_examples(source, num_samples=num_samples, seed=seed, split=split)[1]


def image_calibration(model: nn.Module, calibration: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """Validated calibration pixel values `(N, C, H, W)` of an image model, and their description.

    `calibration` is an image source or a `CalibrationConfig` whose `dataset` is one (`num_samples`, `seed` and
    `split` apply; `seq_len` does not). Text or token ids are refused with a message saying what to pass.
    """
    source, num_samples, seed, split = _unpack(calibration)
    if calibration is None or not looks_like_images(source):
        what = "token ids" if isinstance(source, torch.Tensor) else (
            "text" if isinstance(source, (str, os.PathLike, list, tuple)) or _is_dataset(source) else type(source).__name__
        )  # fmt: skip
        raise ValueError(
            f"{type(model).__name__} is an image model: calibration takes images, not {what}. Pass {_FORMS} "
            "(directly or as `CalibrationConfig(dataset=..., num_samples=...)`)."
        )
    pixel_values, _ = load_image_examples(source, num_samples=num_samples, seed=seed, split=split)
    check_images_fit(model, pixel_values)
    desc = _describe(source, pixel_values, num_samples, seed)
    logger.info("Calibration: %d images of shape %s", pixel_values.shape[0], tuple(pixel_values.shape[1:]))
    return pixel_values, desc


class LabelledImages(torch.utils.data.Dataset):
    """`{"pixel_values", "labels"}` examples for `Trainer` (fine-tuning) and SPP's search on image classifiers."""

    def __init__(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> None:
        self.pixel_values, self.labels = pixel_values, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.pixel_values[i], "labels": self.labels[i]}
