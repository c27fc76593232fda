"""2:4 weights → PyTorch's semi-structured sparse tensors, where the installed torch and the GPU support them.

Zeros in dense weights never make a model faster. A 2:4 pattern can, on NVIDIA GPUs with sparse tensor cores
(compute capability ≥ 8.0: Ampere, Ada, Hopper), through PyTorch's semi-structured tensors (cuSPARSELt or CUTLASS
kernels), mostly for large matrix products (prefill, big batches). Each product through them also pays host work
(the tensor subclass's Python dispatch, cuSPARSELt's per-call plan), which a CUDA graph replay does not repeat.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.sparse import SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS
from transformers.pytorch_utils import Conv1D

from ..functional.masks import is_valid_nm
from .architectures import get_layers, get_spec, weight_oi

__all__ = ["check_semi_structured_support", "to_semi_structured_", "find_non_24_layers", "SEMI_STRUCTURED_BACKENDS"]

SEMI_STRUCTURED_BACKENDS = ("auto", "cusparselt", "cutlass")

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


def _sparse_tensor_class(backend: str) -> type:
    """PyTorch's semi-structured tensor class of `backend` (`"auto"`: cuSPARSELt where this torch has it, else
    CUTLASS), chosen per call rather than through PyTorch's global `_FORCE_CUTLASS` switch."""
    cusparselt = torch.backends.cusparselt.is_available()
    if backend == "cusparselt" and not cusparselt:
        raise RuntimeError(
            f"torch {torch.__version__} was built without cuSPARSELt; use backend='cutlass' (or 'auto')."
        )
    if backend == "cutlass" or (backend == "auto" and not cusparselt):
        return SparseSemiStructuredTensorCUTLASS
    return SparseSemiStructuredTensorCUSPARSELT


def to_semi_structured_(
    model: nn.Module, dtype: torch.dtype = torch.float16, device: str = "cuda", backend: str = "auto"
) -> list[str]:
    """Replace the weights of every 2:4-pruned projection by a semi-structured sparse tensor, in place.

    The model is moved to `device` and `dtype` (fp16 / bf16, as the kernels require). Checks the pattern of every
    projection, the backend and the hardware before changing anything. Each weight is compressed once, here. Every
    sparse product also costs host work (PyTorch's tensor-subclass dispatch; in torch versions without a plan cache,
    cuSPARSELt's matmul plan), which a replayed CUDA graph (`torch.cuda.graph`, or `torch.compile` with
    `mode="reduce-overhead"`) does not repeat.

    Args:
        backend (`str`, defaults to `"auto"`): `"cusparselt"`, `"cutlass"` or `"auto"` (cuSPARSELt where this torch
            was built with it, else CUTLASS).

    Returns:
        The converted projections, `layers.<i>.<path>`.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"2:4 kernels take float16 or bfloat16 weights, got {dtype}.")
    if backend not in SEMI_STRUCTURED_BACKENDS:
        raise ValueError(f"backend must be one of {SEMI_STRUCTURED_BACKENDS}, got {backend!r}.")
    bad = find_non_24_layers(model)
    if bad:
        raise ValueError(
            f"{len(bad)} projections are not 2:4 sparse (e.g. {bad[:3]}); prune with pattern='2:4' first "
            "(e.g. SparseGPTConfig(pattern='2:4'))."
        )
    check_semi_structured_support(device)
    sparse_cls = _sparse_tensor_class(backend)

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
                mod.weight = nn.Parameter(sparse_cls.from_dense(mod.weight.detach().contiguous()), requires_grad=False)
            except (RuntimeError, ValueError) as e:  # e.g. shapes below the kernels' minimum tile sizes
                logger.warning("layers.%d.%s left dense: %s", i, path, e)
                continue
            converted.append(f"layers.{i}.{path}")
    logger.info(
        "Converted %d projections to 2:4 semi-structured sparse tensors (%s)", len(converted), sparse_cls.__name__
    )
    return converted
