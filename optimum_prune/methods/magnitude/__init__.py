from ..._deprecation import deprecated_getattr, renamed
from ..registry import register_pruning_method
from .config import MagnitudeConfig
from .pruner import MagnitudePruner

__all__ = ["MagnitudeConfig", "MagnitudePruner"]

register_pruning_method("magnitude", config_cls=MagnitudeConfig, pruner_cls=MagnitudePruner)

# old names, kept for one release
__getattr__ = deprecated_getattr(__name__, globals(), renamed(__name__, MagnitudePruningConfig="MagnitudeConfig"))
