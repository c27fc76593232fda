"""Training text read while training (`FinetuneConfig(streaming=True)`): the documents of a source indexed without
holding their texts, split by document index, and packed into `seq_len` windows one document at a time."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset

from ..calibration.data import DOCUMENT_SEPARATOR, load_texts

__all__ = ["DocumentIndex", "TokenWindows", "first_window"]

logger = logging.getLogger(__name__)


class DocumentIndex(Sequence):
    """The documents of a text source, read one at a time: `len()` and `[i]` without loading the whole source.

    A directory is its `*.txt` files (recursively, sorted by path, one document each; read when indexed), a `.jsonl`
    file one document per line (byte offsets kept, the line parsed when indexed), a `datasets.Dataset` its rows of
    `text_column`; any other source `load_texts` accepts (a list of strings, one text file, a named dataset) is
    loaded as a list.
    """

    def __init__(self, source: Any, *, text_column: str = "text") -> None:
        self.text_column = text_column
        self._get: Callable[[int], str]
        path = Path(source).expanduser() if isinstance(source, (str, os.PathLike)) else None
        if path is not None and path.is_dir():
            self._files = sorted(p for p in path.rglob("*.txt") if p.is_file())
            if not self._files:
                load_texts(source)  # raises the library's error for a directory without text files
            self._n, self._get = len(self._files), self._read_file
        elif path is not None and path.is_file() and path.suffix == ".jsonl":
            self._path, self._offsets = path, self._line_offsets(path)
            self._n, self._get = len(self._offsets), self._read_line
        elif hasattr(source, "column_names") and hasattr(source, "__getitem__") and hasattr(source, "__len__"):
            if text_column not in source.column_names:
                raise ValueError(f"The dataset has no column {text_column!r}; its columns: {source.column_names}.")
            self._ds, self._n, self._get = source, len(source), self._read_row
        else:
            docs = load_texts(source, drop_empty=False)
            self._n, self._get = len(docs), docs.__getitem__

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> str:  # type: ignore[override]
        return self._get(i)

    def _read_file(self, i: int) -> str:
        return self._files[i].read_text(encoding="utf-8", errors="replace")

    @staticmethod
    def _line_offsets(path: Path) -> list[int]:
        offsets, pos = [], 0
        with open(path, "rb") as f:
            for line in f:
                if line.strip():
                    offsets.append(pos)
                pos += len(line)
        return offsets

    def _read_line(self, i: int) -> str:
        with open(self._path, "rb") as f:
            f.seek(self._offsets[i])
            line = f.readline()
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{self._path}: line at byte {self._offsets[i]} is not JSON ({e}).") from e
        if not isinstance(record, dict) or not isinstance(record.get(self.text_column), str):
            raise ValueError(f"{self._path}: a line has no string field {self.text_column!r}.")
        return record[self.text_column]

    def _read_row(self, i: int) -> str:
        return str(self._ds[i][self.text_column] or "")


class TokenWindows(IterableDataset):
    """`{"input_ids", "labels"}` windows of `seq_len` tokens, packed from the documents `indices` of `docs`, read and
    tokenized one at a time (joined by `DOCUMENT_SEPARATOR`, as the in-memory path joins them).

    Every pass visits the documents in a new seeded order (`seed`, the pass number from `set_epoch`, which the
    Trainer calls each epoch), so a resumed run sees the same windows as an uninterrupted one.
    """

    def __init__(self, docs: Sequence[str], indices: Sequence[int], tokenizer: Any, seq_len: int, seed: int = 0):
        self.docs, self.indices, self.tokenizer = docs, list(indices), tokenizer
        self.seq_len, self.seed, self.epoch = seq_len, seed, 0
        self.separator = tokenizer(DOCUMENT_SEPARATOR, add_special_tokens=False)["input_ids"]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def order(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return [self.indices[i] for i in torch.randperm(len(self.indices), generator=g).tolist()]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        buf: list[int] = []
        for i in self.order():
            text = self.docs[i]
            if not text.strip():
                continue
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            buf.extend(self.separator + ids if buf else ids)
            while len(buf) >= self.seq_len:
                window = torch.tensor(buf[: self.seq_len], dtype=torch.long)
                buf = buf[self.seq_len :]
                yield {"input_ids": window, "labels": window.clone()}


def first_window(windows: TokenWindows) -> torch.Tensor | None:
    """The first window a pass yields (checks the training text before training), or `None` if it yields none."""
    for w in windows:
        return w["input_ids"]
    return None
