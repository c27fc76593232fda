from ..registry import register_pruning_method
from .config import NumericalPruningConfig
from .pruner import NumericalPruner

__all__ = ["NumericalPruningConfig", "NumericalPruner"]

register_pruning_method("numerical", config_cls=NumericalPruningConfig, pruner_cls=NumericalPruner)
