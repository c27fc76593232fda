from ..registry import register_pruning_method
from .config import MagnitudePruningConfig
from .pruner import MagnitudePruner

__all__ = ["MagnitudePruningConfig", "MagnitudePruner"]

register_pruning_method("magnitude", config_cls=MagnitudePruningConfig, pruner_cls=MagnitudePruner)
