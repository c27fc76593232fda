from ..registry import register_pruning_method
from .config import FistaConfig
from .pruner import FistaPruner

__all__ = ["FistaConfig", "FistaPruner"]

register_pruning_method("fista", config_cls=FistaConfig, pruner_cls=FistaPruner)
