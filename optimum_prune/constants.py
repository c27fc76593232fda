"""File names and format versions shared by the serialization code."""

__all__ = [
    "PRUNING_CONFIG_NAME",
    "FORMAT_VERSION",
    "PRUNED_MODEL_TYPE_PREFIX",
    "DECI_BASE_KEY",
    "FINETUNE_ATTR",
    "HISTORY_ATTR",
]

PRUNING_CONFIG_NAME = "pruning_config.json"
FORMAT_VERSION = 1
# A checkpoint whose layers have different shapes is saved with `model_type = "optimum_pruned_<base>"`.
PRUNED_MODEL_TYPE_PREFIX = "optimum_pruned_"
# config.json key of a DeciLM-format checkpoint (`model_type = "nemotron-nas"`): the model type of the base decoder.
DECI_BASE_KEY = "optimum_prune_base_model_type"
# Model attribute holding the fine-tuning reports (`pruning_config.json` key "finetune").
FINETUNE_ATTR = "_optimum_prune_finetune"
# Model attribute holding the pruning history (`pruning_config.json` key "history").
HISTORY_ATTR = "_optimum_prune_history"
