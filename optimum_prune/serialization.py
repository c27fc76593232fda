"""Saving and loading pruned models: a stock safetensors checkpoint plus `pruning_config.json`.

- Uniform per-layer shapes (and biases a stock config can express): config.json is rewritten (explicit `head_dim`,
  head counts, intermediate size, bias flags) so plain `transformers.AutoModelForCausalLM` loads it.
- Per-layer shapes the DeciLM format holds (`modeling.decilm`: attention kept whole or removed per layer, MLP widths
  in multiples of 256, no bias, llama / mistral bases): `model_type = "nemotron-nas"` with `block_configs`, plus the
  configuration code its `auto_map` names, so vLLM, SGLang, TensorRT-LLM, MLX and llama.cpp's converter load it.
- Otherwise (also whenever head dimensions were pruned: q/k and v/o widths, kept rotary pairs and the softmax scale
  are per-layer fields no stock config has): `model_type = "optimum_pruned_<base>"` with the per-layer shapes in
  `pruned_layers`; the classes in
  `modeling.auto_classes` rebuild the skeleton and load it exactly (plain `AutoModelForCausalLM` too, once
  `optimum_prune` is imported).
`load_pruned_model` reads all three back exactly.
Writes go to a temporary directory next to the target, renamed into place at the end (or, for an existing empty
target directory, inside it, then moved up into it): a failure never leaves a half-written or corrupted directory.
Never pickles.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers import AutoConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from .card import model_card as make_card
from .constants import FINETUNE_ATTR, FORMAT_VERSION, HISTORY_ATTR, PRUNED_MODEL_TYPE_PREFIX, PRUNING_CONFIG_NAME
from .finetune.adapters import ADAPTER_SUBDIR, lora_removed
from .modeling.architectures import ArchitectureSpec, base_model_type, get_spec
from .modeling.auto_classes import (
    TASKS,
    auto_class_for_config,
    model_task,
    pruned_classes,
    register_pruned_architectures,
)
from .modeling.decilm import DECI_MODEL_TYPE, DeciLMConfig, deci_export, deci_problems
from .modeling.decilm import write_config_code as write_deci_code
from .modeling.shapes import layer_table
from .storage.sharded import save_streamed_
from .storage.streaming import get_store
from .utils.distributed import is_main_process, rank
from .utils.scratch import check_target, make_scratch_dir, publish_directory
from .version import __version__

__all__ = ["save_pruned_model", "load_pruned_model", "export_config", "strip_gguf_quantizer_"]

logger = logging.getLogger(__name__)

_BIAS_FLAGS = ("attention_bias", "mlp_bias")
FORMATS = ("auto", "deci")
_LOADERS = {  # the optimum_prune loader of each task
    "causal-lm": "AutoPrunedModelForCausalLM",
    "image-classification": "AutoPrunedModelForImageClassification",
    "feature-extraction": "transformers.AutoModel (after `import optimum_prune`)",
}


def strip_gguf_quantizer_(model: nn.Module) -> None:
    """A GGUF checkpoint is dequantized at load; drop the GGUF marker so the model saves as plain safetensors."""
    quantizer = getattr(model, "hf_quantizer", None)
    qcfg = getattr(model.config, "quantization_config", None)
    method = getattr(qcfg, "quant_method", None) if not isinstance(qcfg, dict) else qcfg.get("quant_method")
    if quantizer is not None and "gguf" in str(method).lower():
        model.hf_quantizer = None
        with contextlib.suppress(AttributeError):
            del model.config.quantization_config
        with contextlib.suppress(AttributeError):
            model.is_quantized = False


def _shapes_match(skeleton_sd: dict[str, torch.Tensor], sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Zero tensors to add so that `sd` fills the skeleton exactly, or `None` if it cannot (only biases may be added)."""
    extra = {}
    for k, v in skeleton_sd.items():
        if k in sd:
            if tuple(sd[k].shape) != tuple(v.shape):
                return None
        elif k.endswith(".bias"):
            extra[k] = None
        else:
            return None
    if set(sd) - set(skeleton_sd):
        return None
    return extra


def _skeleton_state(config, model_cls) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        return model_cls(config).state_dict()


def _stock_class(model: nn.Module) -> type:
    """The stock transformers class of `model` (a registered pruned class's base)."""
    cls = type(model)
    while cls.__module__ == pruned_classes.__module__:
        cls = cls.__bases__[0]
    return cls


def _set_intermediate(stock: dict[str, Any], key: str, width: int) -> bool:
    """Write an MLP width into a stock config dict; `False` when the config cannot express it (Dinov2's
    `mlp_ratio` must be an int: the width must be a multiple of the hidden size)."""
    if key != "mlp_ratio":
        stock[key] = width
        return True
    if width % stock["hidden_size"]:
        return False
    stock[key] = width // stock["hidden_size"]
    return True


def _uniform_row(shapes: list[dict]) -> dict | None:
    """The one shape every layer has (a stock config can express it), else `None`. Mixture-of-experts models may
    mix MoE layers with dense-MLP layers (Qwen3-MoE's `mlp_only_layers`, never pruned): the MoE layers' row."""
    if any("qk_head_dim" in s for s in shapes):  # pruned head dims: a stock config cannot express them
        return None
    moe_rows = [s for s in shapes if "num_experts" in s]
    first = moe_rows[0] if moe_rows else shapes[0]
    if moe_rows:
        attention = ("num_attention_heads", "num_key_value_heads", "head_dim", "biases")
        same_attention = all(all(s[k] == first[k] for k in attention) for s in shapes)
        return first if same_attention and all(s == first for s in moe_rows) else None
    return first if all(s == first for s in shapes) else None


def export_config(
    model: nn.Module, spec: ArchitectureSpec | None = None, format: str = "auto"
) -> tuple[Any, dict[str, torch.Tensor]]:
    """The config to save, and zero tensors to add to the state dict (biases a stock config flag requires).

    With `format="auto"`: a stock config when a stock model of that config has exactly the pruned model's tensors;
    else the DeciLM config (`model_type="nemotron-nas"`) when the DeciLM format holds the per-layer shapes; else the
    `optimum_pruned_<base>` config carrying `pruned_layers`. With `format="deci"`: the DeciLM config, or a
    `ValueError` naming what it cannot hold.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}.")
    spec = spec or get_spec(model)
    if format == "deci":
        return deci_export(model, spec)
    shapes = layer_table(model, spec)
    base_type = base_model_type(model.config.model_type)
    data = model.config.to_dict()
    for k in ("pruned_layers", "quantization_config", "_name_or_path", "transformers_version"):
        data.pop(k, None)
    data["model_type"] = base_type
    sd = dict(model.state_dict().items())
    first = _uniform_row(shapes)
    if first is not None:
        keys = spec.config_keys
        stock = dict(data)
        stock[keys["heads"]] = first["num_attention_heads"]
        if "kv_heads" in keys:
            stock[keys["kv_heads"]] = first["num_key_value_heads"]
        if "head_dim" in keys:
            stock[keys["head_dim"]] = first["head_dim"]
        if "num_experts" in first:
            stock[keys["experts"]] = first["num_experts"]
        base_config_cls = CONFIG_MAPPING[base_type]
        candidates = [stock] if _set_intermediate(stock, keys["intermediate"], first["intermediate_size"]) else []
        if first["biases"] and candidates:
            candidates.append({**stock, **{f: True for f in _BIAS_FLAGS if f in data}})
        for cand in candidates:
            try:
                config = base_config_cls.from_dict(cand)
                model_cls = _stock_class(model)
                skeleton = _skeleton_state(config, model_cls)
            except Exception as e:  # noqa: BLE001 - e.g. hidden_size not divisible by the new head count
                logger.debug("stock config not usable: %s", e)
                continue
            extra = _shapes_match(skeleton, sd)
            if extra is not None:
                zeros = {
                    k: torch.zeros(skeleton[k].shape, dtype=sd[k[: -len("bias")] + "weight"].dtype) for k in extra
                }
                config.architectures = [model_cls.__name__]
                return config, zeros
    if spec.modality == "text" and not deci_problems(model, spec):
        return deci_export(model, spec)
    config_cls, model_cls = pruned_classes(base_type, model_task(model))
    config = config_cls.from_dict({**data, "model_type": config_cls.model_type, "pruned_layers": shapes})
    config.architectures = [model_cls.__name__]
    extra = _shapes_match(_skeleton_state(config, model_cls), sd)
    if extra:
        raise RuntimeError(f"internal error: the pruned skeleton does not match the model ({sorted(extra)[:3]})")
    return config, {}


def save_pruned_model(
    model: nn.Module,
    save_directory: str | os.PathLike,
    tokenizer: Any = None,
    *,
    overwrite: bool = False,
    max_shard_size: str | int = "5GB",
    model_card: bool | dict = True,
    format: str = "auto",
) -> Path:
    """Save a (pruned) model as a stock safetensors checkpoint plus `pruning_config.json`, atomically.

    Args:
        model (`PreTrainedModel`): the model (also a GGUF-loaded one: it is saved dequantized).
        save_directory (`str | os.PathLike`): target: a new or an empty directory (e.g. made by `mkdir -p` or
            `tempfile.TemporaryDirectory()`); a non-empty one only with `overwrite=True`.
        tokenizer (`PreTrainedTokenizerBase | None`): saved alongside when given.
        overwrite (`bool`, defaults to `False`): replace an existing directory (still atomically).
        max_shard_size (`str | int`): passed to `save_pretrained`.
        model_card (`bool | dict`, defaults to `True`): write `README.md` (a `huggingface_hub.ModelCard`); a dict
            adds card fields (`base_model`, `license`, `evaluation`, ...; see `optimum_prune.card.model_card`).
        format (`str`, defaults to `"auto"`): `"auto"` writes the most widely loadable form of the shapes: a stock
            config (every layer alike), else the DeciLM format (`model_type="nemotron-nas"`, which vLLM, SGLang,
            TensorRT-LLM, MLX and llama.cpp's converter load), else optimum-prune's per-layer format. `"deci"`
            requires the DeciLM format and refuses, before writing anything, a model it cannot hold.

    A `PeftModel` (LoRA trained with `merge=False`) is saved as its pruned base plus a standard PEFT adapter in
    `adapter/`.

    In a `torch.distributed` run (`torchrun`, `accelerate launch`) every rank holds the same model and rank 0 writes
    it; the other ranks return at once. No collective is involved, so both the call on every rank and the usual
    `if rank == 0: save_pruned_model(...)` work. A rank that reads the directory afterwards waits for it first
    (`torch.distributed.barrier()` on every rank after the save).
    """
    target = Path(save_directory).absolute()
    if not is_main_process():
        logger.debug("rank %d: rank 0 saves %s", rank(), target)
        return target
    return _save_checked(model, target, tokenizer, overwrite, max_shard_size, model_card, format)


def _save_checked(model, target: Path, tokenizer, overwrite, max_shard_size, model_card, format) -> Path:
    is_peft = hasattr(model, "peft_config") and hasattr(model, "get_base_model")
    with lora_removed(model) if is_peft else contextlib.nullcontext(model) as base:
        export = export_config(base, format=format)  # refuses before anything is written
    where = check_target(target, overwrite)
    with contextlib.ExitStack() as stack:
        peft_model, adapter = None, None
        if is_peft:
            peft_model = model
            adapter = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=".adapter.", dir=where)))
            peft_model.save_pretrained(adapter)  # with the LoRA layers in place
            model = stack.enter_context(lora_removed(peft_model))
        return _save(model, target, where, tokenizer, max_shard_size, model_card, peft_model, adapter, export)


def _save(model, target, where, tokenizer, max_shard_size, model_card, peft_model, adapter, export) -> Path:
    spec = get_spec(model)
    config, extra = export
    tmp = make_scratch_dir(where, f".{target.name}", ".tmp")  # a killed save's is removed by the next one
    try:
        if get_store(model) is not None:  # low-memory model: its blocks are on disk, written shard by shard
            save_streamed_(model, spec, tmp, extra)
        else:
            state = {**model.state_dict(), **extra}
            quantizer = getattr(model, "hf_quantizer", None)
            model.hf_quantizer = None  # GGUF-loaded weights are already dequantized tensors
            try:
                model.save_pretrained(tmp, state_dict=state, max_shard_size=max_shard_size)
            finally:
                model.hf_quantizer = quantizer
        if isinstance(config, DeciLMConfig):  # every key written (readers default missing ones differently)
            config.to_json_file(tmp / "config.json", use_diff=False)
            write_deci_code(tmp)
        else:
            config.save_pretrained(tmp)  # replaces config.json with the exported config
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        side_car = {
            "format_version": FORMAT_VERSION,
            "optimum_prune_version": __version__,
            "transformers_version": transformers.__version__,
            "loadable_with_stock_transformers": config.model_type != DECI_MODEL_TYPE
            and not config.model_type.startswith(PRUNED_MODEL_TYPE_PREFIX),
            "format": _format_name(config),
            "layers": layer_table(model, spec),
            "history": getattr(model, HISTORY_ATTR, []),
        }
        finetune = getattr(peft_model, FINETUNE_ATTR, None) or getattr(model, FINETUNE_ATTR, [])
        if finetune:
            side_car["finetune"] = finetune
        with open(tmp / PRUNING_CONFIG_NAME, "w", encoding="utf-8") as f:
            json.dump(side_car, f, indent=2, default=str)
            f.write("\n")
        if adapter is not None:
            shutil.copytree(adapter, tmp / ADAPTER_SUBDIR)
        if model_card:
            make_card(model, side_car, config, **(model_card if isinstance(model_card, dict) else {})).save(
                tmp / "README.md"
            )
        publish_directory(tmp, target, where)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("Saved %s checkpoint to %s", side_car["format"], target)
    return target


def _format_name(config) -> str:
    if config.model_type == DECI_MODEL_TYPE:
        return "DeciLM (nemotron-nas)"
    return "optimum-prune per-layer" if config.model_type.startswith(PRUNED_MODEL_TYPE_PREFIX) else "stock"


def load_pruned_model(path: str | os.PathLike, task: str | None = None, **kwargs: Any) -> nn.Module:
    """Load any checkpoint written by `save_pruned_model`, exactly: missing, unexpected or resized tensors are errors.

    Args:
        path (`str | os.PathLike`): the directory.
        task (`str | None`): `"causal-lm"`, `"image-classification"` or `"feature-extraction"` (an image backbone
            such as `Dinov2Model`); `None` = the class the checkpoint was saved from (`config.json`).
        kwargs: passed to the Auto class's `from_pretrained` (e.g. `dtype`, `device_map`).
    """

    register_pruned_architectures()
    saved_task, auto_cls = auto_class_for_config(AutoConfig.from_pretrained(path))
    if task is not None and task != saved_task:
        raise ValueError(
            f"{path} holds a model for {saved_task}, not for {task}: load it with "
            f"{_LOADERS.get(saved_task, TASKS[saved_task][0].__name__)}.from_pretrained."
        )
    model, info = auto_cls.from_pretrained(path, output_loading_info=True, **kwargs)
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if problems:
        raise RuntimeError(f"{path} did not load exactly: {problems}")
    side_car = Path(path) / PRUNING_CONFIG_NAME
    if side_car.is_file():
        with open(side_car, encoding="utf-8") as f:
            data = json.load(f)
        setattr(model, HISTORY_ATTR, data.get("history", []))
        if data.get("finetune"):
            setattr(model, FINETUNE_ATTR, data["finetune"])
    return model
