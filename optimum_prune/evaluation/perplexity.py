"""Perplexity with the SparseGPT/Wanda protocol (non-overlapping windows over one joined token stream)."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..calibration.data import load_texts
from ..modeling.architectures import require_causal_lm

__all__ = ["perplexity"]

logger = logging.getLogger(__name__)


def perplexity(
    model: torch.nn.Module,
    tokenizer: Any,
    texts: Any,
    seq_len: int = 2048,
    max_tokens: int | None = None,
    batch_size: int = 1,
    device: str | torch.device | None = None,
    *,
    split: str = "test",
    text_column: str = "text",
) -> float:
    """Perplexity of a causal LM on a text, with the protocol of SparseGPT/Wanda.

    The documents are joined with `"\\n\\n"` and tokenized once (with the tokenizer's default special tokens, so a
    Llama-style tokenizer puts one BOS at the very start). The stream is cut into `len // seq_len` non-overlapping
    windows of `seq_len` tokens (the incomplete tail is dropped); in every window each of the `seq_len - 1`
    next-token predictions is scored. PPL = exp(mean token NLL over all windows), accumulated in float64.

    Args:
        model (`PreTrainedModel`): a causal LM returning `.logits`. It is put in `eval()` mode and, when `device`
            is given, moved there.
        tokenizer (`PreTrainedTokenizerBase`): the model's tokenizer.
        texts (`list[str] | str | os.PathLike | datasets.Dataset`): the documents, or anything [`load_texts`]
            accepts (a file, a directory, a dataset name); a bare string is a path or name, not text. Empty documents
            are kept, so `"wikitext2"` reproduces the reference join of the WikiText-2 test split. For `"c4"` note that
            the Wanda code joins the first 1,100 validation documents with `" "` and keeps `256 * seq_len` tokens
            (use `max_tokens`); here the join is always `"\\n\\n"`.
        seq_len (`int`, *optional*, defaults to `2048`): window length in tokens.
        max_tokens (`int`, *optional*): evaluate only the first `max_tokens` tokens of the stream.
        batch_size (`int`, *optional*, defaults to `1`): windows per forward pass.
        device (`str | torch.device`, *optional*): where to run; defaults to the device of the model's parameters.
        split (`str`, *optional*, defaults to `"test"`): split used when `texts` names a dataset.
        text_column (`str`, *optional*, defaults to `"text"`): text column of a dataset / JSONL source.

    Returns:
        `float`: the perplexity.

    Raises:
        `ValueError`: fewer than `seq_len` tokens (one window) to evaluate.
    """
    require_causal_lm(model, "Perplexity")
    if seq_len < 2 or batch_size < 1:
        raise ValueError(f"seq_len must be >= 2 and batch_size >= 1, got {seq_len} and {batch_size}.")
    docs = load_texts(texts, split=split, text_column=text_column, drop_empty=False)
    input_ids = tokenizer("\n\n".join(docs), return_tensors="pt")["input_ids"][0]  # (T,)
    if max_tokens is not None:
        input_ids = input_ids[:max_tokens]
    n_windows = input_ids.numel() // seq_len
    if n_windows == 0:
        raise ValueError(
            f"Perplexity needs at least seq_len={seq_len} tokens (one window), but only {input_ids.numel()} tokens "
            f"{'remain after max_tokens' if max_tokens is not None else 'were found'}. "
            "Provide more text, raise max_tokens, or use a smaller seq_len."
        )
    windows = input_ids[: n_windows * seq_len].view(n_windows, seq_len)  # (N, L)
    if device is not None:
        model.to(device)
    device = torch.device(device) if device is not None else _input_device(model)
    model.eval()
    nll_sum, count = 0.0, 0
    with torch.no_grad():
        for start in tqdm(range(0, n_windows, batch_size), desc="perplexity", unit="batch", leave=False):
            batch = windows[start : start + batch_size].to(device)  # (B, L)
            logits = model(input_ids=batch, use_cache=False).logits  # (B, L, V)
            for row_logits, row in zip(logits, batch):  # one row at a time keeps the float32 copy small
                nll = F.cross_entropy(row_logits[:-1].float(), row[1:], reduction="none")  # (L - 1,)
                nll_sum += nll.double().sum().item()
                count += nll.numel()
    ppl = math.exp(nll_sum / count)
    logger.info("Perplexity %.4f over %d windows of %d tokens", ppl, n_windows, seq_len)
    return ppl


def _input_device(model: torch.nn.Module) -> torch.device:
    """Device the inputs must go to (`PreTrainedModel.device` handles dispatched models)."""
    device = getattr(model, "device", None)
    return device if isinstance(device, torch.device) else next(model.parameters()).device
