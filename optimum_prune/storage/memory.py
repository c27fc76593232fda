"""Memory a low-memory run needs, and the device a run asks for, checked before any work."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import nn

from ..modeling.architectures import ArchitectureSpec, get_layers
from .streaming import get_store

__all__ = [
    "InsufficientMemoryError",
    "available_memory",
    "check_device",
    "check_memory",
    "memory_needed",
    "process_memory",
]

logger = logging.getLogger(__name__)


class InsufficientMemoryError(MemoryError, ValueError):
    """The model does not fit even one block at a time (raised before anything is read or written)."""


def available_memory() -> int | None:
    """Bytes this process can still allocate: `MemAvailable`, capped by a cgroup (container) limit; `None` when
    unknown (not Linux)."""
    avail = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            avail = min(avail if avail is not None else 1 << 62, int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail


_STATUS_KEYS = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "VmHWM": "peak"}


def process_memory() -> dict[str, int]:
    """This process's memory in bytes, from `/proc/self/status`: `rss` (resident), `anon` (anonymous: tensors, heap),
    `file` (resident pages of mapped files: libraries, memory-mapped tensors), `peak` (the largest `rss` so far);
    empty when unknown (not Linux)."""
    out = {}
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in _STATUS_KEYS:
                    out[_STATUS_KEYS[key]] = int(line.split()[1]) * 1024
    except OSError:
        return {}
    return out


def check_device(device: torch.device | str | None) -> torch.device | None:
    """`device` as a `torch.device`; a device this process cannot use (no GPU visible, a CPU-only torch build, an
    index beyond the GPU count) is a clear `ValueError` before anything is read or written."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a torch device ({e}). Use e.g. 'cpu', 'cuda' or 'cuda:1'.") from e
    if dev.type == "cpu":
        return dev
    backend = getattr(torch, dev.type, None)
    count = backend.device_count() if backend is not None and backend.is_available() else 0
    if count == 0:
        build = f"torch {torch.__version__}" + (
            ", built without CUDA" if dev.type == "cuda" and not torch.version.cuda else ""
        )
        raise ValueError(
            f"device={device!r}, but this process sees no {dev.type} device ({build}). Run on a machine with one (and "
            "a torch build for it), or leave `device` unset / pass 'cpu'. Nothing was read or written."
        )
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"device={device!r}, but this process sees {count} {dev.type} device(s) (indices 0 to "
                         f"{count - 1}; CUDA_VISIBLE_DEVICES may hide others). Nothing was read or written.")  # fmt: skip
    return dev


def memory_needed(model: nn.Module, spec: ArchitectureSpec, calibrated: bool) -> dict[str, int]:
    """What a low-memory run holds at least, in bytes: the tensors read into memory (norms; the embeddings when they
    were converted to another dtype, else memory-mapped), one block and the dense copy some methods keep, and the
    largest input Gram a method may accumulate (fp32)."""
    store = get_store(model)
    seen, resident = {id(t) for t in store.mapped.values()}, 0  # memory-mapped: resident only where read
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen and t.device.type != "meta":
            seen.add(id(t))
            resident += t.numel() * t.element_size()
    widest = max(
        max(layer.get_submodule(p).weight.shape) for layer in get_layers(model, spec) for p in spec.linear_paths
    )
    return {
        "resident": resident,
        "blocks": 2 * store.block_bytes(),
        "statistics": 4 * widest * widest if calibrated else 0,
    }


def check_memory(model: nn.Module, spec: ArchitectureSpec, calibrated: bool, device: torch.device) -> int | None:
    """Raise `InsufficientMemoryError` when even one block cannot be held; returns the bytes left over (`None`:
    unknown)."""
    need = memory_needed(model, spec, calibrated)
    host = need["resident"] + (0 if device.type == "cuda" else need["blocks"] + need["statistics"])
    free = available_memory()
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    free = None if free is None else free // procs
    parts = ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in need.items())
    if free is not None and host > free:
        raise InsufficientMemoryError(
            f"This model needs at least {host / 1e9:.1f} GB of memory per process even with low_memory=True ({parts}); "
            f"{free / 1e9:.1f} GB are available. It would fit on a machine (or under a process limit) with "
            f"{host / 1e9 * 1.2:.0f} GB or more, or with device='cuda' on a GPU holding the block and its statistics "
            f"({(need['blocks'] + need['statistics']) / 1e9:.1f} GB). Nothing was read or written."
        )
    if device.type == "cuda":
        gpu_free, _ = torch.cuda.mem_get_info(device)
        if need["blocks"] + need["statistics"] > gpu_free:
            raise InsufficientMemoryError(
                f"One block and its statistics need {(need['blocks'] + need['statistics']) / 1e9:.1f} GB on {device}, "
                f"which has {gpu_free / 1e9:.1f} GB free. Use a larger GPU, or device='cpu'."
            )
    logger.info("low-memory run: needs at least %s (%s); %s available", f"{host / 1e9:.2f} GB", parts,
                "unknown" if free is None else f"{free / 1e9:.2f} GB")  # fmt: skip
    return None if free is None else free - host
