"""2:4 weights → PyTorch's semi-structured sparse tensors, where the installed torch and the GPU support them.

Zeros in dense weights never make a model faster. A 2:4 pattern can, on NVIDIA GPUs with sparse tensor cores
(compute capability ≥ 8.0: Ampere, Ada, Hopper), through `torch.sparse.to_sparse_semi_structured` (CUTLASS /
cuSPARSELt kernels), mostly for large matrix products (prefill, big batches).
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.sparse import to_sparse_semi_structured
from transformers.pytorch_utils import Conv1D

from ..functional.masks import is_valid_nm
from .architectures import get_layers, get_spec, weight_oi

__all__ = ["check_semi_structured_support", "to_semi_structured_", "find_non_24_layers"]

logger = logging.getLogger(__name__)


def check_semi_structured_support(device: torch.device | str | None = None) -> None:
    """Raise a `RuntimeError` that says what is missing when 2:4 kernels cannot run here."""
    if not hasattr(torch.sparse, "to_sparse_semi_structured"):
        raise RuntimeError(
            f"torch {torch.__version__} has no torch.sparse.to_sparse_semi_structured; install torch >= 2.1."
        )
    if not torch.cuda.is_available():
        raise RuntimeError(
            "2:4 semi-structured sparse kernels need an NVIDIA GPU with compute capability >= 8.0 (Ampere or newer); "
            "no CUDA device is available. The 2:4 checkpoint itself stays valid: it runs as a dense model here."
        )
    dev = torch.device(device or "cuda")
    cap = torch.cuda.get_device_capability(dev)
    if cap < (8, 0):
        raise RuntimeError(f"{torch.cuda.get_device_name(dev)} has compute capability {cap}; 2:4 kernels need >= 8.0.")


def find_non_24_layers(model: nn.Module) -> list[str]:
    """Names of the prunable projections whose weight is not a valid 2:4 pattern along the input dimension."""
    spec = get_spec(model)
    bad = []
    for i, layer in enumerate(get_layers(model, spec)):
        for path in spec.linear_paths:
            if not is_valid_nm(weight_oi(layer.get_submodule(path)).detach(), 2, 4):
                bad.append(f"layers.{i}.{path}")
    return bad


def to_semi_structured_(model: nn.Module, dtype: torch.dtype = torch.float16, device: str = "cuda") -> list[str]:
    """Replace the weights of every 2:4-pruned projection by a semi-structured sparse tensor, in place.

    The model is moved to `device` and `dtype` (fp16 / bf16, as the kernels require). Checks the pattern of every
    projection and the hardware before changing anything.

    Returns:
        The converted projections, `layers.<i>.<path>`.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"2:4 kernels take float16 or bfloat16 weights, got {dtype}.")
    bad = find_non_24_layers(model)
    if bad:
        raise ValueError(
            f"{len(bad)} projections are not 2:4 sparse (e.g. {bad[:3]}); prune with pattern='2:4' first "
            "(e.g. SparseGPTConfig(pattern='2:4'))."
        )
    check_semi_structured_support(device)

    model.to(device=device, dtype=dtype)
    spec = get_spec(model)
    converted = []
    for i, layer in enumerate(get_layers(model, spec)):
        for path in spec.linear_paths:
            mod = layer.get_submodule(path)
            if isinstance(mod, Conv1D):
                logger.warning("layers.%d.%s is a Conv1D (weights transposed); left dense", i, path)
                continue
            try:
                mod.weight = nn.Parameter(
                    to_sparse_semi_structured(mod.weight.detach().contiguous()), requires_grad=False
                )
            except (RuntimeError, ValueError) as e:  # e.g. shapes below the kernels' minimum tile sizes
                logger.warning("layers.%d.%s left dense: %s", i, path, e)
                continue
            converted.append(f"layers.{i}.{path}")
    logger.info("Converted %d projections to 2:4 semi-structured sparse tensors", len(converted))
    return converted
