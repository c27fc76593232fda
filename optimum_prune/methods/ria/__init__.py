from ..registry import register_pruning_method
from .config import RIAConfig
from .pruner import RIAPruner

__all__ = ["RIAConfig", "RIAPruner"]

register_pruning_method("ria", config_cls=RIAConfig, pruner_cls=RIAPruner)
