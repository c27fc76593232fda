"""`FinetuneConfig` (what recovery training to run) and `FinetuneReport` (what it measured)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from ..constants import FINETUNE_ATTR
from .budgets import WARMUP_FRACTION, recipe_for_budget

__all__ = ["FinetuneConfig", "FinetuneReport", "FINETUNE_ATTR"]


def _positive_int(name: str, value: Any, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"FinetuneConfig.{name} must be an int >= {minimum}, got {value!r}.")


def _number(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    if not ok:
        lb, rb = "(" if lo_open else "[", ")" if hi_open else "]"
        raise ValueError(f"FinetuneConfig.{name} must be a number in {lb}{lo}, {hi}{rb}, got {value!r}.")


@dataclass
class FinetuneConfig:
    """Recovery fine-tuning of a pruned model on `transformers.Trainer`.

    Causal LMs train on text with the LM loss and report held-out perplexity; image classifiers (ViT, DeiT, Dinov2)
    train on labelled images with cross-entropy and report held-out accuracy (`seq_len` and `eval_max_tokens` do not
    apply; `batch_size` counts images; `eval_fraction` of the examples is held out).

    Args:
        method (`str`, defaults to `"lora"`): `"lora"` (PEFT LoRA on every prunable projection, whatever its
            per-layer pruned shape) or `"full"` (every parameter trained).
        max_steps (`int`, defaults to `200`): optimizer steps (derived from `token_budget` when that is set).
        token_budget (`int | None`, defaults to `None`): training tokens to run instead of a step count: `max_steps`
            becomes `ceil(token_budget / (batch_size · gradient_accumulation_steps · seq_len))`.
            `FinetuneConfig.for_budget(tokens)` gives the recipe measured best at that budget.
        eval_at_tokens (`tuple[int, ...] | None`, defaults to `None`): training-token counts at which the held-out
            perplexity is measured during the run (a recovery curve from one run, `FinetuneReport.curve`; the learning
            rate schedule still spans the whole run, so an early point is the model at that moment of a longer run,
            not the end of a shorter one).
        streaming (`bool`, defaults to `False`): read and tokenize the training documents one at a time while training
            (a directory of `.txt` files, a `.jsonl` file, a `datasets.Dataset` or a list), packing them into
            windows in a seeded order that changes every pass, instead of tokenizing the whole text up front; the
            held-out split is by the source's document index (empty documents count and are skipped).
        batch_size (`int`, defaults to `4`): sequences per device and step.
        gradient_accumulation_steps (`int`, defaults to `1`): micro-batches per optimizer step.
        learning_rate (`float`, defaults to `2e-4`): peak learning rate (LoRA; use ~2e-5 for `"full"`).
        seq_len (`int`, defaults to `512`): tokens per training sequence (and per perplexity window).
        warmup_steps (`int`, defaults to `0`): linear warm-up steps; `lr_scheduler_type` (`str`, defaults to
            `"cosine"`) and `weight_decay` (`float`, defaults to `0.0`) are passed to `TrainingArguments`.
        lora_r (`int`, defaults to `16`) / lora_alpha (`int`, defaults to `32`) / lora_dropout (`float`, defaults
            to `0.05`): the PEFT `LoraConfig` values.
        target_modules (`tuple[str, ...] | None`, defaults to `None`): projection names LoRA adapts (e.g.
            `("q_proj", "v_proj")`); `None` = every prunable projection of the architecture.
        merge (`bool`, defaults to `True`): merge LoRA into plain weights at the end (masked, so unstructured / N:M
            zeros stay zero); `False` keeps the PEFT model, and `save_pretrained` then writes the pruned base plus a
            standard PEFT adapter in `adapter/`.
        distill (`str | None`, defaults to `None`): `"kl"` adds knowledge distillation from a teacher (with
            `AutoPruner.finetune`, by default the model as loaded before pruning: reloaded from its path, or the copy
            `AutoPruner(model, keep_teacher=True)` keeps): KL divergence between temperature-softened logits.
        distill_temperature (`float`, defaults to `2.0`): softmax temperature of the KL term (scaled by T²).
        distill_alpha (`float`, defaults to `0.5`): loss = alpha · KL + (1 − alpha) · LM loss; `1.0` is pure KL.
        distill_hidden_weight (`float`, defaults to `0.0`): adds this weight times a hidden-state term: the relative
            squared error `‖h_student − h_teacher‖² / ‖h_teacher‖²` of every layer's output, per token, averaged
            over tokens and layers (needs a teacher with the student's layer count and hidden size, which structured
            width pruning keeps). `0` is logit distillation only.
        teacher_device (`str | None`, defaults to `None`): where the teacher runs; `None` = the student's device
            when it has room for the teacher, else the CPU.
        eval_fraction (`float`, defaults to `0.1`): fraction of the documents held out (never trained on) for the
            perplexity measured before and after training.
        eval_max_tokens (`int | None`, defaults to `16384`): held-out tokens scored (`None`: all).
        keep_sparsity (`bool`, defaults to `True`): keep every zero of an unstructured / N:M model at zero
            (`SparsityCallback`, masked LoRA and masked merge).
        seed (`int`, defaults to `0`): data split, sampling and training seed.
        output_dir (`str | None`, defaults to `None`): Trainer output (checkpoints, logs); `None` = a temporary
            directory removed afterwards.
        resume_from_checkpoint (`str | bool | None`, defaults to `None`): passed to `Trainer.train`.
        training_args (`dict`, defaults to `{}`): any other `TrainingArguments` (e.g. `bf16`, `save_steps`,
            `gradient_checkpointing`, `logging_steps`); they override the values derived above.
    """

    method: str = "lora"
    max_steps: int = 200
    token_budget: int | None = None
    eval_at_tokens: tuple[int, ...] | None = None
    streaming: bool = False
    batch_size: int = 4
    gradient_accumulation_steps: int = 1
    learning_rate: float = 2e-4
    seq_len: int = 512
    warmup_steps: int = 0
    lr_scheduler_type: str = "cosine"
    weight_decay: float = 0.0
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    target_modules: tuple[str, ...] | None = None
    merge: bool = True
    distill: str | None = None
    distill_temperature: float = 2.0
    distill_alpha: float = 0.5
    distill_hidden_weight: float = 0.0
    teacher_device: str | None = None
    eval_fraction: float = 0.1
    eval_max_tokens: int | None = 16384
    keep_sparsity: bool = True
    seed: int = 0
    output_dir: str | None = None
    resume_from_checkpoint: str | bool | None = None
    training_args: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method not in ("lora", "full"):
            raise ValueError(f"FinetuneConfig.method must be 'lora' or 'full', got {self.method!r}.")
        if isinstance(self.max_steps, int) and not isinstance(self.max_steps, bool) and self.max_steps <= 0:
            raise ValueError(f"FinetuneConfig.max_steps must be > 0 (optimizer steps to run), got {self.max_steps}.")
        for name in ("max_steps", "batch_size", "gradient_accumulation_steps", "lora_r", "lora_alpha"):
            _positive_int(name, getattr(self, name))
        _positive_int("seq_len", self.seq_len, 2)
        if self.token_budget is not None:
            _positive_int("token_budget", self.token_budget)
            steps = -(-self.token_budget // self.tokens_per_step)
            if self.max_steps not in (200, steps):
                raise ValueError(
                    f"FinetuneConfig: token_budget={self.token_budget} gives max_steps={steps} (batch_size x "
                    f"gradient_accumulation_steps x seq_len = {self.tokens_per_step} tokens per step), but "
                    f"max_steps={self.max_steps} was also given; pass one of them."
                )
            self.max_steps = steps
        if self.eval_at_tokens is not None:
            points = (self.eval_at_tokens,) if isinstance(self.eval_at_tokens, int) else tuple(self.eval_at_tokens)
            if not points or not all(isinstance(t, int) and not isinstance(t, bool) and t > 0 for t in points):
                raise ValueError(
                    f"FinetuneConfig.eval_at_tokens must be positive token counts, got {self.eval_at_tokens!r}."
                )
            self.eval_at_tokens = tuple(sorted(set(points)))
        if not isinstance(self.streaming, bool):
            raise ValueError(f"FinetuneConfig.streaming must be True or False, got {self.streaming!r}.")
        _positive_int("warmup_steps", self.warmup_steps, 0)
        _positive_int("seed", self.seed, 0)
        _number("learning_rate", self.learning_rate, 0.0, 1.0, lo_open=True)
        _number("weight_decay", self.weight_decay, 0.0, 1.0)
        _number("lora_dropout", self.lora_dropout, 0.0, 1.0, hi_open=True)
        _number("distill_temperature", self.distill_temperature, 0.0, math.inf, lo_open=True, hi_open=True)
        _number("distill_alpha", self.distill_alpha, 0.0, 1.0)
        _number("distill_hidden_weight", self.distill_hidden_weight, 0.0, math.inf, hi_open=True)
        _number("eval_fraction", self.eval_fraction, 0.0, 1.0, lo_open=True, hi_open=True)
        if self.eval_max_tokens is not None:
            _positive_int("eval_max_tokens", self.eval_max_tokens, 2)
        if self.distill not in (None, "kl"):
            raise ValueError(f"FinetuneConfig.distill must be None or 'kl', got {self.distill!r}.")
        if self.distill_hidden_weight > 0 and self.distill is None:
            raise ValueError(
                "FinetuneConfig.distill_hidden_weight > 0 distills hidden states from a teacher: set distill='kl' "
                "too (distill_alpha=0 keeps the LM loss and the hidden-state term only)."
            )
        if self.target_modules is not None:
            if isinstance(self.target_modules, str):
                self.target_modules = (self.target_modules,)
            if not self.target_modules or not all(isinstance(t, str) and t for t in self.target_modules):
                raise ValueError(
                    f"FinetuneConfig.target_modules must be projection names, got {self.target_modules!r}."
                )
            self.target_modules = tuple(self.target_modules)
        if not isinstance(self.training_args, dict):
            raise ValueError("FinetuneConfig.training_args must be a dict of TrainingArguments fields.")
        if isinstance(self.output_dir, os.PathLike):
            self.output_dir = os.fspath(self.output_dir)

    @classmethod
    def for_budget(cls, token_budget: int, *, distill: bool = True, **overrides: Any) -> FinetuneConfig:
        """The recovery recipe measured best at this token budget (`finetune.budgets.BUDGET_RECIPES`: the nearest
        measured budget on a log scale), its warm-up `WARMUP_FRACTION` of the steps; `distill=False` when no teacher
        is at hand (the best recipe without distillation); `overrides` are any other fields and win.

        ```python
        config = FinetuneConfig.for_budget(262_144, streaming=True)
        ```
        """
        fields = recipe_for_budget(token_budget, distill=distill)
        fields.update(overrides, token_budget=token_budget)
        if "warmup_steps" not in overrides:
            per_step = fields["batch_size"] * fields.get("gradient_accumulation_steps", 1) * fields["seq_len"]
            fields["warmup_steps"] = max(1, round(WARMUP_FRACTION * -(-token_budget // per_step)))
        return cls.from_dict(fields)

    @property
    def tokens_per_step(self) -> int:
        """Training tokens per optimizer step (on one device)."""
        return self.batch_size * self.gradient_accumulation_steps * self.seq_len

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self), default=str))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FinetuneConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"Unknown FinetuneConfig field(s) {unknown}; valid: {sorted(names)}.")
        data = dict(data)
        for name in ("target_modules", "eval_at_tokens"):
            if isinstance(data.get(name), list):
                data[name] = tuple(data[name])
        return cls(**data)


@dataclass
class FinetuneReport:
    """Result of one `finetune_` call.

    Args:
        config (`dict`): the applied `FinetuneConfig`.
        perplexity_before / perplexity_after (`float | None`): held-out perplexity (windows of `seq_len`); `None`
            for an image classifier, which reports `accuracy_before` / `accuracy_after` and `eval_loss_before` /
            `eval_loss_after` (mean cross-entropy) on `eval_examples` held-out images instead.
        train_documents / eval_documents (`int`): documents in each part of the split.
        train_tokens (`int | None`): distinct training tokens available (`None` when streaming: not counted);
            `tokens_seen` (`int`): tokens trained on.
        trainable_params (`int`): parameters the optimizer updated.
        train_loss (`float`): mean training loss reported by the Trainer; `loss_history` (`list`): logged losses.
        train_runtime_s (`float`): wall-clock training time (without `checkpoint_eval_s`).
        checkpoint_eval_s (`float`): wall-clock time of the evaluations at `eval_at_tokens` during the run.
        teacher (`dict | None`): where the distillation teacher came from.
        sparsity_kept (`bool | None`): masked projections checked after training (`None`: the model had none).
        merged (`bool`): LoRA merged into the weights.
        curve (`list[dict]`): with `eval_at_tokens`, one `{"tokens", "step", "perplexity", "elapsed_s"}` per point
            (and the end of the run); empty otherwise.
    """

    config: dict
    perplexity_before: float
    perplexity_after: float
    train_documents: int
    eval_documents: int
    train_tokens: int | None
    tokens_seen: int
    trainable_params: int
    train_loss: float
    train_runtime_s: float
    checkpoint_eval_s: float = 0.0
    loss_history: list = field(default_factory=list)
    teacher: dict | None = None
    sparsity_kept: bool | None = None
    merged: bool = False
    eval_tokens: int = 0
    data: dict | None = None
    accuracy_before: float | None = None
    accuracy_after: float | None = None
    eval_loss_before: float | None = None
    eval_loss_after: float | None = None
    eval_examples: int = 0
    curve: list = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        if self.accuracy_before is not None:
            metric = f"accuracy {self.accuracy_before:.4f} -> {self.accuracy_after:.4f}"
        else:
            metric = f"ppl {self.perplexity_before:.2f} -> {self.perplexity_after:.2f}"
        return (
            f"FinetuneReport(method={self.config.get('method')!r}, distill={self.config.get('distill')!r}, "
            f"steps={self.config.get('max_steps')}, {metric}, {self.train_runtime_s:.0f}s)"
        )
