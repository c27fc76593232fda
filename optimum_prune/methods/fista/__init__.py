from ..registry import register_pruning_method
from .config import FISTAConfig
from .pruner import FISTAPruner

__all__ = ["FISTAConfig", "FISTAPruner"]

register_pruning_method("fista", config_cls=FISTAConfig, pruner_cls=FISTAPruner)
