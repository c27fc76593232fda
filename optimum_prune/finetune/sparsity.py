"""Keeping unstructured / N:M zeros at zero through training: masks, `SparsityCallback`, masked LoRA and merge.

A mask is taken from the weights themselves (`weight != 0`) of every `nn.Linear` that has zeros. Full fine-tuning
re-applies the masks after each optimizer step (`SparsityCallback`); LoRA adds `mask ⊙ (B·A)` instead of the dense
`B·A` (`mask_lora_`), so the trained function is exactly the one `merge_masked_` produces, and a 2:4 model stays a
valid 2:4 model.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.lora import Linear as LoraLinear
from torch import nn
from transformers import TrainerCallback

__all__ = ["sparsity_masks", "apply_masks_", "SparsityCallback", "mask_lora_", "merge_masked_", "check_masks"]

logger = logging.getLogger(__name__)

# Below this fraction of zeros a projection is treated as dense (a random float is exactly 0 only by accident).
MIN_MASKED_FRACTION = 0.01


def _base_name(name: str) -> str:
    """Parameter-path of the plain model for a name inside a PEFT model (`base_model.model.` and `base_layer`)."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer", "")


def sparsity_masks(model: nn.Module, min_fraction: float = MIN_MASKED_FRACTION) -> dict[str, torch.Tensor]:
    """`{module path: bool mask of the weights to keep}` for every linear layer with at least `min_fraction` zeros.

    Paths are those of the plain model (a PEFT-wrapped model gives the same keys). The LM head and embeddings are
    never masked.
    """
    masks = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or name.endswith("lm_head") or "lora_" in name:
            continue
        w = module.weight
        if w.device.type == "meta" or w.numel() == 0:
            continue
        keep = w != 0
        if 1 - keep.float().mean().item() >= min_fraction:
            masks[_base_name(name)] = keep
    return masks


def _linear_modules(model: nn.Module) -> dict[str, nn.Linear]:
    return {_base_name(n): m for n, m in model.named_modules() if isinstance(m, nn.Linear) and "lora_" not in n}


@torch.no_grad()
def apply_masks_(model: nn.Module, masks: dict[str, torch.Tensor]) -> None:
    """Zero the masked-out weights in place."""
    modules = _linear_modules(model)
    for name, keep in masks.items():
        w = modules[name].weight
        w.mul_(keep.to(device=w.device, dtype=w.dtype))


def check_masks(model: nn.Module, masks: dict[str, torch.Tensor]) -> bool:
    """`True` when every masked-out weight is exactly zero."""
    modules = _linear_modules(model)
    return all(not modules[n].weight.detach()[~keep.to(modules[n].weight.device)].any() for n, keep in masks.items())


class SparsityCallback(TrainerCallback):
    """Keeps every pruned weight of an unstructured / N:M model at zero during any `transformers.Trainer` run.

    The masks are the current zeros of `model`'s linear layers, taken when the callback is created (create it
    after pruning, before training). They are re-applied after every optimizer step and at the end of training, so
    full fine-tuning never revives a pruned weight; under LoRA the base weights are frozen, and `mask_lora_` masks
    the low-rank update itself.

    Example:
    ```python
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[SparsityCallback(model)])
    ```

    Args:
        model (`PreTrainedModel`): the pruned model (or its PEFT wrapper).
        masks (`dict[str, torch.Tensor] | None`): explicit masks (`sparsity_masks` format); default: read them from
            the model's zeros.
    """

    def __init__(self, model: nn.Module, masks: dict[str, torch.Tensor] | None = None) -> None:
        self.model = model
        self.masks = sparsity_masks(model) if masks is None else masks
        if not self.masks:
            logger.warning("SparsityCallback: the model has no sparse linear layer; nothing to keep at zero.")

    def _apply(self, model: nn.Module | None) -> None:
        if self.masks:
            apply_masks_(model if model is not None else self.model, self.masks)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._apply(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self._apply(model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self._apply(model)


def _masked_lora_forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """`base(x) + dropout(x) @ (mask ⊙ ΔW)ᵀ`: a LoRA update restricted to the kept weights."""
    result = self.base_layer(x, *args, **kwargs)
    if self.disable_adapters or self.merged:
        return result
    for name in self.active_adapters:
        if name not in self.lora_A:
            continue
        a, b = self.lora_A[name].weight, self.lora_B[name].weight  # (r, in), (out, r)
        delta = (b @ a) * self.scaling[name] * self._sparsity_mask.to(a.dtype)  # (out, in)
        result = result + F.linear(self.lora_dropout[name](x.to(a.dtype)), delta).to(result.dtype)
    return result


def mask_lora_(peft_model: nn.Module, masks: dict[str, torch.Tensor]) -> int:
    """Make every LoRA layer whose base weight is masked add `mask ⊙ (B·A)`; returns the number of layers changed.

    The dense update costs one `(out, r) @ (r, in)` product per layer and forward, small next to the layer itself
    for the usual ranks.
    """

    count = 0
    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLinear) and _base_name(name) in masks:
            module.register_buffer(
                "_sparsity_mask", masks[_base_name(name)].to(module.weight.device), persistent=False
            )
            module.forward = types.MethodType(_masked_lora_forward, module)
            count += 1
    return count


@torch.no_grad()
def merge_masked_(peft_model: nn.Module, masks: dict[str, torch.Tensor]) -> nn.Module:
    """`merge_and_unload`, then zero the masked-out weights again: `W + mask ⊙ (B·A)`, exactly what was trained."""
    model = peft_model.merge_and_unload()
    if masks:
        apply_masks_(model, masks)
    return model
