"""optimum_prune: prune Hugging Face transformers into smaller, faster checkpoints.

The public names load on first use (PEP 562), so that `import optimum_prune` and the command line's parser
(`optimum-prune --help`) import neither torch nor transformers. The pruned model types (`optimum_pruned_<base>`, the
DeciLM format) are registered with transformers' Auto classes as soon as transformers is loaded: at once if it already
is, else when it is first imported, or when a name of this package is first used.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from typing import TYPE_CHECKING, Any

from .version import __version__

if TYPE_CHECKING:  # what the names below resolve to (read by type checkers and the API reference)
    from .auto import AutoPrunedModelForCausalLM, AutoPrunedModelForImageClassification, AutoPruner
    from .config import CalibrationConfig, PruningConfig, StructuredPruningConfig, UnstructuredPruningConfig
    from .export import GGUFExportError, GGUFTokenizerError, export_gguf
    from .finetune import FinetuneConfig, FinetuneReport, PruningCallback, SparsityCallback, finetune_
    from .methods.amp import AMPConfig
    from .methods.experts import ExpertConfig
    from .methods.fista import FISTAConfig
    from .methods.flap import FLAPConfig
    from .methods.magnitude import MagnitudeConfig
    from .methods.numerical import NumericalConfig, ServingConfig
    from .methods.registry import available_methods, register_pruning_method
    from .methods.ria import RIAConfig
    from .methods.sparsegpt import SparseGPTConfig
    from .methods.spp import SolutionPath, SolutionPathError, SPPConfig, SPPRIAConfig, SPPSearchError
    from .methods.wanda import WandaConfig
    from .modeling.architectures import UnsupportedArchitectureError, supported_model_types
    from .modeling.auto_classes import register_pruned_architectures  # noqa: F401  (public, not in __all__)
    from .modeling.semi_structured import to_semi_structured_
    from .pipeline.stats_cache import CalibrationStatsCache
    from .prune import prune_
    from .report import PruningReport
    from .serialization import load_pruned_model, save_pruned_model
    from .storage.memory import InsufficientMemoryError

# public name -> the module that defines it
_MODULES = {
    **dict.fromkeys(["AutoPrunedModelForCausalLM", "AutoPrunedModelForImageClassification", "AutoPruner"], ".auto"),
    **dict.fromkeys(
        ["CalibrationConfig", "PruningConfig", "StructuredPruningConfig", "UnstructuredPruningConfig"], ".config"
    ),
    **dict.fromkeys(["GGUFExportError", "GGUFTokenizerError", "export_gguf"], ".export"),
    **dict.fromkeys(
        ["FinetuneConfig", "FinetuneReport", "PruningCallback", "SparsityCallback", "finetune_"], ".finetune"
    ),
    "AMPConfig": ".methods.amp",
    "ExpertConfig": ".methods.experts",
    "FISTAConfig": ".methods.fista",
    "FLAPConfig": ".methods.flap",
    "MagnitudeConfig": ".methods.magnitude",
    "NumericalConfig": ".methods.numerical",
    **dict.fromkeys(["available_methods", "register_pruning_method"], ".methods.registry"),
    "RIAConfig": ".methods.ria",
    "ServingConfig": ".methods.numerical",
    "SparseGPTConfig": ".methods.sparsegpt",
    **dict.fromkeys(
        ["SolutionPath", "SolutionPathError", "SPPConfig", "SPPRIAConfig", "SPPSearchError"], ".methods.spp"
    ),
    "WandaConfig": ".methods.wanda",
    **dict.fromkeys(["UnsupportedArchitectureError", "supported_model_types"], ".modeling.architectures"),
    "register_pruned_architectures": ".modeling.auto_classes",
    "to_semi_structured_": ".modeling.semi_structured",
    "prune_": ".prune",
    "PruningReport": ".report",
    "InsufficientMemoryError": ".storage.memory",
    "CalibrationStatsCache": ".pipeline.stats_cache",
    **dict.fromkeys(["load_pruned_model", "save_pruned_model"], ".serialization"),
}

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
    "ServingConfig",
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


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    _register_pruned_types()
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


_registered = False


def _register_pruned_types() -> None:
    """Register the pruned model types with transformers, once transformers is loaded (it needs torch)."""
    global _registered
    if "transformers" in sys.modules and not _registered:
        _registered = True
        importlib.import_module(".modeling.auto_classes", __name__).register_pruned_architectures()


# The registration imports `modeling.auto_classes` and what it imports: these layers (pyproject.toml's contract) and
# nothing above them. While one of them is still loading, registering would import it half-made.
_BELOW_REGISTRATION = tuple(
    f"{__name__}.{layer}" for layer in ("modeling", "functional", "plan", "utils", "constants", "version")
)


class _RegisterAfterTransformers(importlib.abc.MetaPathFinder):
    """Runs `_register_pruned_types` right after `import transformers` completes, so that stock
    `AutoModelForCausalLM.from_pretrained` reads a pruned checkpoint in a script that imported optimum_prune first. When
    transformers is first imported by a module the registration itself needs, still loading, it registers later (when a
    name of this package is used, or when this package loads a checkpoint), never from inside that module's import."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "transformers":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_register(module: Any) -> None:
            exec_module(module)
            loading = [
                n
                for n, m in list(sys.modules.items())
                if n.startswith(_BELOW_REGISTRATION) and getattr(getattr(m, "__spec__", None), "_initializing", False)
            ]
            if not loading:
                _register_pruned_types()

        spec.loader.exec_module = exec_and_register
        return spec


if "transformers" in sys.modules:
    _register_pruned_types()
else:
    sys.meta_path.insert(0, _RegisterAfterTransformers())
