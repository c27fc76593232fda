"""The training engine both recovery paths (`trainer.finetune_` for causal LMs, `images.finetune_images_` for image
classifiers) run on: LoRA (masked where the model is sparse) or full training on `transformers.Trainer`, optional KL
distillation from a teacher, and the fine-tuning history recorded on the model."""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import Trainer, TrainingArguments, default_data_collator

from ..modeling.architectures import get_spec
from ..utils.training import build_training_arguments, quiet
from .config import FINETUNE_ATTR, FinetuneConfig, FinetuneReport
from .sparsity import SparsityCallback, check_masks, mask_lora_, merge_masked_

__all__ = [
    "DistillationTrainer",
    "lora_target_modules",
    "check_teacher",
    "training_arguments",
    "train_model",
    "record_finetune_",
]

logger = logging.getLogger(__name__)


class DistillationTrainer(Trainer):
    """A `Trainer` whose loss is `alpha · T² · KL(teacher_T ‖ student_T) + (1 − alpha) · LM loss`, plus
    `hidden_weight · hidden_state_loss` when that weight is positive.

    The teacher runs without gradients on `teacher_device`; its outputs are moved to the student's device. All
    terms are per-batch token means (the Trainer divides them by the gradient accumulation steps).
    """

    loss_is_scaled_for_ga = False

    def __init__(
        self,
        *args: Any,
        teacher: nn.Module,
        temperature: float = 2.0,
        alpha: float = 0.5,
        hidden_weight: float = 0.0,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self.teacher = teacher.eval()
        for p in self.teacher.parameters():
            p.requires_grad_(False)
        self.temperature, self.alpha, self.hidden_weight = temperature, alpha, hidden_weight

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        hidden = self.hidden_weight > 0
        outputs = model(**inputs, output_hidden_states=hidden)
        teacher_device = next(self.teacher.parameters()).device
        with torch.no_grad():
            t_inputs = {k: v.to(teacher_device) for k, v in inputs.items() if k != "labels"}
            t_out = self.teacher(**t_inputs, output_hidden_states=hidden)
            t_logits = t_out.logits.to(outputs.logits.device)  # (B, L, V)
        t = self.temperature
        s_logp = F.log_softmax(outputs.logits.float() / t, dim=-1)  # (B, L, V)
        t_logp = F.log_softmax(t_logits.float() / t, dim=-1)  # (B, L, V)
        kl = F.kl_div(s_logp, t_logp, log_target=True, reduction="none").sum(-1)  # (B, L)
        mask = inputs.get("attention_mask")
        kl = (kl * mask).sum() / mask.sum() if mask is not None else kl.mean()
        loss = self.alpha * t * t * kl
        if self.alpha < 1:
            loss = loss + (1 - self.alpha) * outputs.loss
        if hidden:
            t_hidden = [h.to(outputs.logits.device) for h in t_out.hidden_states[1:]]
            loss = loss + self.hidden_weight * hidden_state_loss(outputs.hidden_states[1:], t_hidden, mask)
        return (loss, outputs) if return_outputs else loss


def hidden_state_loss(student: Sequence[torch.Tensor], teacher: Sequence[torch.Tensor], mask=None) -> torch.Tensor:
    """Mean over layers and (unmasked) tokens of `‖h_s − h_t‖² / ‖h_t‖²`: each layer output's relative squared
    error against the teacher's, per token, so the few tokens with very large activations do not dominate."""
    per_layer = []
    for hs, ht in zip(student, teacher, strict=True):
        err = (hs.float() - ht.float()).pow(2).sum(-1) / ht.float().pow(2).sum(-1).clamp_min(1e-12)  # (B, L)
        per_layer.append((err * mask).sum() / mask.sum() if mask is not None else err.mean())
    return torch.stack(per_layer).mean()


def check_hidden_teacher(model: nn.Module, teacher: nn.Module, config: FinetuneConfig) -> None:
    """Hidden-state distillation matches layer to layer: the teacher needs the student's depth and width."""
    if config.distill is None or config.distill_hidden_weight == 0:
        return
    shape = [(getattr(m.config, "num_hidden_layers", None), getattr(m.config, "hidden_size", None))
             for m in (model, teacher)]  # fmt: skip
    if shape[0] != shape[1] or None in shape[0]:
        raise ValueError(
            f"FinetuneConfig.distill_hidden_weight > 0 compares every layer's output with the teacher's, but the "
            f"student has (layers, hidden size) {shape[0]} and the teacher {shape[1]}. Use distill_hidden_weight=0 "
            "(logit distillation) for a model whose layers or hidden size were pruned."
        )


def lora_target_modules(model: nn.Module, requested: tuple[str, ...] | None) -> list[str]:
    """Projection names LoRA adapts: every prunable projection by default; requested names must exist."""
    spec = get_spec(model)
    default = [p.rsplit(".", 1)[-1] for p in spec.linear_paths]
    if requested is None:
        return default
    leaves = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    missing = sorted(set(requested) - leaves)
    if missing:
        raise ValueError(
            f"LoRA target_modules {missing} are not linear layers of this model; it has {sorted(leaves)} "
            f"(the prunable projections are {default}). Fix FinetuneConfig.target_modules."
        )
    return list(requested)


def check_teacher(model: nn.Module, teacher: nn.Module) -> None:
    vs, vt = model.get_output_embeddings().weight.shape[0], teacher.get_output_embeddings().weight.shape[0]
    if vs != vt:
        raise ValueError(
            f"The distillation teacher's vocabulary ({vt}) differs from the student's ({vs}); distillation compares "
            "logits token by token, so the teacher must share the tokenizer (use the unpruned source model)."
        )


def _teacher_device(model: nn.Module, teacher: nn.Module, requested: str | None) -> torch.device:
    if requested is not None:
        return torch.device(requested)
    device = next(model.parameters()).device
    if device.type == "cuda":
        need = sum(p.numel() * p.element_size() for p in teacher.parameters())
        free, _ = torch.cuda.mem_get_info(device)
        if free < 1.5 * need:
            logger.info("Teacher kept on the CPU: %.1f GB needed, %.1f GB free on %s", need / 1e9, free / 1e9, device)
            return torch.device("cpu")
    return device


def training_arguments(config: FinetuneConfig, output_dir: str) -> TrainingArguments:
    kwargs = {
        "output_dir": output_dir,
        "max_steps": config.max_steps,
        "per_device_train_batch_size": config.batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "learning_rate": config.learning_rate,
        "lr_scheduler_type": config.lr_scheduler_type,
        "warmup_steps": config.warmup_steps,
        "weight_decay": config.weight_decay,
        "logging_steps": max(1, min(10, config.max_steps // 10)),
        "seed": config.seed,
        "data_seed": config.seed,
    }
    return build_training_arguments(kwargs, config.training_args, "FinetuneConfig")


def train_model(model, config, train_ds, args, targets, masks, teacher, callbacks, task_type, modules_to_save=None):
    """The training shared by every modality: LoRA (masked where the model is sparse) or full, optional distillation,
    on `transformers.Trainer`; then LoRA merged (masked) unless `config.merge` is off. Returns `(model, run)` with
    `run` holding the optimizer `steps` and the `FinetuneReport` fields every modality shares (`report`)."""
    student = model
    if config.method == "lora":
        lora = LoraConfig(
            r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
            target_modules=targets, task_type=task_type, modules_to_save=modules_to_save,
        )  # fmt: skip
        student = get_peft_model(model, lora)
        if masks:
            logger.info("LoRA updates masked on %d sparse projections", mask_lora_(student, masks))
    else:
        for p in student.parameters():
            p.requires_grad_(True)
    trainable = sum(p.numel() for p in student.parameters() if p.requires_grad)
    cb = list(callbacks or [])
    if masks:
        cb.append(SparsityCallback(student, masks))
    teacher_info = None
    kwargs = {"model": student, "args": args, "train_dataset": train_ds, "data_collator": default_data_collator}
    with contextlib.ExitStack() as stack:
        if config.output_dir is None:
            args.output_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="optimum_prune_ft_"))
        if config.distill is not None:
            device = _teacher_device(model, teacher, config.teacher_device)
            teacher.to(device)
            teacher_info = {"source": getattr(teacher, "_optimum_prune_source", "given"), "device": str(device)}
            trainer = DistillationTrainer(
                **kwargs, callbacks=cb, teacher=teacher, temperature=config.distill_temperature,
                alpha=config.distill_alpha, hidden_weight=config.distill_hidden_weight,
            )  # fmt: skip
        else:
            trainer = Trainer(**kwargs, callbacks=cb)
        quiet(trainer)
        t0 = time.perf_counter()
        result = trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
        evaluating = sum(getattr(c, "eval_s", 0.0) for c in cb)  # callbacks' evaluations (`TokenCheckpoints`)
        runtime = time.perf_counter() - t0 - evaluating
    losses = [{"step": h["step"], "loss": h["loss"]} for h in trainer.state.log_history if "loss" in h]
    merged = False
    if config.method == "lora" and config.merge:
        model = merge_masked_(student, masks)
        merged = True
    elif config.method == "lora":
        model = student
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    report_fields = {
        "trainable_params": trainable, "train_loss": float(result.training_loss), "train_runtime_s": runtime,
        "checkpoint_eval_s": evaluating, "loss_history": losses, "teacher": teacher_info, "merged": merged,
        "sparsity_kept": check_masks(model, masks) if masks else None,
    }  # fmt: skip
    return model, {"steps": trainer.state.global_step, "report": report_fields}


def record_finetune_(model: nn.Module, config: FinetuneConfig, history: list, report: FinetuneReport) -> None:
    """Append the report to the model's fine-tuning history; a merged / fully trained model is plain again."""
    setattr(model, FINETUNE_ATTR, [*history, report.to_dict()])
    if report.merged or config.method == "full":
        for p in model.parameters():
            p.requires_grad_(True)  # a plain model again, as transformers loads it
    logger.info("%s", report)
