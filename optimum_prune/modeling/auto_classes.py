"""Config / model classes registered with the transformers Auto classes for checkpoints whose layers differ in shape.

Such a checkpoint has `model_type = "optimum_pruned_<base>"` and a `pruned_layers` list in config.json. The model
class is the stock `*ForCausalLM` of the base type, reshaped layer by layer (`surgery.reshape_layer_`) right after
construction, so `from_pretrained` (meta-device skeleton, then weights) loads every tensor exactly. No remote code,
no forked modeling file. Without optimum_prune installed, transformers does not know the model type and fails loudly
instead of silently re-initialising mismatched weights.
"""

from __future__ import annotations

import logging

from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from ..constants import PRUNED_MODEL_TYPE_PREFIX
from .architectures import ARCHITECTURES, get_layers, layer_view

__all__ = ["register_pruned_architectures", "pruned_classes"]

logger = logging.getLogger(__name__)

_CLASSES: dict[str, tuple[type, type]] = {}


def _make_classes(base_type: str) -> tuple[type, type]:
    base_config = CONFIG_MAPPING[base_type]
    base_model = MODEL_FOR_CAUSAL_LM_MAPPING[base_config]
    spec = ARCHITECTURES[base_type]
    pruned_type = PRUNED_MODEL_TYPE_PREFIX + base_type

    config_cls = type(f"Pruned{base_config.__name__}", (base_config,), {"model_type": pruned_type})

    def __init__(self, config, *args, **kwargs):
        base_model.__init__(self, config, *args, **kwargs)
        shapes = getattr(config, "pruned_layers", None)
        if shapes is None:
            raise ValueError(f"A {pruned_type} config needs `pruned_layers` (per-layer shapes).")
        layers = get_layers(self, spec)
        if len(shapes) != len(layers):
            raise ValueError(f"`pruned_layers` has {len(shapes)} entries for {len(layers)} layers.")
        from .surgery import reshape_layer_

        for i, (layer, layer_shapes) in enumerate(zip(layers, shapes)):
            reshape_layer_(layer_view(layer, i, spec, config), layer_shapes)

    model_cls = type(
        f"Pruned{base_model.__name__}",
        (base_model,),
        {"config_class": config_cls, "__init__": __init__, "__module__": __name__},
    )
    return config_cls, model_cls


def pruned_classes(base_type: str) -> tuple[type, type]:
    """`(config_cls, model_cls)` for a base model type, created and registered on first use."""
    if base_type not in _CLASSES:
        config_cls, model_cls = _make_classes(base_type)
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        AutoModelForCausalLM.register(config_cls, model_cls, exist_ok=True)
        _CLASSES[base_type] = (config_cls, model_cls)
    return _CLASSES[base_type]


def register_pruned_architectures() -> None:
    """Register the pruned variant of every supported architecture (done when optimum_prune is imported)."""
    for base_type in ARCHITECTURES:
        try:
            pruned_classes(base_type)
        except KeyError:  # pragma: no cover - a transformers build without that model
            logger.debug("transformers has no %s model; not registering its pruned variant", base_type)
