"""Recovery fine-tuning of pruned image classifiers (ViT, DeiT, Dinov2): cross-entropy on labelled images, on the
same `transformers.Trainer` training as causal LMs (`engine.train_model`: LoRA on the pruned per-layer shapes or
full, sparsity kept, optional KL distillation), with held-out accuracy before and after."""

from __future__ import annotations

import logging
import tempfile
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..calibration.corpora import split_indices
from ..calibration.images import (
    LabelledImages,
    check_images_fit,
    check_labels,
    load_image_examples,
    require_classifier,
)
from .config import FINETUNE_ATTR, FinetuneConfig, FinetuneReport
from .engine import check_hidden_teacher, lora_target_modules, record_finetune_, train_model, training_arguments
from .sparsity import sparsity_masks

__all__ = ["finetune_images_", "evaluate_classifier"]

logger = logging.getLogger(__name__)

CLASSIFIER_MODULES = ("classifier",)  # the heads of the supported image classifiers, trained fully under LoRA


@torch.no_grad()
def evaluate_classifier(model: nn.Module, pixel_values: torch.Tensor, labels: torch.Tensor, batch_size: int = 32):
    """`(accuracy, mean cross-entropy)` of an image classifier on labelled images."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    correct, loss = 0, 0.0
    for s in range(0, len(labels), batch_size):
        y = labels[s : s + batch_size].to(device)
        logits = model(pixel_values=pixel_values[s : s + batch_size].to(device)).logits.float()  # (b, C)
        correct += int((logits.argmax(-1) == y).sum())
        loss += float(F.cross_entropy(logits, y, reduction="sum"))
    model.train(was_training)
    return correct / len(labels), loss / len(labels)


def _prepare(model, config, dataset, teacher):
    """Everything that can fail on bad input, before any weight or file is touched."""
    if not isinstance(config, FinetuneConfig):
        raise TypeError(f"`config` must be a FinetuneConfig, got {type(config).__name__}.")
    if hasattr(model, "peft_config"):
        raise ValueError("The model already carries a PEFT adapter; merge it first (`model.merge_and_unload()`).")
    require_classifier(model, "fine-tuning")
    if dataset is None:
        raise ValueError("Pass `dataset=`: labelled images (a Dataset with `pixel_values` and `labels`, or examples).")
    pixels, labels = load_image_examples(dataset)
    check_labels(model, labels, "fine-tuning")
    text_only = [n for n in ("token_budget", "eval_at_tokens") if getattr(config, n) is not None]
    if text_only or config.streaming:
        raise ValueError(
            f"FinetuneConfig.{', '.join(text_only or ['streaming'])} applies to text (causal LM) fine-tuning; an image "
            "classifier trains for max_steps steps on the labelled images it is given."
        )
    num_labels = model.config.num_labels
    if len(labels) < 2:
        raise ValueError(f"Fine-tuning needs at least 2 labelled images (some are held out), got {len(labels)}.")
    check_images_fit(model, pixels)
    if config.distill is not None:
        if teacher is None:
            raise ValueError("FinetuneConfig.distill needs a teacher: pass `teacher=` (the unpruned model).")
        if getattr(teacher.config, "num_labels", None) != num_labels:
            raise ValueError(
                f"The distillation teacher has {getattr(teacher.config, 'num_labels', None)} classes, the student "
                f"{num_labels}: distillation compares their logits class by class (use the unpruned source model)."
            )
        check_hidden_teacher(model, teacher, config)
    targets = lora_target_modules(model, config.target_modules) if config.method == "lora" else None
    train_idx, eval_idx = split_indices(len(labels), config.eval_fraction, config.seed)
    train_idx, eval_idx = torch.as_tensor(train_idx), torch.as_tensor(eval_idx)
    args = training_arguments(config, config.output_dir or tempfile.gettempdir())
    return targets, (pixels[train_idx], labels[train_idx]), (pixels[eval_idx], labels[eval_idx]), args


def finetune_images_(
    model: nn.Module,
    config: FinetuneConfig,
    dataset: Any,
    *,
    teacher: nn.Module | None = None,
    callbacks: list | None = None,
) -> tuple[nn.Module, FinetuneReport]:
    """`finetune_` for image classifiers: see `optimum_prune.finetune_` (called by it for image models).

    `config.eval_fraction` of the labelled images is held out (seeded) for the accuracy and loss before / after;
    the rest is the training set. Under LoRA the classifier head is trained fully (`modules_to_save`).
    """
    targets, (train_x, train_y), (eval_x, eval_y), args = _prepare(model, config, dataset, teacher)
    masks = sparsity_masks(model) if config.keep_sparsity else {}
    acc_before, loss_before = evaluate_classifier(model, eval_x, eval_y, config.batch_size)
    logger.info("Held-out accuracy before fine-tuning: %.4f (%d masked projections)", acc_before, len(masks))
    history = list(getattr(model, FINETUNE_ATTR, []))
    model, run = train_model(
        model, config, LabelledImages(train_x, train_y), args, targets, masks, teacher, callbacks, None,
        modules_to_save=list(CLASSIFIER_MODULES),
    )  # fmt: skip
    acc_after, loss_after = evaluate_classifier(model, eval_x, eval_y, config.batch_size)
    report = FinetuneReport(
        config=config.to_dict(),
        perplexity_before=None,
        perplexity_after=None,
        train_documents=len(train_y),
        eval_documents=len(eval_y),
        train_tokens=0,
        tokens_seen=0,
        **run["report"],
        data={
            "images": len(train_y) + len(eval_y),
            "image_shape": list(train_x.shape[1:]),
            "images_seen": run["steps"] * config.batch_size * config.gradient_accumulation_steps,
        },  # fmt: skip
        accuracy_before=acc_before,
        accuracy_after=acc_after,
        eval_loss_before=loss_before,
        eval_loss_after=loss_after,
        eval_examples=len(eval_y),
    )
    record_finetune_(model, config, history, report)
    return model, report
