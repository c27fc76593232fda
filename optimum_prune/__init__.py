"""optimum_prune: prune Hugging Face transformers into smaller, faster checkpoints."""

from .auto import AutoPrunedModelForCausalLM, AutoPrunedModelForImageClassification, AutoPruner
from .config import CalibrationConfig, PruningConfig, StructuredPruningConfig, UnstructuredPruningConfig
from .export import GGUFExportError, GGUFTokenizerError, export_gguf
from .finetune import FinetuneConfig, FinetuneReport, PruningCallback, SparsityCallback, finetune_
from .methods.amp import AMPConfig
from .methods.experts import ExpertConfig
from .methods.fista import FISTAConfig
from .methods.flap import FLAPConfig
from .methods.magnitude import MagnitudeConfig
from .methods.numerical import NumericalConfig
from .methods.registry import available_methods, register_pruning_method
from .methods.ria import RIAConfig
from .methods.sparsegpt import SparseGPTConfig
from .methods.spp import SolutionPath, SolutionPathError, SPPConfig, SPPRIAConfig, SPPSearchError
from .methods.wanda import WandaConfig
from .modeling.architectures import UnsupportedArchitectureError, supported_model_types
from .modeling.auto_classes import register_pruned_architectures
from .modeling.semi_structured import to_semi_structured_
from .prune import prune_
from .report import PruningReport
from .runtime.memory import InsufficientMemoryError
from .runtime.stats_cache import CalibrationStatsCache
from .serialization import load_pruned_model, save_pruned_model
from .version import __version__

register_pruned_architectures()

__all__ = [
    "AMPConfig",
    "AutoPruner",
    "AutoPrunedModelForCausalLM",
    "AutoPrunedModelForImageClassification",
    "CalibrationConfig",
    "CalibrationStatsCache",
    "ExpertConfig",
    "FISTAConfig",
    "FLAPConfig",
    "FinetuneConfig",
    "FinetuneReport",
    "GGUFExportError",
    "GGUFTokenizerError",
    "InsufficientMemoryError",
    "MagnitudeConfig",
    "NumericalConfig",
    "PruningCallback",
    "PruningConfig",
    "PruningReport",
    "RIAConfig",
    "SPPConfig",
    "SPPRIAConfig",
    "SPPSearchError",
    "SolutionPath",
    "SolutionPathError",
    "SparseGPTConfig",
    "SparsityCallback",
    "StructuredPruningConfig",
    "UnstructuredPruningConfig",
    "UnsupportedArchitectureError",
    "WandaConfig",
    "__version__",
    "available_methods",
    "export_gguf",
    "finetune_",
    "load_pruned_model",
    "prune_",
    "register_pruning_method",
    "save_pruned_model",
    "supported_model_types",
    "to_semi_structured_",
]
