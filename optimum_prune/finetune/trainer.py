"""`finetune_`: recovery training of a pruned model on `transformers.Trainer` (PEFT LoRA or full, optional KL
distillation), with held-out perplexity before and after; image classifiers go to `images.finetune_images_`. Both
run on `engine`."""

from __future__ import annotations

import logging
import tempfile
from typing import Any

import datasets
import torch
from torch import nn

from ..calibration.corpora import split_indices
from ..calibration.data import DOCUMENT_SEPARATOR, load_texts, split_documents
from ..evaluation.perplexity import perplexity
from ..modeling.architectures import get_spec, is_image_model
from .config import FINETUNE_ATTR, FinetuneConfig, FinetuneReport
from .engine import (
    check_hidden_teacher,
    check_teacher,
    lora_target_modules,
    record_finetune_,
    train_model,
    training_arguments,
)
from .images import finetune_images_
from .progress import TokenCheckpoints, TokenProgress
from .sparsity import sparsity_masks
from .stream import DocumentIndex, TokenWindows, first_window

__all__ = ["finetune_", "training_windows"]

logger = logging.getLogger(__name__)


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
    if config.streaming:
        train_docs, eval_docs, windows, first, held_out = _streamed(config, dataset, tokenizer)
    else:
        docs = load_texts(dataset)
        if len(docs) < 2:
            raise ValueError(
                f"Fine-tuning needs at least 2 documents (some are held out for evaluation), got {len(docs)}. "
                "Split the text into several documents (e.g. a directory of .txt files or a list of strings)."
            )
        train_docs, eval_docs = split_documents(docs, config.eval_fraction, config.seed, shuffle_held_out=False)
        windows = first = training_windows(train_docs, tokenizer, config.seq_len)
        held_out = len(eval_docs)
    vocab = model.get_input_embeddings().weight.shape[0]
    if int(first.max()) >= vocab:
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
        check_teacher(model, teacher)
        check_hidden_teacher(model, teacher, config)
    args = training_arguments(config, config.output_dir or tempfile.gettempdir())
    return targets, train_docs, eval_docs, windows, args, held_out, eval_ids.numel()


def _streamed(config: FinetuneConfig, dataset: Any, tokenizer: Any):
    """`(train_indices, eval_docs, windows, first_window, held_out)` of a streamed source: of its `held_out` held-out
    documents those read (enough for `eval_max_tokens`), the training ones left in the source."""
    docs = DocumentIndex(dataset)
    if len(docs) < 2:
        raise ValueError(
            f"Fine-tuning needs at least 2 documents (some are held out for evaluation), got {len(docs)}. "
            "Split the text into several documents (e.g. a directory of .txt files or a jsonl file)."
        )
    train_idx, eval_idx = split_indices(len(docs), config.eval_fraction, config.seed)
    eval_docs, tokens = [], 0
    for i in eval_idx:
        text = docs[i]
        if text.strip():
            eval_docs.append(text)
            tokens += len(tokenizer(text, add_special_tokens=False)["input_ids"])
            if config.eval_max_tokens is not None and tokens >= config.eval_max_tokens + config.seq_len:
                break
    windows = TokenWindows(docs, train_idx, tokenizer, config.seq_len, seed=config.seed)
    first = first_window(windows)
    if first is None:
        raise ValueError(
            f"Training text too short: the {len(train_idx)} training documents do not fill one sequence of "
            f"seq_len={config.seq_len} tokens. Provide more text or lower FinetuneConfig.seq_len."
        )
    return train_idx, eval_docs, windows, first, len(eval_idx)


def _ppl(model, tokenizer, docs, config) -> float:
    return perplexity(model, tokenizer, docs, seq_len=config.seq_len, max_tokens=config.eval_max_tokens)


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
        return finetune_images_(model, config, dataset, teacher=teacher, callbacks=callbacks)
    targets, train_docs, eval_docs, windows, args, held_out, eval_tokens = _prepare(
        model, config, dataset, tokenizer, teacher
    )
    masks = sparsity_masks(model) if config.keep_sparsity else {}
    ppl_before = _ppl(model, tokenizer, eval_docs, config)
    logger.info("Held-out perplexity before fine-tuning: %.3f (%d masked projections)", ppl_before, len(masks))
    if config.streaming:
        train_ds = windows
    else:
        train_ds = datasets.Dataset.from_dict({"input_ids": windows.tolist(), "labels": windows.tolist()})
        train_ds.set_format("torch")
    history = list(getattr(model, FINETUNE_ATTR, []))
    cbs = [*(callbacks or []), TokenProgress(config.tokens_per_step)]
    curve = None
    if config.eval_at_tokens:
        curve = TokenCheckpoints(
            config.eval_at_tokens, config.tokens_per_step, lambda m: {"perplexity": _ppl(m, tokenizer, eval_docs, config)}
        )  # fmt: skip
        cbs.append(curve)
    model, run = train_model(model, config, train_ds, args, targets, masks, teacher, cbs, "CAUSAL_LM")
    ppl_after = _ppl(model, tokenizer, eval_docs, config)
    report = FinetuneReport(
        config=config.to_dict(),
        perplexity_before=ppl_before,
        perplexity_after=ppl_after,
        train_documents=len(train_docs),
        eval_documents=held_out,
        train_tokens=None if config.streaming else windows.numel(),
        tokens_seen=run["steps"] * config.batch_size * config.gradient_accumulation_steps * config.seq_len,
        **run["report"],
        eval_tokens=min(config.eval_max_tokens or 1 << 62, eval_tokens),
        data={"documents": len(train_docs) + held_out, "streaming": config.streaming},
        curve=curve.points if curve is not None else [],
    )
    record_finetune_(model, config, history, report)
    return model, report
