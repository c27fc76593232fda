from ..registry import register_pruning_method
from .config import AMPConfig
from .pruner import AMPPruner

__all__ = ["AMPConfig", "AMPPruner"]

register_pruning_method("amp", config_cls=AMPConfig, pruner_cls=AMPPruner)
