from ..registry import register_pruning_method
from .config import ServingConfig
from .pruner import ServingPruner

__all__ = ["ServingConfig", "ServingPruner"]

register_pruning_method("serving", config_cls=ServingConfig, pruner_cls=ServingPruner)
