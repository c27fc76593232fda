from ..._deprecation import deprecated_getattr, renamed
from ..registry import register_pruning_method
from .config import NumericalConfig
from .pruner import NumericalPruner

__all__ = ["NumericalConfig", "NumericalPruner"]

register_pruning_method("numerical", config_cls=NumericalConfig, pruner_cls=NumericalPruner)

# old names, kept for one release
__getattr__ = deprecated_getattr(__name__, globals(), renamed(__name__, NumericalPruningConfig="NumericalConfig"))
