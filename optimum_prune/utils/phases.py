"""Phase events: what a pruning run is doing, for observers such as a memory or timing profiler.

The pipeline and the layers below it mark their phases (`with phase("forward", block=i): ...`): the calibration
forward of a block, loading and releasing a low-memory block, writing a finished one, a method's decision and refit
hooks, measuring, saving. An observer registered with `observe_phases(callback)` receives `callback("start", name,
block)` and `callback("end", name, block)` around each; with none registered a phase costs one list check.

    with observe_phases(lambda event, name, block: print(event, name, block)):
        prune_(model, config, calibration=ids)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

__all__ = ["PhaseObserver", "observe_phases", "phase", "phased"]

PhaseObserver = Callable[[str, str, "int | None"], None]
_OBSERVERS: list[PhaseObserver] = []


@contextlib.contextmanager
def phase(name: str, block: int | None = None) -> Iterator[None]:
    """Mark the enclosed code as phase `name` (of decoder block `block`, where it is one block's work)."""
    if not _OBSERVERS:
        yield
        return
    observers = list(_OBSERVERS)
    for observer in observers:
        observer("start", name, block)
    try:
        yield
    finally:
        for observer in observers:
            observer("end", name, block)


def phased(name: str, block_arg: int | None = None) -> Callable:
    """Decorator: every call of the function is phase `name`; `block_arg`: the position of its block-index argument
    (counting `self`)."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not _OBSERVERS:
                return fn(*args, **kwargs)
            block = args[block_arg] if block_arg is not None and len(args) > block_arg else None
            with phase(name, block):
                return fn(*args, **kwargs)

        return wrapper

    return decorate


@contextlib.contextmanager
def observe_phases(observer: PhaseObserver) -> Iterator[None]:
    """Call `observer(event, name, block)` (`event`: `"start"` / `"end"`) around every phase while the block runs."""
    _OBSERVERS.append(observer)
    try:
        yield
    finally:
        _OBSERVERS.remove(observer)
