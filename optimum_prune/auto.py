"""`AutoPruner` (a thin façade over `prune_` and `save_pruned`) and `AutoPrunedModelForCausalLM`."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from .config import PruningConfig
from .prune import prune_
from .report import PruningReport
from .serialization import load_pruned_model, save_pruned, strip_gguf_quantizer_

__all__ = ["AutoPruner", "AutoPrunedModelForCausalLM", "load_model_and_tokenizer"]

logger = logging.getLogger(__name__)


def _dtype(value: Any) -> Any:
    if isinstance(value, str) and value != "auto":
        return getattr(torch, value)
    return value


def load_model_and_tokenizer(
    path: str | os.PathLike,
    *,
    gguf_file: str | None = None,
    torch_dtype: Any = None,
    tokenizer: Any = None,
    **kwargs: Any,
) -> tuple[nn.Module, Any]:
    """Load a causal LM (also from a GGUF file, dequantized) and its tokenizer from a local path."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .modeling.auto_classes import register_pruned_architectures

    register_pruned_architectures()
    if torch_dtype is not None:
        kwargs["dtype"] = _dtype(torch_dtype)
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    strip_gguf_quantizer_(model)
    if tokenizer is None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, **({"gguf_file": gguf_file} if gguf_file else {}))
        except (OSError, ValueError) as e:
            logger.warning("No tokenizer found at %s (%s); pass `tokenizer=` to use text calibration.", path, e)
    return model, tokenizer


class AutoPruner:
    """Load a model, prune it with any registered method, save the result.

    Example:
    ```python
    pruner = AutoPruner.from_pretrained("path/to/model")
    report = pruner.prune(NumericalPruningConfig(pruning_ratio=0.2), calibration=CalibrationConfig(dataset="texts/"))
    pruner.save_pretrained("out/")
    ```

    Args:
        model (`PreTrainedModel`): the model to prune (modified in place).
        tokenizer (`PreTrainedTokenizerBase | None`): used for calibration text and saved with the model.
    """

    def __init__(self, model: nn.Module, tokenizer: Any = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.reports: list[PruningReport] = []

    @classmethod
    def from_pretrained(
        cls,
        model_or_path: nn.Module | str | os.PathLike,
        *,
        tokenizer: Any = None,
        gguf_file: str | None = None,
        torch_dtype: Any = None,
        **kwargs: Any,
    ) -> AutoPruner:
        """From a local path (or GGUF file in it) or an already loaded `PreTrainedModel`.

        Args:
            model_or_path (`PreTrainedModel | str | os.PathLike`): model or directory.
            tokenizer (`PreTrainedTokenizerBase | None`): defaults to the one stored with the model.
            gguf_file (`str | None`): GGUF file name inside the directory (dequantized on load).
            torch_dtype (`torch.dtype | str | None`): dtype to load in.
            kwargs: passed to `AutoModelForCausalLM.from_pretrained`.
        """
        if isinstance(model_or_path, nn.Module):
            strip_gguf_quantizer_(model_or_path)
            return cls(model_or_path, tokenizer)
        model, tok = load_model_and_tokenizer(
            model_or_path, gguf_file=gguf_file, torch_dtype=torch_dtype, tokenizer=tokenizer, **kwargs
        )
        return cls(model, tok)

    def prune(
        self, config: PruningConfig | list[PruningConfig], calibration: Any = None, **kwargs: Any
    ) -> PruningReport:
        """Run `prune_` on the model (a config, or a recipe: a list of configs); see `optimum_prune.prune_`."""
        report = prune_(self.model, config, calibration, self.tokenizer, **kwargs)
        self.reports.append(report)
        return report

    def save_pretrained(self, save_directory: str | os.PathLike, *, overwrite: bool = False, **kwargs: Any):
        """Save model, tokenizer and `pruning_config.json` atomically (see `save_pruned`)."""
        return save_pruned(self.model, save_directory, self.tokenizer, overwrite=overwrite, **kwargs)


class AutoPrunedModelForCausalLM:
    """Loads any checkpoint saved by optimum_prune, uniform or with per-layer shapes, exactly."""

    def __init__(self) -> None:
        raise OSError("Use AutoPrunedModelForCausalLM.from_pretrained(path).")

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, torch_dtype: Any = None, **kwargs: Any) -> nn.Module:
        if torch_dtype is not None:
            kwargs["dtype"] = _dtype(torch_dtype)
        return load_pruned_model(path, **kwargs)
