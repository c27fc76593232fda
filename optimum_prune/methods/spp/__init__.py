"""Solution Path Pruning (Ding et al., ICLR 2025): one search, a whole family of pruned models."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..registry import prepare_pruner, register_pruning_method
from .config import SPPConfig, SPPRIAConfig
from .path import SolutionPath, SolutionPathError
from .pruner import SPPPruner
from .ria import SPPRIAPruner
from .search_data import SPPSearchError

__all__ = [
    "SPPConfig",
    "SPPRIAConfig",
    "SPPPruner",
    "SPPRIAPruner",
    "SolutionPath",
    "SolutionPathError",
    "SPPSearchError",
    "search_solution_path",
]

register_pruning_method("spp", config_cls=SPPConfig, pruner_cls=SPPPruner)
register_pruning_method("spp_ria", config_cls=SPPRIAConfig, pruner_cls=SPPRIAPruner)


def search_solution_path(model: nn.Module, config: SPPConfig, calibration: Any, tokenizer: Any = None) -> SolutionPath:
    """Run SPP's search on `model` (left unchanged) and return its `SolutionPath` (`AutoPruner.search_solution_path` calls this).

    Args:
        model (`PreTrainedModel`): a supported model.
        config (`SPPConfig`): the search settings (`pruning_ratio` is not used: the path serves every ratio).
        calibration (`CalibrationConfig | torch.LongTensor`): the data the search trains the masks on.
        tokenizer (`PreTrainedTokenizerBase | None`): tokenizes calibration text.
    """
    if not isinstance(config, SPPConfig):
        raise TypeError(f"search needs an SPPConfig, got {type(config).__name__}.")
    if config.solution_path is not None:
        raise ValueError("This config already names a `solution_path`; drop it to search.")
    if calibration is None:
        raise ValueError("The SPP search needs calibration data: pass `calibration=CalibrationConfig(dataset=...)`.")
    spec, pruner, _, _ = prepare_pruner(model, config, calibration, tokenizer)
    was_training = model.training
    model.eval()
    try:
        return pruner.search(model, spec)
    finally:
        model.train(was_training)
