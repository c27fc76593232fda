"""`finetune_`: recovery training of a pruned model on `transformers.Trainer` (PEFT LoRA or full, optional KL
distillation), with held-out perplexity before and after."""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from ..calibration.data import DOCUMENT_SEPARATOR, load_texts, split_documents
from ..evaluation.perplexity import perplexity
from ..modeling.architectures import get_spec, is_image_model
from .config import FINETUNE_ATTR, FinetuneConfig, FinetuneReport
from .sparsity import SparsityCallback, check_masks, mask_lora_, merge_masked_, sparsity_masks

__all__ = ["finetune_", "DistillationTrainer", "training_windows", "lora_target_modules"]

logger = logging.getLogger(__name__)


class DistillationTrainer(Trainer):
    """A `Trainer` whose loss is `alpha · T² · KL(teacher_T ‖ student_T) + (1 − alpha) · LM loss`.

    The teacher runs without gradients on `teacher_device`; its logits are moved to the student's device. Both
    losses are per-batch token means (the Trainer divides them by the gradient accumulation steps).
    """

    loss_is_scaled_for_ga = False

    def __init__(self, *args: Any, teacher: nn.Module, temperature: float = 2.0, alpha: float = 0.5, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.teacher = teacher.eval()
        for p in self.teacher.parameters():
            p.requires_grad_(False)
        self.temperature, self.alpha = temperature, alpha

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        teacher_device = next(self.teacher.parameters()).device
        with torch.no_grad():
            t_inputs = {k: v.to(teacher_device) for k, v in inputs.items() if k != "labels"}
            t_logits = self.teacher(**t_inputs).logits.to(outputs.logits.device)  # (B, L, V)
        t = self.temperature
        s_logp = F.log_softmax(outputs.logits.float() / t, dim=-1)  # (B, L, V)
        t_logp = F.log_softmax(t_logits.float() / t, dim=-1)  # (B, L, V)
        kl = F.kl_div(s_logp, t_logp, log_target=True, reduction="none").sum(-1)  # (B, L)
        mask = inputs.get("attention_mask")
        kl = (kl * mask).sum() / mask.sum() if mask is not None else kl.mean()
        loss = self.alpha * t * t * kl
        if self.alpha < 1:
            loss = loss + (1 - self.alpha) * outputs.loss
        return (loss, outputs) if return_outputs else loss


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


def _quiet(trainer: Trainer) -> Trainer:
    """Library code never prints: swap Trainer's printing callbacks for a tqdm bar and `logging`."""
    trainer.remove_callback(PrinterCallback)
    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(_QuietProgress)
    trainer.add_callback(_LossLogger)
    return trainer


def training_windows(docs: list[str], tokenizer: Any, seq_len: int) -> torch.Tensor:
    """The documents joined with `DOCUMENT_SEPARATOR` into one token stream, cut into `(N, seq_len)` windows."""
    separator = tokenizer(DOCUMENT_SEPARATOR, add_special_tokens=False)["input_ids"]
    stream: list[int] = []
    for ids in tokenizer(list(docs), add_special_tokens=False)["input_ids"]:
        if ids:
            stream.extend(separator + ids if stream else ids)
    n = len(stream) // seq_len
    if n == 0:
        raise ValueError(
            f"Training text too short: {len(stream)} tokens in {len(docs)} training documents, but one sequence of "
            f"seq_len={seq_len} needs {seq_len}. Provide more text or lower FinetuneConfig.seq_len."
        )
    return torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)  # (N, L)


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


def _check_teacher(model: nn.Module, teacher: nn.Module) -> None:
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


def _training_arguments(config: FinetuneConfig, output_dir: str) -> TrainingArguments:
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


def _prepare(model, config, dataset, tokenizer, teacher):
    """Everything that can fail on bad input, before any weight or file is touched."""
    if not isinstance(config, FinetuneConfig):
        raise TypeError(f"`config` must be a FinetuneConfig, got {type(config).__name__}.")
    if tokenizer is None:
        raise ValueError("Fine-tuning needs the model's tokenizer: pass `tokenizer=` (AutoPruner loads it for you).")
    if dataset is None:
        raise ValueError("Pass `dataset=`: a text file, a directory of .txt files, a list of strings, or a Dataset.")
    if hasattr(model, "peft_config"):
        raise ValueError(
            "The model already carries a PEFT adapter (fine-tuned with merge=False). Merge it first "
            "(`model = model.merge_and_unload()`, or `merge_adapter`) and fine-tune the plain model."
        )
    get_spec(model)  # raises UnsupportedArchitectureError with the supported list
    targets = lora_target_modules(model, config.target_modules) if config.method == "lora" else None
    docs = load_texts(dataset)
    if len(docs) < 2:
        raise ValueError(
            f"Fine-tuning needs at least 2 documents (some are held out for evaluation), got {len(docs)}. "
            "Split the text into several documents (e.g. a directory of .txt files or a list of strings)."
        )
    train_docs, eval_docs = split_documents(docs, config.eval_fraction, config.seed)
    windows = training_windows(train_docs, tokenizer, config.seq_len)
    vocab = model.get_input_embeddings().weight.shape[0]
    if int(windows.max()) >= vocab:
        raise ValueError(f"Token ids exceed the model's vocabulary ({vocab}); is this the model's tokenizer?")
    eval_ids = tokenizer(DOCUMENT_SEPARATOR.join(eval_docs), return_tensors="pt")["input_ids"][0]
    if eval_ids.numel() < config.seq_len:
        raise ValueError(
            f"Held-out text too short: {eval_ids.numel()} tokens in {len(eval_docs)} held-out documents, fewer than "
            f"one window of seq_len={config.seq_len}. Provide more text, raise eval_fraction or lower seq_len."
        )
    if config.distill is not None:
        if teacher is None:
            raise ValueError(
                "FinetuneConfig.distill needs a teacher: pass `teacher=` (AutoPruner.finetune uses the model as it "
                "was loaded before pruning)."
            )
        _check_teacher(model, teacher)
    args = _training_arguments(config, config.output_dir or tempfile.gettempdir())
    return targets, train_docs, eval_docs, windows, args


def _ppl(model, tokenizer, docs, config) -> float:
    return perplexity(model, tokenizer, docs, seq_len=config.seq_len, max_tokens=config.eval_max_tokens)


def train_model(model, config, train_ds, args, targets, masks, teacher, callbacks, task_type, modules_to_save=None):
    """The training shared by every modality: LoRA (masked where the model is sparse) or full, optional distillation,
    on `transformers.Trainer`; then LoRA merged (masked) unless `config.merge` is off. Returns `(model, run)` with
    `run` holding the optimizer `steps` and the `FinetuneReport` fields every modality shares (`report`)."""
    student = model
    if config.method == "lora":
        from peft import LoraConfig, get_peft_model

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
                alpha=config.distill_alpha,
            )  # fmt: skip
        else:
            trainer = Trainer(**kwargs, callbacks=cb)
        _quiet(trainer)
        t0 = time.perf_counter()
        result = trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
        runtime = time.perf_counter() - t0
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
        "loss_history": losses, "teacher": teacher_info, "merged": merged,
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


def finetune_(
    model: nn.Module,
    config: FinetuneConfig,
    dataset: Any,
    tokenizer: Any,
    *,
    teacher: nn.Module | None = None,
    callbacks: list | None = None,
) -> tuple[nn.Module, FinetuneReport]:
    """Recovery fine-tuning of a (pruned) model on `transformers.Trainer`.

    Args:
        model (`PreTrainedModel`): the model; trained in place (`"full"`, or LoRA merged back into it).
        config (`FinetuneConfig`): what to run.
        dataset (`str | list[str] | datasets.Dataset`): the documents, any source `CalibrationConfig.dataset`
            accepts; `config.eval_fraction` of them is held out for the perplexity before / after. For an image
            classifier: labelled images (a `datasets.Dataset` with `pixel_values` and `labels`, a list of
            `{"pixel_values", "labels"}` examples), cross-entropy training, accuracy before / after.
        tokenizer (`PreTrainedTokenizerBase`): the model's tokenizer (unused for image models).
        teacher (`PreTrainedModel | None`): distillation teacher (same vocabulary), needed when `config.distill`.
        callbacks (`list[TrainerCallback] | None`): extra Trainer callbacks.

    Returns:
        `(model, FinetuneReport)`: the trained model (with `merge=False` under LoRA: the `PeftModel`) and the report,
        also appended to the model's fine-tuning history (saved in `pruning_config.json`). All validation happens
        before training; on an error the model is unchanged.
    """
    if is_image_model(model):
        from .images import finetune_images_

        return finetune_images_(model, config, dataset, teacher=teacher, callbacks=callbacks)
    targets, train_docs, eval_docs, windows, args = _prepare(model, config, dataset, tokenizer, teacher)
    import datasets

    masks = sparsity_masks(model) if config.keep_sparsity else {}
    ppl_before = _ppl(model, tokenizer, eval_docs, config)
    logger.info("Held-out perplexity before fine-tuning: %.3f (%d masked projections)", ppl_before, len(masks))
    train_ds = datasets.Dataset.from_dict({"input_ids": windows.tolist(), "labels": windows.tolist()})
    train_ds.set_format("torch")
    history = list(getattr(model, FINETUNE_ATTR, []))
    model, run = train_model(model, config, train_ds, args, targets, masks, teacher, callbacks, "CAUSAL_LM")
    ppl_after = _ppl(model, tokenizer, eval_docs, config)
    report = FinetuneReport(
        config=config.to_dict(),
        perplexity_before=ppl_before,
        perplexity_after=ppl_after,
        train_documents=len(train_docs),
        eval_documents=len(eval_docs),
        train_tokens=windows.numel(),
        tokens_seen=run["steps"] * config.batch_size * config.gradient_accumulation_steps * config.seq_len,
        **run["report"],
        eval_tokens=min(config.eval_max_tokens or 1 << 62, _count_tokens(tokenizer, eval_docs)),
        data={"documents": len(train_docs) + len(eval_docs)},
    )
    record_finetune_(model, config, history, report)
    return model, report


def _count_tokens(tokenizer: Any, docs: list[str]) -> int:
    return len(tokenizer(DOCUMENT_SEPARATOR.join(docs))["input_ids"])
