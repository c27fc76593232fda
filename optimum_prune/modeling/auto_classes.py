"""Config / model classes registered with the transformers Auto classes for checkpoints whose layers differ in shape.

Such a checkpoint has `model_type = "optimum_pruned_<base>"` and a `pruned_layers` list in config.json. The model
class is the stock model class of the base type for the checkpoint's task (`*ForCausalLM`; for image models
`*ForImageClassification` or the backbone, e.g. `Dinov2Model`), reshaped layer by layer (`surgery.reshape_layer_`)
right after construction, so `from_pretrained` (meta-device skeleton, then weights) loads every tensor exactly. No
remote code, no forked modeling file. Without optimum_prune installed, transformers does not know the model type
and fails loudly instead of silently re-initialising mismatched weights.
"""

from __future__ import annotations

import logging

from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    conversion_mapping,
)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING,
    MODEL_MAPPING,
)

from ..constants import DECI_BASE_KEY, PRUNED_MODEL_TYPE_PREFIX
from .architectures import ARCHITECTURES, base_model_type, get_layers, layer_view, spec_for_config
from .configuration_decilm import DeciLMConfig
from .surgery import reshape_layer_

__all__ = [
    "register_pruned_architectures",
    "pruned_classes",
    "pruned_config_from_deci",
    "TASKS",
    "model_task",
    "auto_class_for_config",
]

logger = logging.getLogger(__name__)

# task -> (transformers Auto class, its model mapping); the tasks of each modality, most specific first.
TASKS = {
    "causal-lm": (AutoModelForCausalLM, MODEL_FOR_CAUSAL_LM_MAPPING),
    "image-classification": (AutoModelForImageClassification, MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING),
    "feature-extraction": (AutoModel, MODEL_MAPPING),
}
MODALITY_TASKS = {"text": ("causal-lm",), "image": ("image-classification", "feature-extraction")}

_CONFIGS: dict[str, type] = {}
_CLASSES: dict[tuple[str, str], tuple[type, type]] = {}


def _stock_classes(base_type: str, task: str) -> tuple[type, ...]:
    """The stock model class(es) of `base_type` for `task` (a mapping entry may hold several, e.g. DeiT)."""
    found = TASKS[task][1][CONFIG_MAPPING[base_type]]
    return tuple(found) if isinstance(found, (tuple, list)) else (found,)


def model_task(model: nn.Module) -> str:
    """The task of a supported model, by its class (`"causal-lm"`, `"image-classification"`, `"feature-extraction"`).

    Raises a `ValueError` naming the expected classes when the class is none of its modality's tasks.
    """
    base_type = base_model_type(model.config.model_type)
    tasks = MODALITY_TASKS[spec_for_config(model.config).modality]
    expected = []
    for task in tasks:
        try:
            stock = _stock_classes(base_type, task)[0]  # the class its pruned variant derives from
        except KeyError:
            continue
        if isinstance(model, stock):
            return task
        expected.append(stock.__name__)
    raise ValueError(
        f"{type(model).__name__} cannot be saved with per-layer shapes: optimum_prune registers pruned variants of "
        f"{', '.join(expected)} only. Prune with allocation='uniform' (a stock checkpoint), or prune one of those."
    )


def _config_class(base_type: str) -> type:
    if base_type not in _CONFIGS:
        base_config = CONFIG_MAPPING[base_type]
        config_cls = type(
            f"Pruned{base_config.__name__}", (base_config,), {"model_type": PRUNED_MODEL_TYPE_PREFIX + base_type}
        )
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        _CONFIGS[base_type] = config_cls
    return _CONFIGS[base_type]


def _make_model_class(base_type: str, task: str, config_cls: type) -> type:
    base_model = _stock_classes(base_type, task)[0]
    pruned_type = config_cls.model_type

    def __init__(self, config, *args, **kwargs):
        base_model.__init__(self, config, *args, **kwargs)
        shapes = getattr(config, "pruned_layers", None)
        if shapes is None:
            raise ValueError(f"A {pruned_type} config needs `pruned_layers` (per-layer shapes).")
        spec = spec_for_config(config)
        layers = get_layers(self, spec)
        if len(shapes) != len(layers):
            raise ValueError(f"`pruned_layers` has {len(shapes)} entries for {len(layers)} layers.")

        for i, (layer, layer_shapes) in enumerate(zip(layers, shapes)):
            reshape_layer_(layer_view(layer, i, spec, config), layer_shapes)

    return type(
        f"Pruned{base_model.__name__}",
        (base_model,),
        {"config_class": config_cls, "__init__": __init__, "__module__": __name__},
    )


def _share_weight_conversions(base_name: str, pruned_name: str) -> None:
    """transformers renames legacy checkpoint keys (e.g. ViT's `attention.attention.query`) by class name or model
    type, on load and, reversed, on save: the pruned class / type gets the same renamings as its base, so that a
    checkpoint saved from a stock model loads into the pruned class."""

    found = conversion_mapping.get_checkpoint_conversion_mapping(base_name)
    if found is not None and conversion_mapping.get_checkpoint_conversion_mapping(pruned_name) is None:
        conversion_mapping.register_checkpoint_conversion_mapping(pruned_name, found)


def pruned_classes(base_type: str, task: str = "causal-lm") -> tuple[type, type]:
    """`(config_cls, model_cls)` for a base model type and task, created and registered on first use."""
    if (base_type, task) not in _CLASSES:
        config_cls = _config_class(base_type)
        model_cls = _make_model_class(base_type, task, config_cls)
        TASKS[task][0].register(config_cls, model_cls, exist_ok=True)
        _share_weight_conversions(model_cls.__bases__[0].__name__, model_cls.__name__)
        _share_weight_conversions(base_type, config_cls.model_type)
        _CLASSES[base_type, task] = (config_cls, model_cls)
    return _CLASSES[base_type, task]


def auto_class_for_config(config) -> tuple[str, type]:
    """`(task, transformers Auto class)` that loads a checkpoint of `config` as the class it was saved from.

    The task comes from `config.architectures` (e.g. `PrunedDinov2Model` is the backbone); a text model is always a
    causal LM; an image config without `architectures` loads as an image classifier.
    """
    spec = spec_for_config(config)
    modality = spec.modality if spec is not None else "text"
    tasks = MODALITY_TASKS[modality]
    base_type = base_model_type(config.model_type)
    names = {a.removeprefix("Pruned") for a in (getattr(config, "architectures", None) or [])}
    for task in tasks:
        try:
            if names & {c.__name__ for c in _stock_classes(base_type, task)}:
                return task, TASKS[task][0]
        except KeyError:
            continue
    return tasks[0], TASKS[tasks[0]][0]


def pruned_config_from_deci(config: DeciLMConfig):
    """The `optimum_pruned_<base>` config of a DeciLM-format checkpoint: its base decoder and each layer's shapes."""
    base = getattr(config, DECI_BASE_KEY, None) or "llama"
    rows = config.layer_shapes()
    drop = ("block_configs", "auto_map", "architectures", "rope_scaling", DECI_BASE_KEY)
    data = {k: v for k, v in config.to_dict().items() if k not in drop}
    data.update(
        num_key_value_heads=max(max(r["num_key_value_heads"] for r in rows), 1),
        intermediate_size=max(max(r["intermediate_size"] for r in rows), 1),
        head_dim=config.hidden_size // config.num_attention_heads,
    )
    config_cls, model_cls = pruned_classes(base, "causal-lm")
    out = config_cls.from_dict({**data, "model_type": config_cls.model_type, "pruned_layers": rows})
    out.architectures = [model_cls.__name__]
    return out


class DeciLMForCausalLM:
    """`AutoModelForCausalLM`'s class for `nemotron-nas` checkpoints (once optimum_prune is imported): `from_pretrained`
    loads them into optimum-prune's per-layer model of the base decoder (`pruned_config_from_deci`), exactly."""

    config_class = DeciLMConfig

    @classmethod
    def from_pretrained(cls, path, *args, config: DeciLMConfig | None = None, **kwargs):
        config = config if config is not None else DeciLMConfig.from_pretrained(path)
        pruned = pruned_config_from_deci(config)
        requested = getattr(config, "_attn_implementation_internal", None)  # set by the Auto class's kwargs
        if requested is not None:
            kwargs.setdefault("attn_implementation", requested)
        model_cls = pruned_classes(getattr(config, DECI_BASE_KEY, None) or "llama", "causal-lm")[1]
        return model_cls.from_pretrained(path, *args, config=pruned, **kwargs)


def register_pruned_architectures() -> None:
    """Register the pruned variant of every supported architecture, and the DeciLM format (`nemotron-nas`), with the
    transformers Auto classes (done when optimum_prune is imported)."""
    AutoConfig.register(DeciLMConfig.model_type, DeciLMConfig, exist_ok=True)
    AutoModelForCausalLM.register(DeciLMConfig, DeciLMForCausalLM, exist_ok=True)
    for base_type, spec in ARCHITECTURES.items():
        for task in MODALITY_TASKS[spec.modality]:
            try:
                pruned_classes(base_type, task)
            except KeyError:  # pragma: no cover - a transformers build without that model
                logger.debug("transformers has no %s %s model; not registering its pruned variant", base_type, task)
