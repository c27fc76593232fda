from ..registry import register_pruning_method
from .config import NumericalConfig
from .pruner import NumericalPruner
from .serving import ServingPruner
from .serving_config import ServingConfig

__all__ = ["NumericalConfig", "NumericalPruner", "ServingConfig", "ServingPruner"]

register_pruning_method("numerical", config_cls=NumericalConfig, pruner_cls=NumericalPruner)
# NP's scores and refit, the shapes chosen per sublayer under a target (serving_config.py)
register_pruning_method("serving", config_cls=ServingConfig, pruner_cls=ServingPruner)
