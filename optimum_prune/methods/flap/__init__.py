from ..registry import register_pruning_method
from .config import FLAPConfig
from .pruner import FLAPPruner

__all__ = ["FLAPConfig", "FLAPPruner"]

register_pruning_method("flap", config_cls=FLAPConfig, pruner_cls=FLAPPruner)
