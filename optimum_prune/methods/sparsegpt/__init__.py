from ..registry import register_pruning_method
from .config import SparseGPTConfig
from .pruner import SparseGPTPruner

__all__ = ["SparseGPTConfig", "SparseGPTPruner"]

register_pruning_method("sparsegpt", config_cls=SparseGPTConfig, pruner_cls=SparseGPTPruner)
