"""Safetensors checkpoints read memory-mapped, tensor by tensor (`SafetensorsSource`: the source of a low-memory
model, its fused experts assembled from a per-expert checkpoint), and atomic writes (`write_safetensors`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = ["SafetensorsSource", "read_tensors", "write_safetensors"]

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
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
            self.files = dict.fromkeys(
                _open(d / "model.safetensors", lambda f: list(f.keys())), d / "model.safetensors"
            )
        elif any(d.glob("*.gguf")):
            raise _gguf_error(next(d.glob("*.gguf")))
        else:
            found = ", ".join(sorted(p.name for p in d.iterdir())[:6]) or "nothing"
            raise FileNotFoundError(
                f"low_memory=True reads safetensors checkpoints (model.safetensors or a sharded index), and {d} has "
                f"none ({found}). A PyTorch .bin checkpoint cannot be memory-mapped safely: load it normally once and "
                "save it with save_pretrained (safetensors)."
            )
        self.composite: dict[str, tuple[str, list[str]]] = {}  # fused name -> how its stored parts combine
        self.part_files: dict[str, Path] = {}
        missing = sorted({str(p.name) for p in self.files.values() if not p.is_file()})
        if missing:
            raise FileNotFoundError(
                f"{d} is incomplete: shard(s) {', '.join(missing)} listed in its index are missing."
            )

    def alias(self, name: str, how: str, parts: list[str]) -> None:
        """Serve `name` from the stored tensors `parts`, combined by `how` (`modeling.moe.MoESpec.legacy_tensors`: a
        checkpoint that stores one tensor per expert, read as the model's fused experts)."""
        self.composite[name] = (how, parts)
        self.files[name] = self.files[parts[0]]
        for p in parts:
            self.part_files[p] = self.files.pop(p)

    def header(self, name: str) -> tuple[torch.dtype | None, list[int]]:
        if name in self.composite:
            dtype, _ = _open(
                self.part_files[self.composite[name][1][0]], lambda f: _header(f, self.composite[name][1][0])
            )
            return dtype, []
        s = _open(self.files[name], lambda f: f.get_slice(name))
        return _DTYPES.get(s.get_dtype()), list(s.get_shape())

    def float_dtype(self) -> torch.dtype | None:
        """The dtype of the first floating-point tensor (what `from_pretrained(dtype="auto")` would load)."""
        for name in self.files:
            dtype, _ = self.header(name)
            if dtype is not None:
                return dtype
        return None

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Memory-mapped tensors (file-backed pages: copy them before changing them)."""
        out: dict[str, torch.Tensor] = {}
        by_file: dict[Path, list[str]] = {}
        composite = [n for n in names if n in self.composite]
        for n in names:
            if n not in self.composite:
                by_file.setdefault(self.files[n], []).append(n)
        for n in composite:
            for part in self.composite[n][1]:
                by_file.setdefault(self.part_files[part], []).append(part)
        for file, ns in by_file.items():
            out.update(read_tensors(file, ns))
        for n in composite:
            how, parts = self.composite[n]
            tensors = [out.pop(p) for p in parts]
            if how == "gate_up":  # expert j: its gate rows, then its up rows
                tensors = [torch.cat(tensors[k : k + 2]) for k in range(0, len(tensors), 2)]
            out[n] = tensors[0] if how == "same" else torch.stack(tensors)
        return out


def _header(f, name: str) -> tuple[torch.dtype | None, list[int]]:
    s = f.get_slice(name)
    return _DTYPES.get(s.get_dtype()), list(s.get_shape())


def _open(file: Path, read):
    """`read(handle)` on an open safetensors file; a truncated or corrupt file raises a clear `OSError`."""
    try:
        with safe_open(str(file), "pt") as f:
            return read(f)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for damaged files
        raise OSError(f"Cannot read {file}: {e}. The file is damaged or incomplete.") from e


def read_tensors(file: Path, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of one safetensors file (memory-mapped)."""
    return _open(file, lambda f: {n: f.get_tensor(n) for n in (names if names is not None else f.keys())})


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write atomically: a temporary file in the same directory, flushed to disk, then renamed over `path`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
