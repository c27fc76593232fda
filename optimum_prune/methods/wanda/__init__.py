from ..registry import register_pruning_method
from .config import WandaConfig
from .pruner import WandaPruner

__all__ = ["WandaConfig", "WandaPruner"]

register_pruning_method("wanda", config_cls=WandaConfig, pruner_cls=WandaPruner)
