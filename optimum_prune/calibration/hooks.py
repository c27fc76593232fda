"""Hooks that capture module inputs; they are always removed, even when the forward raises."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["capture_inputs"]


@contextmanager
def capture_inputs(modules: dict[str, nn.Module], callback: Callable[[str, torch.Tensor], None]) -> Iterator[None]:
    """Call `callback(name, x)` with the (detached) first positional input of each module on every forward."""
    handles = []

    def make_hook(name: str):
        def hook(_module: nn.Module, args: tuple) -> None:
            callback(name, args[0].detach())

        return hook

    try:
        for name, module in modules.items():
            handles.append(module.register_forward_pre_hook(make_hook(name)))
        yield
    finally:
        for h in handles:
            h.remove()
