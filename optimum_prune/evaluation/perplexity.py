"""Perplexity with the SparseGPT/Wanda protocol (non-overlapping windows over one joined token stream), and the same
scores summed per document (`score_documents`), what a document-level bootstrap interval resamples
(`evaluation.uncertainty`)."""

from __future__ import annotations

import bisect
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..calibration.data import load_texts
from ..modeling.architectures import require_causal_lm

__all__ = ["DocumentScores", "perplexity", "score_documents"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DocumentScores:
    """The scored next-token predictions of one text, summed per resampling unit.

    Attributes:
        perplexity (`float`): exp(total NLL / scored tokens), exactly what [`perplexity`] returns.
        nll (`list[float]`): the summed negative log-likelihood (nats) of each unit's scored tokens.
        tokens (`list[int]`): the number of scored tokens of each unit (same order; every entry > 0).
        units (`list[int]`): each unit's index: the document's position in the input list (`unit="document"`), or the
            window's (`unit="window"`, for a tokenizer without character offsets).
        unit (`str`): `"document"` or `"window"`.
    """

    perplexity: float
    nll: list[float]
    tokens: list[int]
    units: list[int]
    unit: str = "document"

    def as_dict(self) -> dict[str, Any]:
        """What a results file stores to recompute the intervals: `{"unit", "units", "nll", "tokens"}`."""
        return {"unit": self.unit, "units": self.units, "nll": self.nll, "tokens": self.tokens}


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
    [`score_documents`] returns the same number with the NLL summed per document.

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
    return score_documents(
        model, tokenizer, texts, seq_len, max_tokens, batch_size, device, split=split, text_column=text_column
    ).perplexity


def score_documents(
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
) -> DocumentScores:
    """[`perplexity`]'s scores, also summed per document: the unit a bootstrap interval resamples.

    The windows, tokens and perplexity are exactly [`perplexity`]'s (same arguments). Each scored token (a prediction
    target) belongs to the document its first character comes from in the joined text (a separator's tokens to the
    document before it), so a window that spans two documents adds to both. With a tokenizer that gives no character
    offsets (a slow tokenizer), every window is its own unit (`unit="window"`). Only units with scored tokens are
    listed.

    Returns:
        [`DocumentScores`].
    """
    require_causal_lm(model, "Perplexity")
    if seq_len < 2 or batch_size < 1:
        raise ValueError(f"seq_len must be >= 2 and batch_size >= 1, got {seq_len} and {batch_size}.")
    docs = load_texts(texts, split=split, text_column=text_column, drop_empty=False)
    input_ids, owner = _tokenize_with_owners(tokenizer, docs)
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
    by_document = owner is not None
    if not by_document:  # no character offsets: the window is the unit
        owner = torch.arange(n_windows).repeat_interleave(seq_len)
    owners = owner[: n_windows * seq_len].view(n_windows, seq_len)[:, 1:]  # unit of each target, (N, L - 1)
    n_units = int(owners.max()) + 1
    unit_nll = torch.zeros(n_units, dtype=torch.float64)
    unit_tokens = torch.zeros(n_units, dtype=torch.int64)
    if device is not None:
        model.to(device)
    device = torch.device(device) if device is not None else _input_device(model)
    model.eval()
    nll_sum, count = 0.0, 0
    with torch.no_grad():
        for start in tqdm(range(0, n_windows, batch_size), desc="perplexity", unit="batch", leave=False):
            batch = windows[start : start + batch_size].to(device)  # (B, L)
            logits = model(input_ids=batch, use_cache=False).logits  # (B, L, V)
            for i, (row_logits, row) in enumerate(zip(logits, batch)):  # one row at a time: a small float32 copy
                nll = F.cross_entropy(row_logits[:-1].float(), row[1:], reduction="none").double().cpu()  # (L - 1,)
                nll_sum += nll.sum().item()
                count += nll.numel()
                targets = owners[start + i]
                unit_nll.index_add_(0, targets, nll)
                unit_tokens.index_add_(0, targets, torch.ones_like(targets))
    ppl = math.exp(nll_sum / count)
    logger.info("Perplexity %.4f over %d windows of %d tokens", ppl, n_windows, seq_len)
    kept = torch.nonzero(unit_tokens).flatten().tolist()
    return DocumentScores(
        perplexity=ppl,
        nll=[float(unit_nll[u]) for u in kept],
        tokens=[int(unit_tokens[u]) for u in kept],
        units=kept,
        unit="document" if by_document else "window",
    )


def _tokenize_with_owners(tokenizer: Any, docs: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(ids, owner)` of the documents joined with `"\\n\\n"`: the token ids `(T,)` and, per token, the index of the
    document its first character belongs to (a separator's characters belong to the document before it); `owner` is
    None when the tokenizer gives no character offsets."""
    text = "\n\n".join(docs)
    try:
        enc = tokenizer(text, return_offsets_mapping=True)
    except (NotImplementedError, TypeError, ValueError):  # slow tokenizers have no offsets
        return tokenizer(text, return_tensors="pt")["input_ids"][0], None
    ids = torch.tensor(enc["input_ids"], dtype=torch.long)
    starts, pos = [], 0
    for doc in docs:
        starts.append(pos)
        pos += len(doc) + 2
    owner = torch.tensor([max(bisect.bisect_right(starts, a) - 1, 0) for a, _ in enc["offset_mapping"]])
    return ids, owner


def _input_device(model: torch.nn.Module) -> torch.device:
    """Device the inputs must go to (`PreTrainedModel.device` handles dispatched models)."""
    device = getattr(model, "device", None)
    return device if isinstance(device, torch.device) else next(model.parameters()).device
