"""Saving a low-memory model shard by shard: one shard per decoder block, one for everything else, and the standard
`model.safetensors.index.json`, so that stock `from_pretrained` (or `AutoPrunedModelForCausalLM`) loads it like any
sharded checkpoint.

A block that a pruning stage wrote out (`streaming.LayerStore`) is already a complete shard: it is hard-linked into
the output (copied across file systems), never read. A block still as in the source, and the non-block tensors, are
copied from their files in chunks (`tensorfile.FileTensor`), converted to the model's dtype on the way: the save
holds no whole tensor in memory. Only `serialization.save_pruned_model` calls this, inside its temporary
directory (renamed into place at the end, so a failure leaves nothing where the model is expected).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from ..modeling.architectures import ArchitectureSpec, get_layers
from ..utils.phases import phased
from .streaming import get_store, layer_prefix, write_safetensors
from .tensorfile import FileTensor, read_header, read_tensors

__all__ = ["save_streamed_"]

logger = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"


def _nbytes(t: torch.Tensor | FileTensor, dtype: torch.dtype) -> int:
    """Bytes of `t` once written (floating-point values in `dtype`)."""
    to = dtype if t.dtype.is_floating_point else t.dtype
    numel = t.numel if isinstance(t, FileTensor) else t.numel()
    return numel * torch.empty((), dtype=to).element_size()


def _link_or_copy(src: Path, dst: Path) -> bool:
    """Hard-link `src` to `dst` (same file system: no data written); else copy it. Returns whether it linked."""
    try:
        os.link(src, dst)
        return True
    except OSError:
        shutil.copyfile(src, dst)
        return False


def _nonblock_state(model: nn.Module, spec: ArchitectureSpec) -> dict[str, torch.Tensor | FileTensor]:
    """Tensors outside the decoder blocks (tied ones once, under their first name, as `save_pretrained` does);
    those still as in the source are copied from there (`LayerStore.nonblock_value`)."""
    store = get_store(model)
    prefix = spec.layers + "."
    seen, out = set(), {}
    for name, t in model.state_dict(keep_vars=True).items():
        if name.startswith(prefix) or id(t) in seen:
            continue
        seen.add(id(t))
        out[name] = store.nonblock_value(name, t)
    return out


def _check_space(directory: Path, needed: int) -> None:
    free = shutil.disk_usage(directory).free
    if needed > free:
        raise OSError(
            f"Not enough disk space in {directory}: the checkpoint needs {needed / 1e9:.2f} GB more, {free / 1e9:.2f} GB "
            "are free. Free some space or save to another disk. Nothing was written where the model is expected."
        )


@phased("save")
def save_streamed_(model: nn.Module, spec: ArchitectureSpec, directory: Path, extra: dict[str, torch.Tensor]) -> None:
    """Write the weights of low-memory `model` into `directory` (see the module docstring); `extra` holds zero
    tensors a stock config requires (biases)."""
    store = get_store(model)
    layers = get_layers(model, spec)
    n = len(layers) + 1
    name = "model-{:05d}-of-{:05d}.safetensors".format
    weight_map: dict[str, str] = {}
    total = 0
    plans = []  # (block index, {tensor name: file}, extra tensors, whether the file is a complete shard)
    elsize = torch.finfo(store.dtype).bits // 8
    est = 0
    sources = set(store.source.files.values())
    for i, layer in enumerate(layers):
        files = store.tensor_files(i)
        block_extra = {k: v for k, v in extra.items() if k.startswith(layer_prefix(spec, i))}
        distinct = set(files.values())
        legacy = spec.moe is not None and spec.moe.legacy_block is not None  # experts stored one tensor each
        linkable = len(distinct) == 1 and not block_extra and not distinct & sources and not legacy
        plans.append((i, files, block_extra, linkable))
        if not (linkable and _same_fs(next(iter(distinct)), directory)):
            est += sum(t.numel() for t in layer.state_dict().values()) * elsize
    state = _nonblock_state(model, spec)
    state.update({k: v for k, v in extra.items() if not k.startswith(spec.layers + ".")})
    est += sum(_nbytes(t, store.dtype) for t in state.values())
    _check_space(directory, est)
    write_safetensors(state, directory / name(1, n), store.dtype)
    weight_map.update(dict.fromkeys(state, name(1, n)))
    total += sum(_nbytes(t, store.dtype) for t in state.values())
    del state
    linked = 0
    headers: dict[Path, dict[str, FileTensor]] = {}
    for i, files, block_extra, linkable in tqdm(plans, desc="saving blocks", leave=False):
        shard = directory / name(i + 2, n)
        if spec.moe is not None and spec.moe.legacy_block is not None:
            tensors = _legacy_block(store, spec, i, files, sources)
        else:
            for f in set(files.values()) - set(headers):
                headers[f] = read_header(f)
            tensors = {k: headers[f][k] for k, f in files.items()}
        if linkable:
            linked += _link_or_copy(next(iter(files.values())), shard)
        else:
            tensors.update(block_extra)
            write_safetensors(tensors, shard, store.dtype)
        weight_map.update(dict.fromkeys(tensors, shard.name))
        total += sum(_nbytes(t, store.dtype) for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(directory / INDEX_NAME, "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    if getattr(model, "can_generate", lambda: False)() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)
    logger.info("saved %d shards (%d blocks hard-linked from the pruning run) to %s", n, linked, directory)


def _legacy_block(store, spec: ArchitectureSpec, i: int, files: dict[str, Path], sources: set[Path]):
    """Block `i`'s tensors in memory, its fused experts split into the one-tensor-per-expert layout of the stock
    checkpoint (the source's own tensors read through it: fused experts from their parts)."""
    by_file: dict[Path, list[str]] = {}
    for k, f in files.items():
        by_file.setdefault(f, []).append(k)
    tensors: dict[str, torch.Tensor] = {}
    for f, ks in by_file.items():
        tensors.update(store.source.copies(ks, store.dtype) if f in sources else read_tensors(f, ks, store.dtype))
    return spec.moe.to_legacy(layer_prefix(spec, i) + spec.mlp, tensors)


def _same_fs(a: Path, b: Path) -> bool:
    try:
        return a.stat().st_dev == b.stat().st_dev
    except OSError:
        return False
