"""Registering pruning methods: one explicit `register_pruning_method` call per method, validated here and recorded
in the one registry (`optimum_prune.config`)."""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from ..calibration.inputs import calibration_inputs
from ..config import PruningConfig, add_method, method_classes, method_names
from ..modeling.architectures import get_spec
from .base import BasePruner

__all__ = ["register_pruning_method", "get_config_class", "get_pruner_class", "available_methods", "prepare_pruner"]


def register_pruning_method(name: str, *, config_cls: type, pruner_cls: type) -> None:
    """Register a method so that `prune_` and `PruningConfig.from_dict` can find it.

    Validates that the name is lowercase snake_case and unused, that `config_cls.method == name`, that
    `pruner_cls.config_cls is config_cls`, and the base classes.
    """
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ValueError(f"Method name {name!r} must be lowercase snake_case.")
    if name in method_names():
        raise ValueError(f"A pruning method named {name!r} is already registered.")
    if not (isinstance(config_cls, type) and issubclass(config_cls, PruningConfig)):
        raise TypeError(f"{config_cls!r} must subclass PruningConfig.")
    if not (isinstance(pruner_cls, type) and issubclass(pruner_cls, BasePruner)):
        raise TypeError(f"{pruner_cls!r} must subclass BasePruner.")
    if config_cls.method != name:
        raise ValueError(f"{config_cls.__name__}.method is {config_cls.method!r}, expected {name!r}.")
    if pruner_cls.config_cls is not config_cls:
        raise ValueError(f"{pruner_cls.__name__}.config_cls must be {config_cls.__name__}.")
    add_method(name, config_cls, pruner_cls)


def get_config_class(name: str) -> type:
    return method_classes(name)[0]


def get_pruner_class(name: str) -> type:
    return method_classes(name)[1]


def available_methods() -> list[str]:
    return method_names()


def prepare_pruner(model: nn.Module, config: PruningConfig, calibration: Any, tokenizer: Any):
    """Validate everything and build what the pruner needs; touches no weight."""
    if not isinstance(config, PruningConfig):
        raise TypeError(f"`config` must be a PruningConfig subclass instance, got {type(config).__name__}.")
    spec = get_spec(model)
    pruner = get_pruner_class(config.method)(config)
    pruner.validate(model, spec)
    ids, calib_desc = calibration_inputs(model, calibration, tokenizer, [config.method] * pruner.requires_calibration)
    if ids is not None:
        pruner.attach_calibration(ids, calib_desc, source=calibration)
    return spec, pruner, ids, calib_desc
