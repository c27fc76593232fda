"""Small helpers on nested tensor structures."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["move_to"]


def move_to(obj: Any, device: torch.device | str) -> Any:
    """Recursively move tensors inside tuples / lists / dicts to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(move_to(o, device) for o in obj)
    if isinstance(obj, list):
        return [move_to(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: move_to(v, device) for k, v in obj.items()}
    return obj
