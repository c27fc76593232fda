"""`AutoPruner` (a thin façade over `prune_` and `save_pruned_model`), `AutoPrunedModelForCausalLM` and
`AutoPrunedModelForImageClassification`."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import logging
import os
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import torch
from torch import nn
from transformers import AutoConfig, AutoImageProcessor, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import IMAGE_PROCESSOR_NAME, PROCESSOR_NAME

from .config import PruningConfig
from .export import GGUFExportError, export_gguf
from .finetune import finetune_
from .hub import push_to_hub
from .methods.spp import search_solution_path
from .modeling.architectures import is_image_model, spec_for_config
from .modeling.auto_classes import auto_class_for_config, register_pruned_architectures
from .prune import prune_
from .report import PruningReport
from .serialization import load_pruned_model, save_pruned_model, strip_gguf_quantizer_
from .storage.safetensors_io import _gguf_error
from .storage.streaming import get_store, load_low_memory

__all__ = [
    "AutoPruner",
    "AutoPrunedModelForCausalLM",
    "AutoPrunedModelForImageClassification",
    "load_model_and_tokenizer",
    "load_image_processor",
]

logger = logging.getLogger(__name__)


def _dtype(value: Any) -> Any:
    if isinstance(value, str) and value != "auto":
        return getattr(torch, value)
    return value


_GGUF_PATCH = threading.RLock()  # held while `gguf.GGUFReader` is patched (`_gguf_read_once`)


@contextlib.contextmanager
def _gguf_read_once() -> Iterator[None]:
    """Within the block, each GGUF file is parsed once. transformers parses a file's metadata for the config, again
    for the weights and again for the tokenizer, each time all of it (SmolLM2's 49k-entry vocabulary: about a third
    of its load time, ~5 s on a 2-core CPU): `gguf.GGUFReader`, which it imports at each call, returns here one
    reader per file (read-only, memory-mapped; dropped when the block ends). One load at a time holds the patch, so
    loads in other threads can neither restore another's reader nor keep one after their block."""
    with _GGUF_PATCH:
        make = gguf.GGUFReader
        readers: dict[tuple[str, str], Any] = {}

        def reader(path: str | os.PathLike, mode: str = "r") -> Any:
            key = (os.path.realpath(path), mode)
            if key not in readers:
                readers[key] = make(path, mode)
            return readers[key]

        gguf.GGUFReader = reader
        try:
            yield
        finally:
            gguf.GGUFReader = make


def load_model_and_tokenizer(
    path: str | os.PathLike,
    *,
    gguf_file: str | None = None,
    torch_dtype: Any = None,
    tokenizer: Any = None,
    **kwargs: Any,
) -> tuple[nn.Module, Any]:
    """Load a causal LM (also from a GGUF file, dequantized) and its tokenizer from a local path; an image model
    (ViT, DeiT, Dinov2: the image classifier or the backbone, as saved) and its image processor, if it has one."""

    register_pruned_architectures()
    if torch_dtype is not None:
        kwargs["dtype"] = _dtype(torch_dtype)
    if gguf_file is None and os.path.isfile(os.path.join(path, "config.json")):
        config = AutoConfig.from_pretrained(path)
        spec = spec_for_config(config)
        if spec is not None and spec.modality == "image":
            return _load_image_model(path, config, tokenizer, auto_class_for_config(config)[1], kwargs)
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    with _gguf_read_once() if gguf_file is not None else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        strip_gguf_quantizer_(model)
        if tokenizer is None:
            try:
                tokenizer = AutoTokenizer.from_pretrained(path, **({"gguf_file": gguf_file} if gguf_file else {}))
            except (OSError, ValueError) as e:
                logger.warning("No tokenizer found at %s (%s); pass `tokenizer=` to use text calibration.", path, e)
    return model, tokenizer


def _load_image_model(path, config, processor, auto_cls, kwargs) -> tuple[nn.Module, Any]:
    model = auto_cls.from_pretrained(path, **kwargs)
    if processor is None:
        processor = load_image_processor(path)
    return model, processor


def load_image_processor(path: str | os.PathLike) -> Any:
    """The image processor saved in the directory `path`, or `None` when it holds none (calibration then takes pixel
    values). Loading one needs Pillow (the `vision` extra); a model directory without one needs nothing more.

    Raises:
        `ImportError` naming the extra when `path` holds an image processor and Pillow is not installed.
    """
    if not any((Path(path) / name).is_file() for name in (IMAGE_PROCESSOR_NAME, PROCESSOR_NAME)):
        logger.info("No image processor at %s; calibrate with pixel values.", path)
        return None
    if importlib.util.find_spec("PIL") is None:
        raise ImportError(
            f"{path} holds an image processor; loading it needs Pillow: pip install 'optimum-prune[vision]'."
        )
    try:
        return AutoImageProcessor.from_pretrained(path)
    except (OSError, ValueError) as e:
        logger.warning("Could not load the image processor at %s (%s); calibrate with pixel values.", path, e)
        return None


class AutoPruner:
    """Load a model, prune it with any registered method, save the result.

    Example:
    ```python
    pruner = AutoPruner.from_pretrained("path/to/model")
    report = pruner.prune(NumericalConfig(pruning_ratio=0.2), calibration=CalibrationConfig(dataset="texts/"))
    pruner.save_pretrained("out/")
    ```

    Args:
        model (`PreTrainedModel`): the model to prune (modified in place).
        tokenizer (`PreTrainedTokenizerBase | None`): used for calibration text and saved with the model; for an
            image model, its image processor (saved with the model; calibration takes pixel values).
        keep_teacher (`bool`, defaults to `False`): keep a CPU copy of this in-memory model before its first
            pruning, as the teacher of a later distillation (`finetune` with `FinetuneConfig(distill=...)`). It
            doubles the model's memory, so it is off unless asked for. A pruner made by `from_pretrained(path)`
            never needs it: its teacher is reloaded from the path when distillation asks for it.
    """

    def __init__(self, model: nn.Module, tokenizer: Any = None, *, keep_teacher: bool = False) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.reports: list[PruningReport] = []
        self.finetune_reports: list = []
        self.solution_path = None  # the SolutionPath of the last SPP search or extraction
        # Distillation teacher = the model as loaded: reloaded from its source when it has one (no extra memory
        # until it is needed); an in-memory model is copied to the CPU before its first pruning with keep_teacher.
        self.keep_teacher = keep_teacher
        self._source: dict[str, Any] | None = None
        self._teacher: nn.Module | None = None

    @classmethod
    def from_pretrained(
        cls,
        model_or_path: nn.Module | str | os.PathLike,
        *,
        tokenizer: Any = None,
        gguf_file: str | None = None,
        torch_dtype: Any = None,
        low_memory: bool = False,
        offload_dir: str | os.PathLike | None = None,
        keep_teacher: bool = False,
        **kwargs: Any,
    ) -> AutoPruner:
        """From a local path (or GGUF file in it) or an already loaded `PreTrainedModel`.

        Causal LMs load as `AutoModelForCausalLM`; image models (ViT, DeiT, Dinov2) as the class they were saved
        from (`*ForImageClassification`, or the backbone such as `Dinov2Model`), with their image processor.

        Args:
            model_or_path (`PreTrainedModel | str | os.PathLike`): model, directory, or the path of a `.gguf` file
                (dequantized on load).
            tokenizer (`PreTrainedTokenizerBase | None`): defaults to the one stored with the model (the image
                processor for image models).
            gguf_file (`str | None`): GGUF file name inside the directory (dequantized on load).
            torch_dtype (`torch.dtype | str | None`): dtype to load in.
            low_memory (`bool`, defaults to `False`): keep the decoder blocks on disk (a safetensors checkpoint,
                memory-mapped) and bring one at a time into memory while pruning; `save_pretrained` then writes the
                result shard by shard. For models larger than memory (see `optimum_prune.storage.streaming`).
            offload_dir (`str | os.PathLike | None`): low-memory: where pruned blocks (and spilled activations) are
                written until the save (default: the `checkpoint_dir` of `prune`, else the system temporary
                directory; it needs about the size of the pruned model, on the same file system as the output
                to avoid copies).
            keep_teacher (`bool`, defaults to `False`): for an in-memory model, see `AutoPruner`; a model loaded
                from a path reloads its distillation teacher from there (no copy is kept).
            kwargs: passed to the Auto class's `from_pretrained` (low-memory: to `from_config`).
        """
        if isinstance(model_or_path, nn.Module):
            strip_gguf_quantizer_(model_or_path)
            return cls(model_or_path, tokenizer, keep_teacher=keep_teacher)
        if gguf_file is None and os.fspath(model_or_path).endswith(".gguf") and os.path.isfile(model_or_path):
            model_or_path, gguf_file = os.path.split(os.path.abspath(model_or_path))  # a .gguf file's own path
        if low_memory:
            return cls._low_memory(model_or_path, tokenizer, gguf_file, torch_dtype, offload_dir, kwargs)
        model, tok = load_model_and_tokenizer(
            model_or_path, gguf_file=gguf_file, torch_dtype=torch_dtype, tokenizer=tokenizer, **kwargs
        )
        pruner = cls(model, tok)
        pruner._source = {"path": os.fspath(model_or_path), "gguf_file": gguf_file, "torch_dtype": torch_dtype,
                          "kwargs": kwargs}  # fmt: skip
        return pruner

    @classmethod
    def _low_memory(cls, path, tokenizer, gguf_file, torch_dtype, offload_dir, kwargs) -> AutoPruner:
        if gguf_file is not None:
            raise _gguf_error(Path(path) / gguf_file)
        model = load_low_memory(path, torch_dtype=_dtype(torch_dtype), **kwargs)
        get_store(model).work_parent = Path(offload_dir) if offload_dir is not None else None
        if tokenizer is None:
            try:
                tokenizer = AutoTokenizer.from_pretrained(path)
            except (OSError, ValueError) as e:
                logger.warning("No tokenizer found at %s (%s); pass `tokenizer=` to use text calibration.", path, e)
        pruner = cls(model, tokenizer)
        pruner._source = {"path": os.fspath(path), "gguf_file": None, "torch_dtype": torch_dtype, "kwargs": kwargs}
        return pruner

    def prune(
        self, config: PruningConfig | list[PruningConfig], calibration: Any = None, **kwargs: Any
    ) -> PruningReport:
        """Run `prune_` on the model (a config, or a recipe: a list of configs); see `optimum_prune.prune_` (e.g.
        `checkpoint_dir=` to make the run resumable, `device=`, `activation_memory=`, `stats_cache=`)."""
        if self.keep_teacher and self._source is None and self._teacher is None and not self.reports:
            self._keep_teacher_copy()
        store = getattr(self.model, "_optimum_prune_store", None)
        if store is not None and store.work_parent is None and kwargs.get("checkpoint_dir") is not None:
            store.work_parent = Path(kwargs["checkpoint_dir"]).absolute().parent
        report = prune_(self.model, config, calibration, self.tokenizer, **kwargs)
        self.reports.append(report)
        self.solution_path = report.artifacts.get("solution_path", self.solution_path)
        return report

    def search_solution_path(self, config: PruningConfig, calibration: Any):
        """Run Solution Path Pruning's search (`SPPConfig`) and return the `SolutionPath`; the model is unchanged.

        Any ratio is then extracted without searching again: save the path (`path.save_pretrained(dir)`) and prune
        with `SPPConfig(pruning_ratio=r, solution_path=dir)`.
        """

        self.solution_path = search_solution_path(self.model, config, calibration, self.tokenizer)
        return self.solution_path

    def _keep_teacher_copy(self) -> None:
        """Before the first pruning of an in-memory model: a CPU copy of it, the default distillation teacher."""
        try:
            teacher = copy.deepcopy(self.model).to("cpu")
        except Exception as e:  # noqa: BLE001 - a model that cannot be copied simply has no default teacher
            logger.warning("Could not keep a copy of the unpruned model for distillation (%s); pass teacher=.", e)
            return
        teacher._optimum_prune_source = "copy of the in-memory model before pruning"
        self._teacher = teacher.eval()

    def teacher(self) -> nn.Module:
        """The model as it was before pruning (reloaded from its source path, or the copy kept at pruning time)."""
        if self._teacher is None and self._source is not None:
            src = self._source
            model, _ = load_model_and_tokenizer(
                src["path"], gguf_file=src["gguf_file"], torch_dtype=src["torch_dtype"], tokenizer=False,
                **src["kwargs"],
            )  # fmt: skip
            model._optimum_prune_source = src["path"] + (f" ({src['gguf_file']})" if src["gguf_file"] else "")
            self._teacher = model.eval()
        if self._teacher is None:
            raise ValueError(
                "No distillation teacher: this AutoPruner holds an in-memory model and no copy of it before pruning "
                "was kept (a copy doubles the memory, so it is made only on request). Make the pruner with "
                "AutoPruner(model, tokenizer, keep_teacher=True) before pruning, or load the model with "
                "AutoPruner.from_pretrained(path) (the teacher is then reloaded from the path), or pass the unpruned "
                "model as `teacher=` to finetune()."
            )
        return self._teacher

    def finetune(self, config: Any, dataset: Any, *, teacher: nn.Module | None = None, **kwargs: Any):
        """Recovery fine-tuning (`optimum_prune.finetune_`); with `config.distill`, the teacher defaults to the model
        as it was loaded before pruning (see `teacher()`: reloaded from its path, or the copy kept with
        `keep_teacher=True`; otherwise pass `teacher=`). Returns the `FinetuneReport`."""

        if getattr(config, "distill", None) is not None and teacher is None:
            teacher = self.teacher()
        self.model, report = finetune_(self.model, config, dataset, self.tokenizer, teacher=teacher, **kwargs)
        self.finetune_reports.append(report)
        if self._source is not None:
            self._teacher = None  # reloadable: free its memory
        return report

    def save_pretrained(self, save_directory: str | os.PathLike, *, overwrite: bool = False, **kwargs: Any):
        """Save model, tokenizer and `pruning_config.json` atomically (see `save_pruned_model`). In a
        `torch.distributed` run, rank 0 writes; calling it on every rank or on rank 0 alone both work."""
        return save_pruned_model(self.model, save_directory, self.tokenizer, overwrite=overwrite, **kwargs)

    def export_gguf(self, path: str | os.PathLike, outtype: str = "f16", *, overwrite: bool = False) -> Path:
        """Write the (pruned) causal LM as a GGUF file for llama.cpp / Ollama with the tokenizer this pruner holds
        (see `optimum_prune.export_gguf`: `outtype` is `"f32"`, `"f16"`, `"bf16"` or `"q8_0"`); returns its path."""
        if get_store(self.model) is not None:
            raise GGUFExportError(
                "A low-memory model keeps its blocks on disk: save it first (pruner.save_pretrained(dir)), then "
                "export the directory: optimum_prune.export_gguf(dir, path)."
            )
        if self.tokenizer is None:
            raise GGUFExportError(
                "A GGUF file carries the tokenizer and this AutoPruner holds none: set pruner.tokenizer (the model's "
                "Hugging Face tokenizer) first."
            )
        return export_gguf(self.model, path, outtype, tokenizer=self.tokenizer, overwrite=overwrite)

    def push_to_hub(self, repo_id: str, **kwargs: Any):
        """Upload exactly what `save_pretrained` writes to the Hub, in one commit (`optimum_prune.hub.push_to_hub`:
        `private`, `token`, `commit_message`, `revision`, `create_pr`, `model_card`)."""

        return push_to_hub(self.model, repo_id, self.tokenizer, **kwargs)


class AutoPrunedModelForCausalLM:
    """Loads any causal LM saved by optimum_prune, uniform or with per-layer shapes, exactly."""

    _task = "causal-lm"

    def __init__(self) -> None:
        raise OSError("Use AutoPrunedModelForCausalLM.from_pretrained(path).")

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, torch_dtype: Any = None, **kwargs: Any) -> nn.Module:
        if torch_dtype is not None:
            kwargs["dtype"] = _dtype(torch_dtype)
        model = load_pruned_model(path, task=cls._task, **kwargs)
        model.push_to_hub = types.MethodType(_push_loaded, model)  # uploads the optimum-prune checkpoint format
        model._optimum_prune_path = os.fspath(path)
        return model


class AutoPrunedModelForImageClassification(AutoPrunedModelForCausalLM):
    """Loads any image classifier (ViT, DeiT, Dinov2) saved by optimum_prune, uniform or with per-layer shapes,
    exactly. (A pruned backbone such as `Dinov2Model` loads with `transformers.AutoModel` once optimum_prune is
    imported, or with `optimum_prune.load_pruned_model`.)"""

    _task = "image-classification"

    def __init__(self) -> None:
        raise OSError("Use AutoPrunedModelForImageClassification.from_pretrained(path).")


def _push_loaded(model: nn.Module, repo_id: str, tokenizer: Any = None, **kwargs: Any):
    """`push_to_hub` of a model loaded by `AutoPrunedModelForCausalLM`: the same folder `save_pretrained` writes
    (checkpoint, `pruning_config.json`, model card), with the tokenizer saved beside the checkpoint by default."""

    if tokenizer is None:
        path = model._optimum_prune_path
        if is_image_model(model):
            tokenizer = load_image_processor(path)
        else:
            try:
                tokenizer = AutoTokenizer.from_pretrained(path)
            except (OSError, ValueError):
                logger.warning("No tokenizer in %s; uploading the model without one.", path)
    return push_to_hub(model, repo_id, tokenizer, **kwargs)
