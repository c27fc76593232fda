"""Safetensors files read and written by plain file I/O: no memory map outlives a call, nothing is copied twice.

A low-memory run reads every decoder block once or twice and writes each one back. Through a memory map, the pages
of the file it touched stay counted in the process's resident memory as long as any tensor views them, and
`safetensors.torch.save_file` builds a byte copy of every tensor before it writes. Here:

  - `read_tensors` allocates each tensor and reads its bytes straight into it (`readinto`), so the tensor is the only
    copy: the file's pages are never mapped into the process;
  - `write_tensors` writes the header, then each tensor's own memory (a CPU view of it; a slice of a source file,
    `FileTensor`, is copied in chunks, converted to another dtype on the way if asked);
  - `FileTensor` names a tensor of a file without reading it, for saving unchanged tensors and reading rows.

The files are standard safetensors (same header, same layout), readable by `safetensors` and `transformers`.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["DTYPES", "FileTensor", "read_header", "read_tensors", "tensor_chunks", "write_tensors", "nbytes"]

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_NAMES = {v: k for k, v in DTYPES.items()}
CHUNK = 64 << 20  # bytes per read / write of a copied or converted tensor
_MAX_IO = 1 << 30  # bytes per read call (Linux caps one read near 2 GiB)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class FileTensor:
    """Tensor `name` of safetensors file `path`: its dtype, shape and absolute byte range, read only on demand."""

    path: Path
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def read(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor, as a new tensor (in `dtype` if given)."""
        with open(self.path, "rb", buffering=0) as f:
            return _read(f, self, dtype)

    def chunks(self, dtype: torch.dtype | None = None, chunk_bytes: int = CHUNK) -> Iterator[torch.Tensor]:
        """The tensor's values in order, flat, a bounded number of bytes at a time (converted to `dtype`)."""
        with open(self.path, "rb", buffering=0) as f:
            yield from _chunks(f, self, dtype, chunk_bytes)


def _chunks(f, e: FileTensor, dtype: torch.dtype | None, chunk_bytes: int = CHUNK) -> Iterator[torch.Tensor]:
    step = max(chunk_bytes // torch.empty((), dtype=e.dtype).element_size(), 1)
    f.seek(e.start)
    for first in range(0, e.numel, step):
        t = torch.empty(min(step, e.numel - first), dtype=e.dtype)
        _readinto(f, t)
        yield t if dtype is None or dtype == e.dtype else t.to(dtype)


def tensor_chunks(t: torch.Tensor, chunk_bytes: int = CHUNK) -> Iterator[torch.Tensor]:
    """The values of an in-memory tensor, flat, a bounded number of bytes at a time (views, no copy)."""
    return iter(t.detach().reshape(-1).split(max(chunk_bytes // max(t.element_size(), 1), 1)))


def read_header(path: str | os.PathLike) -> dict[str, FileTensor]:
    """The tensors of a safetensors file, by name (a damaged file raises a clear `OSError`)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError(f"header length {n} exceeds the file")
            header = json.loads(f.read(n))
        base, out = 8 + n, {}
        for name, e in header.items():
            if name == "__metadata__":
                continue
            begin, end = e["data_offsets"]
            if e["dtype"] not in DTYPES or base + end > size or end < begin:
                raise ValueError(f"tensor {name}: dtype {e['dtype']} / offsets {e['data_offsets']} do not fit")
            out[name] = FileTensor(path, name, DTYPES[e["dtype"]], tuple(e["shape"]), base + begin, base + end)
        return out
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise OSError(f"Cannot read {path}: {e}. The file is damaged or incomplete.") from e


def _bytes_view(t: torch.Tensor):
    """A writable byte buffer over contiguous CPU tensor `t` (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy().data


def _readinto(f, t: torch.Tensor) -> None:
    buf, done = _bytes_view(t), 0
    while done < len(buf):
        n = f.readinto(buf[done : done + _MAX_IO])
        if not n:
            raise OSError(f"{f.name}: unexpected end of file")
        done += n


def _read(f, e: FileTensor, dtype: torch.dtype | None) -> torch.Tensor:
    if e.end - e.start != e.numel * torch.empty((), dtype=e.dtype).element_size():
        raise OSError(
            f"{e.path}: tensor {e.name} has {e.end - e.start} bytes, which does not fit its shape {e.shape}."
        )
    if dtype is None or dtype == e.dtype or not e.dtype.is_floating_point:
        t = torch.empty(e.shape, dtype=e.dtype)
        f.seek(e.start)
        _readinto(f, t)
        return t
    t = torch.empty(e.shape, dtype=dtype)  # converted chunk by chunk: never a second whole copy
    flat, first = t.view(-1), 0
    for chunk in _chunks(f, e, dtype):
        flat[first : first + chunk.numel()] = chunk
        first += chunk.numel()
    return t


def read_tensors(
    path: str | os.PathLike, names: list[str] | None = None, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Tensors of one file (all, or `names`), each read into its own new CPU tensor; floating-point ones converted
    to `dtype` when given (one tensor at a time, so a conversion never holds more than one extra tensor)."""
    entries = read_header(path)
    names = list(entries) if names is None else names
    with open(path, "rb", buffering=0) as f:
        return {n: _read(f, entries[n], dtype) for n in names}


def _entry(value: torch.Tensor | FileTensor, dtype: torch.dtype | None) -> tuple[torch.dtype, list[int], int]:
    if isinstance(value, FileTensor):
        to = dtype if (dtype is not None and value.dtype.is_floating_point) else value.dtype
        return to, list(value.shape), value.numel * torch.empty((), dtype=to).element_size()
    to = dtype if (dtype is not None and value.is_floating_point()) else value.dtype
    return to, list(value.shape), value.numel() * torch.empty((), dtype=to).element_size()


def write_tensors(
    path: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor | FileTensor],
    metadata: dict[str, str] | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Write a safetensors file: tensors from memory (written from their own storage; a GPU or non-contiguous one is
    copied to a contiguous CPU tensor first, one at a time) and `FileTensor`s (copied in chunks); floating-point values
    converted to `dtype` when given. Not atomic: see `streaming.write_safetensors`."""
    layout = {k: _entry(v, dtype) for k, v in tensors.items()}
    # widest elements first (as safetensors itself orders them), so that every tensor stays aligned
    order = sorted(tensors, key=lambda k: (-torch.empty((), dtype=layout[k][0]).element_size(), k))
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for k in order:
        to, shape, size = layout[k]
        header[k] = {"dtype": _NAMES[to], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for k in order:
            value, to = tensors[k], layout[k][0]
            if isinstance(value, FileTensor):
                for chunk in value.chunks(to):
                    f.write(_bytes_view(chunk))
                continue
            t = value.detach()
            if t.device.type != "cpu" or t.dtype != to or not t.is_contiguous():
                t = t.to("cpu", to).contiguous()
            if t.numel():
                f.write(_bytes_view(t))
