from ..registry import register_pruning_method
from .config import NumericalConfig
from .pruner import NumericalPruner

__all__ = ["NumericalConfig", "NumericalPruner"]

register_pruning_method("numerical", config_cls=NumericalConfig, pruner_cls=NumericalPruner)
