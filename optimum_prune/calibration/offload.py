"""Calibration activations between blocks, kept in memory up to a budget and spilled to disk beyond it.

The runner holds the hidden states of every calibration chunk between two blocks (and a second copy while a block
produces its outputs). `ChunkList` is the list it keeps them in: chunks are kept in memory while the shared
`ActivationBudget` allows, and written to files (safetensors, memory-mapped back on access) beyond it. The first
spill is logged with the sizes involved, and `ActivationBudget.summary()` says how much went to disk in total.
"""

from __future__ import annotations

import logging
import shutil
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..utils.scratch import make_scratch_dir

__all__ = ["ActivationBudget", "ChunkList", "parse_bytes"]

logger = logging.getLogger(__name__)

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_bytes(value: int | float | str | None) -> int | None:
    """`1.5e9`, `"1.5GB"`, `"800MiB"` → bytes (`None` stays `None`)."""
    if value is None or isinstance(value, (int, float)):
        if value is not None and value < 0:
            raise ValueError(f"A memory size must be >= 0, got {value}.")
        return None if value is None else int(value)
    text = str(value).strip().upper().replace(" ", "")
    digits = text.rstrip("KMGTIB")
    unit = text[len(digits) :]
    if unit not in _UNITS or not digits:
        raise ValueError(f"Cannot read {value!r} as a memory size; use bytes or e.g. '4GB', '512MiB'.")
    return int(float(digits) * _UNITS[unit])


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


class ActivationBudget:
    """Bytes of calibration activations kept in memory (`limit`, `None`: no limit); beyond it, chunks go to files
    in a temporary directory under `directory` (default: the system temporary directory), removed by `cleanup()`.

    Args:
        limit (`int | str | None`): in-memory budget in bytes (or e.g. `"4GB"`).
        directory (`str | Path | None`): where the spill directory is created.
    """

    def __init__(self, limit: int | str | None = None, directory: str | Path | None = None) -> None:
        self.limit = parse_bytes(limit)
        self.directory = Path(directory) if directory is not None else None
        self.in_memory = 0
        self.spilled_bytes = 0  # written to disk in total
        self.spilled_chunks = 0
        self._dir: Path | None = None
        self._files = 0

    def admit(self, nbytes: int) -> bool:
        """Whether a chunk of `nbytes` stays in memory (it is then counted until released)."""
        if self.limit is None or self.in_memory + nbytes <= self.limit:
            self.in_memory += nbytes
            return True
        return False

    def release(self, nbytes: int) -> None:
        self.in_memory = max(self.in_memory - nbytes, 0)

    def spill(self, tensor: torch.Tensor) -> Path:
        """Write one chunk to a new file; returns its path."""
        if self._dir is None:
            if self.directory is not None:
                self.directory.mkdir(parents=True, exist_ok=True)
            self._dir = make_scratch_dir(self.directory, ".optimum_prune_activations")
            weakref.finalize(self, shutil.rmtree, str(self._dir), True)
            logger.warning(
                "Calibration activations exceed the in-memory budget of %s (%s held): further chunks are written to "
                "%s. Give prune(activation_memory=...) more memory to avoid the disk traffic.",
                _gb(self.limit or 0), _gb(self.in_memory), self._dir,
            )  # fmt: skip
        path = self._dir / f"chunk{self._files:07d}.safetensors"
        self._files += 1
        save_file({"h": tensor.detach().contiguous().cpu()}, str(path))
        self.spilled_bytes += tensor.numel() * tensor.element_size()
        self.spilled_chunks += 1
        return path

    def summary(self) -> dict:
        return {
            "activation_memory_limit": self.limit,
            "spilled_bytes": self.spilled_bytes,
            "spilled_chunks": self.spilled_chunks,
        }

    def cleanup(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def _release(budget: ActivationBudget, held: list[int], paths: list[Path]) -> None:
    budget.release(held[0])
    for p in paths:
        p.unlink(missing_ok=True)


class ChunkList(Sequence):
    """A list of per-chunk hidden states that spills to disk beyond `budget` (a plain list without one).

    Reading a spilled chunk memory-maps its file (the pages are file-backed, reclaimable). Memory is returned to the
    budget, and the files deleted, when the list is garbage-collected.
    """

    def __init__(self, budget: ActivationBudget | None = None, items: Sequence[torch.Tensor] = ()) -> None:
        self._budget = budget
        self._items: list[torch.Tensor | Path] = []
        self._held = [0]  # bytes admitted to the budget (a list: shared with the finalizer)
        self._paths: list[Path] = []
        if budget is not None:
            weakref.finalize(self, _release, budget, self._held, self._paths)
        for t in items:
            self.append(t)

    def append(self, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._budget is None or self._budget.admit(nbytes):
            self._items.append(tensor)
            self._held[0] += nbytes
            return
        path = self._budget.spill(tensor)
        self._paths.append(path)
        self._items.append(path)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        item = self._items[index]
        return load_file(str(item))["h"] if isinstance(item, Path) else item

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(len(self)):
            yield self[i]

    @property
    def spilled(self) -> int:
        return len(self._paths)
