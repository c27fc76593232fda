"""Low-memory models: the decoder blocks stay on disk and visit memory one at a time.

`load_low_memory(path)` builds the model's skeleton on the meta device (accelerate's `init_empty_weights`), then
loads only what calibration needs besides the blocks (embeddings, final norm, positional tables) from the
memory-mapped safetensors checkpoint (only the rows the calibration tokens touch become resident); the output head
(when not tied) stays on disk until the save. A `LayerStore` attached to the model knows where every version of every
block lives: the source checkpoint, then the file written when a pruning stage finished the block. The pruning loops
make a block resident through the prune session (`optimum_prune.pipeline.session`), which loads it (the version they
ask for), and puts it back on the meta device afterwards. Blocks are read and written by plain file I/O
(`tensorfile`): a block in memory is one copy of its tensors, and none of its file's pages stay mapped after it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import weakref
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from ..modeling.architectures import ArchitectureSpec, get_layers, get_spec, layer_view, spec_for_config
from ..modeling.auto_classes import register_pruned_architectures
from ..modeling.shapes import layer_row
from ..modeling.surgery import reshape_layer_
from ..utils.phases import phased
from ..utils.scratch import make_scratch_dir
from .safetensors_io import SafetensorsSource
from .tensorfile import FileTensor, write_tensors
from .tensorfile import read_tensors as read_tensors

__all__ = [
    "STORE_ATTR",
    "SafetensorsSource",
    "LayerStore",
    "load_low_memory",
    "get_store",
    "set_tensor_",
    "write_safetensors",
    "layer_prefix",
    "fill_block_",
    "load_block_",
    "read_tensors",
]

logger = logging.getLogger(__name__)

STORE_ATTR = "_optimum_prune_store"
SOURCE = -1  # version of a block as it is in the source checkpoint


def write_safetensors(
    tensors: dict[str, torch.Tensor | FileTensor], path: Path, dtype: torch.dtype | None = None
) -> None:
    """Write atomically: a temporary file in the same directory, flushed to disk, then renamed over `path` (see
    `tensorfile.write_tensors`: no copy of the tensors is made, `FileTensor`s are copied from their file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write_tensors(tmp, tensors, {"format": "pt"}, dtype)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def set_tensor_(root: nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace parameter or buffer `name` of `root` by `value` (a parameter keeps its `requires_grad`)."""
    mod_path, _, leaf = name.rpartition(".")
    mod = root.get_submodule(mod_path) if mod_path else root
    if leaf in mod._parameters:
        old = mod._parameters[leaf]
        mod._parameters[leaf] = nn.Parameter(value, requires_grad=bool(old is not None and old.requires_grad))
    elif leaf in mod._buffers:
        mod._buffers[leaf] = value
    else:
        raise KeyError(f"{name} is not a parameter or buffer")


def layer_prefix(spec: ArchitectureSpec, index: int) -> str:
    return f"{spec.layers}.{index}."


def fill_block_(
    layer: nn.Module,
    i: int,
    spec: ArchitectureSpec,
    config: Any,
    tensors: dict[str, torch.Tensor],
    shapes: dict | None,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
) -> None:
    """Give decoder layer `i` the recorded `shapes` (when they differ) and the values of `tensors` (full names: new
    tensors the layer takes over, moved to `device` and floating-point ones to `dtype` where they differ)."""
    if shapes is not None and layer_row(layer, i, spec, config) != shapes:
        reshape_layer_(layer_view(layer, i, spec, config), shapes)
    prefix = layer_prefix(spec, i)
    for n in list(layer.state_dict().keys()):
        t = tensors.pop(prefix + n)  # the layer then holds the only reference (a CPU staging copy dies here)
        to = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
        set_tensor_(layer, n, t.to(device=device, dtype=to))


def load_block_(layer, i, spec, config, path: Path, shapes: dict, device, dtype=None) -> None:
    """`fill_block_` from a block file written by `write_safetensors`."""
    fill_block_(layer, i, spec, config, read_tensors(path, dtype=dtype), shapes, device, dtype)


def get_store(model: nn.Module) -> LayerStore | None:
    return getattr(model, STORE_ATTR, None)


class LayerStore:
    """Where each version of each decoder block lives, and which block is in memory.

    `versions[i]` maps a stage number (`SOURCE` = -1 for the source checkpoint) to `(file or None, shapes)`;
    `load(i, stage)` makes the latest version at or before `stage` resident on `device`.
    """

    def __init__(self, model: nn.Module, spec: ArchitectureSpec, source: SafetensorsSource, dtype: torch.dtype):
        self.model, self.spec, self.source, self.dtype = model, spec, source, dtype
        self.device = torch.device("cpu")
        layers = get_layers(model, spec)
        self.versions: list[dict[int, tuple[Path | None, dict]]] = [
            {SOURCE: (None, layer_row(layer, i, spec, model.config))} for i, layer in enumerate(layers)
        ]
        self.loaded: dict[int, int] = {}  # resident block -> the stage of its version
        self.io = {"blocks_loaded": 0, "bytes_read": 0, "bytes_written": 0}  # logical traffic of the blocks
        self.checked: set[int] = set()  # source blocks whose weights were checked finite
        self.mapped: dict[str, torch.Tensor] = {}  # resident tensors still backed by the source file's memory map
        self._work: Path | None = None
        self.work_parent: Path | None = None

    # ------------------------------------------------------------------------------------------------- versions
    def latest(self, i: int, stage: int | None = None) -> int:
        return max(s for s in self.versions[i] if stage is None or s <= stage)

    def record(self, i: int, stage: int, path: Path, shapes: dict) -> None:
        self.versions[i][stage] = (path, shapes)

    def forget(self, stage: int) -> None:
        """Drop every version of `stage` (a failed stage): blocks go back to their previous version."""
        for i, v in enumerate(self.versions):
            if v.pop(stage, None) is not None:
                self.offload(i)
                self._reshape(i, v[self.latest(i)][1])

    def work_dir(self) -> Path:
        """A private directory for block files written without a checkpoint directory (deleted with the store)."""
        if self._work is None:
            parent = self.work_parent
            if parent is not None:
                parent.mkdir(parents=True, exist_ok=True)
            self._work = make_scratch_dir(parent, "optimum_prune_blocks")
            weakref.finalize(self, shutil.rmtree, str(self._work), True)
            logger.info("Low-memory mode: pruned blocks are written to %s until the model is saved", self._work)
        return self._work

    def tensor_files(self, i: int) -> dict[str, Path]:
        """Full tensor name → file of the latest version of block `i`."""
        path, _ = self.versions[i][self.latest(i)]
        names = get_layers(self.model, self.spec)[i].state_dict().keys()
        prefix = layer_prefix(self.spec, i)
        if path is None:
            return {prefix + n: self.source.files[prefix + n] for n in names}
        return dict.fromkeys((prefix + n for n in names), path)

    def nonblock_value(self, name: str, tensor: torch.Tensor) -> torch.Tensor | FileTensor:
        """Tensor `name` outside the blocks, for reading it whole: from the source file when it is still there
        unchanged (on disk, or the memory-mapped tensor loaded from it, whose pages a whole read would make
        resident), else `tensor` itself."""
        if tensor.device.type == "meta" or self.mapped.get(name) is tensor:
            return self.source.entry(name)
        return tensor

    # ---------------------------------------------------------------------------------------------- residency
    def _reshape(self, i: int, shapes: dict) -> None:
        layer = get_layers(self.model, self.spec)[i]
        if layer_row(layer, i, self.spec, self.model.config) != shapes:
            reshape_layer_(layer_view(layer, i, self.spec, self.model.config), shapes)

    @phased("load block", block_arg=1)
    def load(self, i: int, stage: int | None = None) -> None:
        """Make version `latest(i, stage)` of block `i` resident on `self.device`."""
        version = self.latest(i, stage)
        if self.loaded.get(i) == version:
            return
        self.offload(i)
        path, shapes = self.versions[i][version]
        layer = get_layers(self.model, self.spec)[i]
        if path is None:
            self._reshape(i, shapes)
            prefix = layer_prefix(self.spec, i)
            tensors = self.source.copies([prefix + n for n in layer.state_dict()], self.dtype)
            fill_block_(layer, i, self.spec, self.model.config, tensors, None, self.device, self.dtype)
        else:
            load_block_(layer, i, self.spec, self.model.config, path, shapes, self.device, self.dtype)
        self.loaded[i] = version
        self.io["blocks_loaded"] += 1
        self.io["bytes_read"] += sum(t.numel() * t.element_size() for t in layer.state_dict().values())
        if path is None and i not in self.checked:
            _check_finite(layer, i, self.spec)
            self.checked.add(i)

    @phased("release block", block_arg=1)
    def offload(self, i: int) -> None:
        """Put block `i` back on the meta device (its weights are on disk)."""
        if self.loaded.pop(i, None) is None:
            return
        layer = get_layers(self.model, self.spec)[i]
        for n, t in layer.state_dict(keep_vars=True).items():
            set_tensor_(layer, n, torch.empty_like(t, device="meta"))
        _trim_heap()
        self.release_mapped()

    def release_mapped(self) -> None:
        """Drop the pages of the memory-mapped tensors (the embedding rows calibration read) from this process: the
        kernel's read-ahead brings a neighbourhood of each row in, 0.3 GB of an 8 × 256-token calibration's 1B
        embedding, and none is read again until the save (which reads the file). A later read faults them back in
        from the page cache. Only whole pages inside each tensor are released (glibc `madvise(MADV_DONTNEED)`;
        nothing elsewhere)."""
        libc = _libc()
        if libc is None or not hasattr(libc, "madvise"):
            return
        page = os.sysconf("SC_PAGE_SIZE")
        for t in self.mapped.values():
            start = -(-t.data_ptr() // page) * page
            end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
            if end > start:
                libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)

    def block_bytes(self) -> int:
        """Bytes of the largest block in the working dtype."""
        size = torch.finfo(self.dtype).bits // 8
        layers = get_layers(self.model, self.spec)
        return max(sum(t.numel() for t in layer.state_dict().values()) * size for layer in layers)


_LIBC: list = []
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
_MADV_DONTNEED = 4
MMAP_THRESHOLD = 4 << 20


def _libc() -> Any:
    if not _LIBC:
        try:
            _LIBC.append(ctypes.CDLL("libc.so.6"))
        except OSError:
            _LIBC.append(None)
    return _LIBC[0]


def _trim_heap() -> None:
    """Return the heap memory freed with a block to the system (glibc `malloc_trim`; a no-op elsewhere). A block's
    tensors and temporaries are mostly below glibc's mmap threshold, so without this the freed space piles up
    from block to block as fragmentation (docs/guides/large-models.md, "Measured")."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def map_large_allocations() -> bool:
    """Serve every allocation above `MMAP_THRESHOLD` (4 MiB) by its own memory map, returned to the system when it is
    freed (glibc `mallopt(M_MMAP_THRESHOLD)`; process-wide). glibc's default threshold rises with each large block
    freed (up to 32 MiB), so a pruning step's many 4-32 MiB temporaries land on the heap, where they fragment and
    raise the peak (on the first four 1B blocks, Numerical Pruning's peak fell from 1.93 to 1.71 GB). A threshold set
    by the user through the environment variable `MALLOC_MMAP_THRESHOLD_` is left alone. Returns whether it was
    set."""
    libc = _libc()
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def _check_finite(layer: nn.Module, i: int, spec: ArchitectureSpec) -> None:
    for path in spec.linear_paths:
        w = layer.get_submodule(path).weight
        if not torch.isfinite(w).all():
            raise ValueError(
                f"Layer {i} `{path}` has NaN/Inf weights in the source checkpoint; pruning would spread them. Fix the "
                "checkpoint first. Nothing was written."
            )


def _output_param_names(model: nn.Module) -> set[str]:
    out = model.get_output_embeddings()
    if out is None:
        return set()
    emb = model.get_input_embeddings()
    if getattr(out, "weight", None) is getattr(emb, "weight", object()):
        return set()
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    return {names[id(p)] for p in out.parameters() if id(p) in names}


def load_low_memory(path: str | os.PathLike, *, torch_dtype: Any = None, **kwargs: Any) -> nn.Module:
    """A model whose decoder blocks stay on disk (see the module docstring); `kwargs` go to `from_config`
    (e.g. `attn_implementation`)."""

    register_pruned_architectures()
    source = SafetensorsSource(path)
    config = AutoConfig.from_pretrained(path)
    arch = spec_for_config(config)
    if arch is not None and arch.modality != "text":
        raise ValueError(
            f"{path} holds an image model ({config.model_type}): low_memory=True streams the blocks of causal LMs only. "
            "Vision transformers fit in memory: load it without low_memory."
        )
    dtype = torch_dtype if isinstance(torch_dtype, torch.dtype) else None
    dtype = dtype or getattr(config, "dtype", None) or source.float_dtype() or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    map_large_allocations()
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    model.eval()
    spec = get_spec(model)
    state = model.state_dict(keep_vars=True)
    layers_prefix = spec.layers + "."
    _alias_fused_experts(source, model, spec)
    tied = {n for n in state if n not in source.files and n in _tied_names(model)}
    missing = sorted(n for n in state if n not in source.files and n not in tied)
    unexpected = sorted(set(source.files) - set(state))
    if missing or unexpected:
        raise ValueError(
            f"{path} does not match its config.json: missing {missing[:4]}, unexpected {unexpected[:4]}. low_memory=True "
            "needs a checkpoint saved by transformers / optimum_prune for this architecture."
        )
    lazy = _output_param_names(model)
    eager = [n for n in state if not n.startswith(layers_prefix) and n not in lazy and n not in tied]
    convert = [n for n in eager if source.entry(n).dtype.is_floating_point and source.entry(n).dtype != dtype]
    mapped = source.read([n for n in eager if n not in convert])  # memory-mapped: only the pages used are resident
    for name, t in {**mapped, **source.copies(convert, dtype)}.items():
        set_tensor_(model, name, t)
    if tied:
        model.tie_weights()
    store = LayerStore(model, spec, source, dtype)
    resident = model.state_dict(keep_vars=True)
    store.mapped = {n: resident[n] for n in mapped}
    setattr(model, STORE_ATTR, store)
    model.register_forward_pre_hook(_refuse_forward)
    logger.info("Loaded %s with low_memory=True: %d blocks stay on disk", path, len(get_layers(model, spec)))
    return model


def _alias_fused_experts(source: SafetensorsSource, model: nn.Module, spec: ArchitectureSpec) -> None:
    """A mixture-of-experts checkpoint stored one tensor per expert (as transformers saves it) is read as the
    model's fused experts."""
    if spec.moe is None:
        return
    for i, layer in enumerate(get_layers(model, spec)):
        view = layer_view(layer, i, spec, model.config)
        if not view.is_moe:
            continue
        block = layer_prefix(spec, i) + spec.mlp
        for name, (how, parts) in spec.moe.legacy_tensors(block, view.num_experts).items():
            if name not in source.files and all(p in source.files for p in parts):
                source.alias(name, how, parts)


def _tied_names(model: nn.Module) -> set[str]:
    keys = getattr(model, "_tied_weights_keys", None) or {}
    names = set(keys) if isinstance(keys, (dict, list, tuple, set)) else set()
    if getattr(model.config, "tie_word_embeddings", False):
        names |= {n for n, _ in model.named_parameters(remove_duplicate=False) if n.endswith("lm_head.weight")}
    return names


def _refuse_forward(model: nn.Module, args: tuple) -> None:
    raise RuntimeError(
        "This model was loaded with low_memory=True: its decoder blocks are on disk, not in memory, so it cannot run "
        "a forward pass. Save it (`pruner.save_pretrained(dir)`) and load the result with "
        "`AutoPrunedModelForCausalLM.from_pretrained(dir)` where it fits in memory."
    )
