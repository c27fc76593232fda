from ..._deprecation import deprecated_getattr, renamed
from ..registry import register_pruning_method
from .config import FISTAConfig
from .pruner import FISTAPruner

__all__ = ["FISTAConfig", "FISTAPruner"]

register_pruning_method("fista", config_cls=FISTAConfig, pruner_cls=FISTAPruner)

# old names, kept for one release
__getattr__ = deprecated_getattr(
    __name__, globals(), renamed(__name__, FistaConfig="FISTAConfig", FistaPruner="FISTAPruner")
)
