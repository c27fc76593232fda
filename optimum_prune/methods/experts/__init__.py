from ..registry import register_pruning_method
from .config import ExpertConfig
from .pruner import ExpertPruner

__all__ = ["ExpertConfig", "ExpertPruner"]

register_pruning_method("experts", config_cls=ExpertConfig, pruner_cls=ExpertPruner)
