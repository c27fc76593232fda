"""The DeciLM format (`model_type: "nemotron-nas"`, `DeciLMForCausalLM`): per-layer shapes that serving engines load
with their own model code (vLLM, SGLang, TensorRT-LLM, MLX, llama.cpp's `convert_hf_to_gguf.py`).

What every one of those readers accepts, and so what this module writes (`configuration_decilm.py` describes the
semantics):

- a Llama decoder (llama / mistral / qwen2 bases: SwiGLU `silu` MLP, RMSNorm, rotary attention, no q/k norms);
- per layer, attention with all `num_attention_heads` query heads of `hidden_size / num_attention_heads` dimensions
  and `num_attention_heads / n_heads_in_group` KV heads, or none (`no_op`);
- per layer, an MLP whose width is a multiple of 256 (`ffn_mult`: the readers round `int(2·mult·hidden/3)` up to a
  multiple of 256), or none (`no_op`) where the layer has no attention either (llama.cpp's graph skips the whole layer
  when its MLP is absent);
- no biases, except Qwen2's q/k/v biases: `attention_bias: true` builds biases on all four attention projections in
  vLLM, SGLang and MLX, so a zero `o_proj.bias` is written beside them (TensorRT-LLM builds the projections without
  biases and drops them silently; llama.cpp's converter cannot read Qwen2's vocabulary: a warning says so at save);
- the first layer's attention kept (vLLM and SGLang start the residual stream there).

Only `ffn_mult` is written (MLX rejects unknown keys in a block; only vLLM reads `intermediate_size`).
"""

from __future__ import annotations

import inspect
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..constants import DECI_BASE_KEY
from . import configuration_decilm
from .architectures import ArchitectureSpec, base_model_type, get_spec
from .configuration_decilm import ATTENTION_BIAS_PATHS, QKV_PATHS, DeciLMConfig, ffn_width
from .shapes import layer_table

__all__ = [
    "DECI_MODEL_TYPE",
    "FFN_MULTIPLE",
    "DeciLMConfig",
    "deci_blocks",
    "deci_config",
    "deci_export",
    "deci_problems",
    "ffn_mult",
    "servable_problems",
    "write_config_code",
]

logger = logging.getLogger(__name__)

DECI_MODEL_TYPE = DeciLMConfig.model_type
FFN_MULTIPLE = 256  # the readers round every MLP width up to a multiple of this
BASES = ("llama", "mistral", "qwen2")  # model types whose decoder is the DeciLM block
# the biases a base may have: Qwen2's q/k/v, on every attention sublayer (written with `attention_bias: true`)
QKV_BIASES = {"qwen2": QKV_PATHS}
CODE_FILE = "configuration_decilm.py"
# config keys copied from the base model's config (the rest of config.json is written here)
_COPIED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "hidden_act", "rms_norm_eps",
           "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
           "initializer_range", "attention_dropout")  # fmt: skip


def ffn_mult(width: int, hidden_size: int) -> float:
    """The `ffn_mult` (6 decimals, as MLX rounds it) whose reader width is exactly `width` (a multiple of 256)."""
    mult = round(3 * width / (2 * hidden_size), 6)
    if ffn_width(mult, hidden_size) != width:  # pragma: no cover - the rounding is far inside one 256 step
        raise RuntimeError(f"internal error: ffn_mult {mult} gives {ffn_width(mult, hidden_size)}, not {width}")
    return mult


def deci_problems(model: nn.Module, spec: ArchitectureSpec | None = None) -> list[str]:
    """Why `model` cannot be written in the DeciLM format (empty when it can), one reason per entry."""
    config = model.config
    base = base_model_type(config.model_type)
    if base not in BASES:
        return [
            f"its base is {base!r}: the DeciLM block is Llama's ({', '.join(BASES)} bases; "
            "Qwen 3 and Gemma 3 have q/k norms, Gemma 3 its own norms and activation)"
        ]
    spec = spec or get_spec(model)
    rows = layer_table(model, spec)
    heads, hidden = config.num_attention_heads, config.hidden_size
    allowed = QKV_BIASES.get(base, ())
    problems = []
    if hidden % heads or rows[0]["head_dim"] != hidden // heads:
        problems.append(f"its head_dim {rows[0]['head_dim']} is not hidden_size / num_attention_heads")
    if getattr(config, "hidden_act", None) != "silu":
        problems.append(f"its activation is {getattr(config, 'hidden_act', None)!r}, not the readers' 'silu'")
    if getattr(config, "partial_rotary_factor", 1.0) not in (None, 1.0):
        problems.append("it has partial rotary embeddings")

    def layers(test) -> str:
        found = [i for i, r in enumerate(rows) if test(r)]
        return f"layers {found[:6]}{'...' if len(found) > 6 else ''}" if found else ""

    checks = [
        (lambda r: "qk_head_dim" in r, "have pruned head dimensions (one head width for the whole model)"),
        (
            lambda r: r["num_attention_heads"] not in (0, heads),
            f"keep some of the {heads} query heads (every attention sublayer has all of them)",
        ),
        (
            lambda r: r["num_attention_heads"] and heads % max(r["num_key_value_heads"], 1),
            "have a KV head count that does not divide the query heads",
        ),
        (
            lambda r: (
                tuple(r["biases"]) not in ((allowed, ATTENTION_BIAS_PATHS) if r["num_attention_heads"] else [()])
            ),
            "have biases other than "
            + (f"{base}'s q/k/v ones (and o_proj's)" if allowed else "none")
            + " (the readers build the other projections without them)",
        ),
        (
            lambda r: r["intermediate_size"] % FFN_MULTIPLE,
            f"have an MLP width that is not a multiple of {FFN_MULTIPLE} (the readers round ffn_mult up to one)",
        ),
        (
            lambda r: r["intermediate_size"] == 0 and r["num_attention_heads"] > 0,
            "keep attention but no MLP (llama.cpp skips such a whole layer)",
        ),
    ]
    for test, reason in checks:
        where = layers(test)
        if where:
            problems.append(f"{where} {reason}")
    if rows[0]["num_attention_heads"] == 0:
        problems.append("layer 0 has no attention (vLLM and SGLang start the residual stream in layer 0's attention)")
    return problems


def servable_problems(model: nn.Module, spec: ArchitectureSpec, skip_layers=()) -> list[str]:
    """Why pruning `model` (dense, or pruned so far only by whole sublayers and MLP channels) cannot give a model
    the DeciLM format holds, whatever is removed (empty when it can)."""
    config = model.config
    base = base_model_type(config.model_type)
    if base not in BASES:
        return [f"it is a {base!r} model (the format's block is Llama's: {', '.join(BASES)})"]
    problems = []
    rows = layer_table(model, spec)
    heads, hidden = config.num_attention_heads, config.hidden_size
    if any(r["num_attention_heads"] not in (0, heads) or "qk_head_dim" in r for r in rows) or hidden % heads:
        problems.append("its layers do not all keep every query head of hidden_size / heads dimensions")
    if any(r["intermediate_size"] % FFN_MULTIPLE for i, r in enumerate(rows) if i not in skip_layers):
        problems.append(f"its MLP width is not a multiple of {FFN_MULTIPLE} (the readers' widths are)")
    allowed = set(ATTENTION_BIAS_PATHS if base in QKV_BIASES else ())
    if any(set(r["biases"]) - allowed for r in rows):
        problems.append("its projections have biases the readers do not build (only Qwen2's q/k/v ones)")
    return problems


def deci_blocks(rows: list[dict[str, Any]], num_heads: int, hidden_size: int) -> list[dict[str, Any]]:
    """`block_configs` of per-layer shapes (heads, KV heads, MLP width per layer) that `deci_problems` accepts."""
    blocks = []
    for r in rows:
        attn_noop, ffn_noop = r["num_attention_heads"] == 0, r["intermediate_size"] == 0
        attention = {"no_op": attn_noop, "replace_with_linear": False, "sparsify": None}
        attention["n_heads_in_group"] = None if attn_noop else num_heads // r["num_key_value_heads"]
        ffn = {"no_op": ffn_noop, "replace_with_linear": False, "sparsify": None}
        ffn["ffn_mult"] = None if ffn_noop else ffn_mult(r["intermediate_size"], hidden_size)
        blocks.append({"attention": attention, "ffn": ffn})
    return blocks


def _legacy_rope(config) -> tuple[float, dict[str, Any] | None]:
    """`(rope_theta, rope_scaling)` in the pre-`rope_parameters` form the readers take."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    theta = params.pop("rope_theta", getattr(config, "rope_theta", 10000.0))
    if params.get("rope_type", "default") == "default":
        return float(theta), None
    return float(theta), params


def deci_config(model: nn.Module, spec: ArchitectureSpec | None = None) -> DeciLMConfig:
    """The DeciLM config of `model` (raises `ValueError` listing `deci_problems`)."""
    spec = spec or get_spec(model)
    problems = deci_problems(model, spec)
    if problems:
        raise ValueError(
            "The model cannot be written in the DeciLM format (vLLM, SGLang, TensorRT-LLM, MLX, llama.cpp): "
            + "; ".join(problems)
            + ". Prune with allocation='servable' (attention kept whole or removed per layer, MLP widths in "
            "multiples of 256, no bias), or save with format='auto' (optimum-prune's own per-layer format)."
        )
    config = model.config
    data = {k: getattr(config, k) for k in _COPIED if getattr(config, k, None) is not None}
    theta, scaling = _legacy_rope(config)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    dtype = str(dtype).removeprefix("torch.") if dtype is not None else None
    blocks = deci_blocks(layer_table(model, spec), config.num_attention_heads, config.hidden_size)
    data.update(
        block_configs=blocks,
        rope_theta=theta,
        rope_scaling=scaling,
        head_dim=config.hidden_size // config.num_attention_heads,
        attention_bias=base_model_type(config.model_type) in QKV_BIASES,
        mlp_bias=False,
        intermediate_size=None,
        num_key_value_heads=None,
        use_cache=True,
        torch_dtype=dtype,
        architectures=["DeciLMForCausalLM"],
        auto_map={"AutoConfig": f"{CODE_FILE.removesuffix('.py')}.DeciLMConfig"},
        **{DECI_BASE_KEY: base_model_type(config.model_type)},
    )
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        logger.warning(
            "The DeciLM readers attend to the whole context; this model's sliding window (%d tokens) is not written. "
            "Outputs match for sequences up to the window.",
            config.sliding_window,
        )
    return DeciLMConfig(**data)


def deci_export(model: nn.Module, spec: ArchitectureSpec | None = None) -> tuple[DeciLMConfig, dict[str, Any]]:
    """The DeciLM config of `model` and the zero tensors the readers need beside its weights: with `attention_bias`
    (Qwen2) a zero `o_proj.bias` in every attention sublayer without one (the readers build it from the same flag; a
    reloaded folder has it as a parameter)."""
    spec = spec or get_spec(model)
    config = deci_config(model, spec)
    if not config.attention_bias:
        return config, {}
    logger.warning(
        "A %s model in the DeciLM format carries q/k/v biases (attention_bias=true, zero o_proj biases): vLLM, "
        "SGLang and MLX load it; TensorRT-LLM's DeciLM drops the biases without an error (wrong outputs) and "
        "llama.cpp's converter cannot read a Qwen2 vocabulary as DeciLM.",
        base_model_type(model.config.model_type),
    )
    sd = model.state_dict()
    zeros = {}
    for i, row in enumerate(layer_table(model, spec)):
        key = f"{spec.layers}.{i}.{spec.o_path}.bias"
        if row["num_attention_heads"] and key not in sd:
            weight = sd[key.removesuffix("bias") + "weight"]
            zeros[key] = torch.zeros(weight.shape[0], dtype=weight.dtype)
    return config, zeros


def write_config_code(directory: Path) -> None:
    """Copy the configuration code `config.json`'s `auto_map` names into `directory`."""
    shutil.copyfile(inspect.getsourcefile(configuration_decilm), Path(directory) / CODE_FILE)
