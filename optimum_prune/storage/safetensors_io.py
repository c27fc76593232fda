"""Safetensors checkpoints: `SafetensorsSource` (the tensors of a (sharded) checkpoint, read by plain file I/O or
memory-mapped; the fused experts of a mixture-of-experts model assembled from a checkpoint that stores one tensor per
expert)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .tensorfile import FileTensor, read_header, read_tensors

__all__ = ["SafetensorsSource"]

_INDEX = "model.safetensors.index.json"


def _gguf_error(path: Any) -> ValueError:
    return ValueError(
        f"{path} is a GGUF checkpoint: its quantized blocks must be dequantized in memory, so it cannot be memory-mapped "
        "for low_memory=True. Convert it once to safetensors (this needs the model in memory once): "
        "`AutoPruner.from_pretrained(dir, gguf_file=NAME).save_pretrained(dir_st)`, then "
        "`AutoPruner.from_pretrained(dir_st, low_memory=True)`."
    )


class SafetensorsSource:
    """Tensor name → file of a (sharded) safetensors checkpoint; tensors are read memory-mapped, without copies."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        d = self.directory
        if d.is_file() and d.suffix == ".gguf":
            raise _gguf_error(d)
        if not d.is_dir():
            raise FileNotFoundError(f"{d} is not a model directory.")
        self.files: dict[str, Path] = {}
        if (d / _INDEX).is_file():
            with open(d / _INDEX, encoding="utf-8") as f:
                self.files = {k: d / v for k, v in json.load(f)["weight_map"].items()}
        elif (d / "model.safetensors").is_file():
            self.files = dict.fromkeys(read_header(d / "model.safetensors"), d / "model.safetensors")
        elif any(d.glob("*.gguf")):
            raise _gguf_error(next(d.glob("*.gguf")))
        else:
            found = ", ".join(sorted(p.name for p in d.iterdir())[:6]) or "nothing"
            raise FileNotFoundError(
                f"low_memory=True reads safetensors checkpoints (model.safetensors or a sharded index), and {d} has "
                f"none ({found}). A PyTorch .bin checkpoint cannot be memory-mapped safely: load it normally once and "
                "save it with save_pretrained (safetensors)."
            )
        missing = sorted({str(p.name) for p in self.files.values() if not p.is_file()})
        if missing:
            raise FileNotFoundError(
                f"{d} is incomplete: shard(s) {', '.join(missing)} listed in its index are missing."
            )

        self._headers: dict[Path, dict[str, FileTensor]] = {}
        self.composite: dict[str, tuple[str, list[str]]] = {}  # fused name -> how its stored parts combine
        self.part_files: dict[str, Path] = {}

    def alias(self, name: str, how: str, parts: list[str]) -> None:
        """Serve `name` from the stored tensors `parts`, combined by `how` (`modeling.moe.MoESpec.legacy_tensors`: a
        checkpoint that stores one tensor per expert, read as the model's fused experts)."""
        self.composite[name] = (how, parts)
        self.files[name] = self.files[parts[0]]
        for p in parts:
            self.part_files[p] = self.files.pop(p)

    def entry(self, name: str) -> FileTensor:
        """Where tensor `name` is (its file, dtype, shape and bytes), from the file's header."""
        if name in self.composite:  # its first part's entry (the dtype; the fused shape is the model's)
            name = self.composite[name][1][0]
        file = self.files.get(name) or self.part_files[name]
        if file not in self._headers:
            self._headers[file] = read_header(file)
        return self._headers[file][name]

    def float_dtype(self) -> torch.dtype | None:
        """The dtype of the first floating-point tensor (what `from_pretrained(dtype="auto")` would load)."""
        for name in self.files:
            dtype = self.entry(name).dtype
            if dtype.is_floating_point:
                return dtype
        return None

    def _by_file(self, names: list[str]) -> dict[Path, list[str]]:
        """The stored tensors of `names` by file (a composite name: its parts)."""
        by_file: dict[Path, list[str]] = {}
        for n in names:
            if n in self.composite:
                for part in self.composite[n][1]:
                    by_file.setdefault(self.part_files[part], []).append(part)
            else:
                by_file.setdefault(self.files[n], []).append(n)
        return by_file

    def _assemble(self, names: list[str], out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`out` (stored tensors) with the parts of each composite name in `names` combined into it."""
        for n in names:
            if n not in self.composite:
                continue
            how, parts = self.composite[n]
            tensors = [out.pop(p) for p in parts]
            if how == "gate_up":  # expert j: its gate rows, then its up rows
                tensors = [torch.cat(tensors[k : k + 2]) for k in range(0, len(tensors), 2)]
            out[n] = tensors[0] if how == "same" else torch.stack(tensors)
        return out

    def copies(self, names: list[str], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Tensors read into new memory (floating-point ones in `dtype`): no page of the files stays mapped."""
        out = {k: v for f, ns in self._by_file(names).items() for k, v in read_tensors(f, ns, dtype).items()}
        return self._assemble(names, out)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Memory-mapped tensors (file-backed pages: copy them before changing them); only the pages a computation
        touches become resident, which suits tensors read sparsely (embedding rows)."""
        out: dict[str, torch.Tensor] = {}
        for file, ns in self._by_file(names).items():
            out.update(_open(file, lambda f, ns=ns: {n: f.get_tensor(n) for n in ns}))
        return self._assemble(names, out)


def _open(file: Path, read):
    """`read(handle)` on an open safetensors file; a truncated or corrupt file raises a clear `OSError`."""
    try:
        with safe_open(str(file), "pt") as f:
            return read(f)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for damaged files
        raise OSError(f"Cannot read {file}: {e}. The file is damaged or incomplete.") from e
