"""optimum_prune: prune Hugging Face transformers into smaller, faster checkpoints."""

from .auto import AutoPrunedModelForCausalLM, AutoPrunedModelForImageClassification, AutoPruner
from .config import CalibrationConfig, PruningConfig, StructuredPruningConfig
from .export import export_gguf
from .finetune import FinetuneConfig, FinetuneReport, PruningCallback, SparsityCallback, finetune_
from .methods.amp import AMPConfig
from .methods.fista import FistaConfig
from .methods.flap import FLAPConfig
from .methods.magnitude import MagnitudePruningConfig
from .methods.numerical import NumericalPruningConfig
from .methods.registry import available_methods, register_pruning_method
from .methods.ria import RIAConfig
from .methods.sparsegpt import SparseGPTConfig
from .methods.spp import SolutionPath, SPPConfig, SPPRIAConfig
from .methods.wanda import WandaConfig
from .modeling.architectures import UnsupportedArchitectureError, supported_model_types
from .modeling.auto_classes import register_pruned_architectures
from .modeling.semi_structured import to_semi_structured_
from .prune import compute_plan, prune_
from .report import PruningReport
from .serialization import load_pruned_model, save_pruned
from .version import __version__

register_pruned_architectures()

__all__ = [
    "AMPConfig",
    "AutoPruner",
    "AutoPrunedModelForCausalLM",
    "AutoPrunedModelForImageClassification",
    "CalibrationConfig",
    "FLAPConfig",
    "FinetuneConfig",
    "FinetuneReport",
    "FistaConfig",
    "MagnitudePruningConfig",
    "NumericalPruningConfig",
    "PruningCallback",
    "PruningConfig",
    "PruningReport",
    "RIAConfig",
    "SPPConfig",
    "SPPRIAConfig",
    "SolutionPath",
    "SparseGPTConfig",
    "SparsityCallback",
    "StructuredPruningConfig",
    "UnsupportedArchitectureError",
    "WandaConfig",
    "__version__",
    "available_methods",
    "compute_plan",
    "export_gguf",
    "finetune_",
    "load_pruned_model",
    "prune_",
    "register_pruning_method",
    "save_pruned",
    "supported_model_types",
    "to_semi_structured_",
]
