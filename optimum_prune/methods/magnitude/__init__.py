from ..registry import register_pruning_method
from .config import MagnitudeConfig
from .pruner import MagnitudePruner

__all__ = ["MagnitudeConfig", "MagnitudePruner"]

register_pruning_method("magnitude", config_cls=MagnitudeConfig, pruner_cls=MagnitudePruner)
