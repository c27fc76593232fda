"""PEFT adapters on pruned models: saving the pruned base beside its adapter, and merging a saved adapter.

`save_pruned_model` on a `PeftModel` (LoRA trained with `merge=False`) writes the pruned base checkpoint (exactly as
without the adapter) and a standard PEFT adapter in `adapter/`, which loads on that base:
```python
base = AutoPrunedModelForCausalLM.from_pretrained("out/")
model = PeftModel.from_pretrained(base, "out/adapter")
```
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from peft import PeftModel
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors import safe_open
from torch import nn

from .sparsity import merge_masked_, sparsity_masks

__all__ = ["ADAPTER_SUBDIR", "is_peft_model", "lora_removed", "merge_adapter"]

logger = logging.getLogger(__name__)

ADAPTER_SUBDIR = "adapter"


def is_peft_model(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


@contextlib.contextmanager
def lora_removed(peft_model: nn.Module) -> Iterator[nn.Module]:
    """The base model with every LoRA layer temporarily replaced by its original layer (restored on exit)."""

    base = peft_model.get_base_model()
    swapped = []
    for name, module in list(base.named_modules()):
        if isinstance(module, BaseTunerLayer) and hasattr(module, "base_layer"):
            parent_name, _, child = name.rpartition(".")
            parent = base.get_submodule(parent_name) if parent_name else base
            setattr(parent, child, module.base_layer)
            swapped.append((parent, child, module))
    try:
        yield base
    finally:
        for parent, child, module in swapped:
            setattr(parent, child, module)


def _adapter_shapes(adapter_dir: Path) -> dict[str, tuple[int, ...]]:
    file = adapter_dir / "adapter_model.safetensors"
    if not file.is_file():
        raise FileNotFoundError(f"{adapter_dir} holds no adapter_model.safetensors; is it a PEFT adapter directory?")
    with safe_open(str(file), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - safe_open has no iter


def merge_adapter(model: nn.Module, adapter_dir: str | os.PathLike) -> nn.Module:
    """Load a saved LoRA adapter onto a (pruned) model and merge it into plain weights (masked: zeros stay zero).

    Every adapter matrix is checked against the shapes of the model's projections first: an adapter trained on a
    model pruned differently is refused, and the model is left untouched.
    """

    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{adapter_dir} has no adapter_config.json; pass the directory of a saved adapter.")
    modules = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    mismatched = []
    for key, shape in _adapter_shapes(adapter_dir).items():
        name = key.removeprefix("base_model.model.")
        for part in (".lora_A.weight", ".lora_B.weight"):
            if name.endswith(part):
                target = modules.get(name[: -len(part)])
                if target is None:
                    mismatched.append(f"{name[: -len(part)]} (missing)")
                elif (part == ".lora_A.weight" and shape[1] != target.in_features) or (
                    part == ".lora_B.weight" and shape[0] != target.out_features
                ):
                    mismatched.append(f"{name} {shape} vs layer {tuple(target.weight.shape)}")
    if mismatched:
        raise ValueError(
            f"The adapter in {adapter_dir} does not fit this model's shapes ({len(mismatched)} tensors, e.g. "
            f"{mismatched[:3]}): it was trained on a model pruned differently. Merge it into the model it was trained "
            "on (the checkpoint saved beside it). Nothing was changed."
        )
    masks = sparsity_masks(model)
    peft_model = PeftModel.from_pretrained(model, str(adapter_dir))
    with torch.no_grad():
        return merge_masked_(peft_model, masks)


def adapter_info(adapter_dir: Path) -> dict:
    with open(adapter_dir / "adapter_config.json", encoding="utf-8") as f:
        cfg = json.load(f)
    return {k: cfg.get(k) for k in ("peft_type", "r", "lora_alpha", "target_modules")}
