# Copyright the optimum-prune authors. Licensed under the Apache License, Version 2.0.
"""Configuration of DeciLM-format checkpoints (`model_type: "nemotron-nas"`, `DeciLMForCausalLM`), written by
optimum-prune for models whose decoder layers differ in shape.

The checkpoint is a Llama decoder whose layer `i` is described by `block_configs[i]`:

- `attention`: `no_op` (the layer has no attention sublayer: neither its norm nor its projections) or
  `n_heads_in_group`, the query heads per KV head (`num_attention_heads // n_heads_in_group` KV heads; every
  attention sublayer has all `num_attention_heads` query heads of `hidden_size // num_attention_heads` dimensions);
- `ffn`: `no_op` (no MLP sublayer) or `ffn_mult`, the SwiGLU width `int(2 * ffn_mult * hidden_size / 3)` rounded up
  to a multiple of 256.

This file is self-contained (it imports only `transformers`) so that engines that resolve the configuration through
`transformers.AutoConfig` with remote code enabled (vLLM, SGLang, TensorRT-LLM) read it; it is copied next to
`config.json` and named in its `auto_map`. `block_configs` entries become objects with attribute access
(`config.block_configs[i].attention.no_op`) and are written back as plain dicts.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from transformers import PretrainedConfig

__all__ = ["BlockConfig", "DeciLMConfig", "ffn_width"]


QKV_PATHS = ("self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj")
ATTENTION_BIAS_PATHS = ("self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj")


def ffn_width(ffn_mult: float, hidden_size: int) -> int:
    """The MLP width a DeciLM reader builds for `ffn_mult`: `int(2·mult·hidden/3)` rounded up to a multiple of 256."""
    width = int(2 * ffn_mult * hidden_size / 3)
    return width if width % 256 == 0 else width + 256 - width % 256


class BlockConfig:
    """One decoder layer: `attention` and `ffn` sections (attribute access to the JSON keys)."""

    def __init__(self, attention: dict[str, Any] | None = None, ffn: dict[str, Any] | None = None, **extra: Any):
        self.attention = SimpleNamespace(**dict(attention or {}))
        self.ffn = SimpleNamespace(**dict(ffn or {}))
        self.extra = dict(extra)

    def to_dict(self) -> dict[str, Any]:
        return {"attention": dict(vars(self.attention)), "ffn": dict(vars(self.ffn)), **self.extra}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlockConfig) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"BlockConfig({self.to_dict()})"


class DeciLMConfig(PretrainedConfig):
    """A Llama decoder with one `block_configs` entry per layer (see the module docstring)."""

    model_type = "nemotron-nas"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        block_configs: list[dict[str, Any] | BlockConfig] | None = None,
        vocab_size: int = 32000,
        hidden_size: int = 4096,
        num_hidden_layers: int = 32,
        num_attention_heads: int = 32,
        hidden_act: str = "silu",
        max_position_embeddings: int = 2048,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        rope_scaling: dict[str, Any] | None = None,
        attention_bias: bool = False,
        mlp_bias: bool = False,
        tie_word_embeddings: bool = False,
        **kwargs: Any,
    ):
        blocks = block_configs or []
        self.block_configs = [b if isinstance(b, BlockConfig) else BlockConfig(**b) for b in blocks]
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        if rope_scaling is not None:
            self.rope_scaling = rope_scaling
        self.attention_bias = attention_bias
        self.mlp_bias = mlp_bias
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    def layer_shapes(self) -> list[dict[str, Any]]:
        """Per layer: `num_attention_heads`, `num_key_value_heads`, `head_dim`, `intermediate_size` (0 for a `no_op`
        sublayer) and `biases` (the four attention projections with `attention_bias`, as every reader builds them)."""
        heads, hidden = self.num_attention_heads, self.hidden_size
        rows = []
        for i, block in enumerate(self.block_configs):
            attn, ffn = block.attention, block.ffn
            for section, name in ((attn, "attention"), (ffn, "ffn")):
                if getattr(section, "replace_with_linear", False) or getattr(section, "sparsify", None):
                    raise ValueError(
                        f"Layer {i}'s {name} is a DeciLM variant this reader does not build: {vars(section)}"
                    )
            attn_noop, ffn_noop = bool(getattr(attn, "no_op", False)), bool(getattr(ffn, "no_op", False))
            width = 0 if ffn_noop else getattr(ffn, "intermediate_size", None) or ffn_width(ffn.ffn_mult, hidden)
            rows.append(
                {
                    "num_attention_heads": 0 if attn_noop else heads,
                    "num_key_value_heads": 0 if attn_noop else heads // attn.n_heads_in_group,
                    "head_dim": hidden // heads,
                    "intermediate_size": int(width),
                    "biases": [] if attn_noop or not self.attention_bias else list(ATTENTION_BIAS_PATHS),
                }
            )
        return rows

    @property
    def torch_dtype(self) -> Any:
        """The dtype under the key older readers use: the JSON keeps both keys, and reading this one (transformers
        does, for every key of the JSON) is not a use of the deprecated attribute."""
        return getattr(self, "dtype", None)

    @torch_dtype.setter
    def torch_dtype(self, value: Any) -> None:
        self.dtype = value

    def to_dict(self) -> dict[str, Any]:
        """The JSON form, with the rotary settings both as `rope_theta` + `rope_scaling` (`None` for plain RoPE) and
        as `rope_parameters`, and the dtype as `torch_dtype` and `dtype`: the keys of every reader, whichever
        transformers version serialises it."""
        output = super().to_dict()
        output["block_configs"] = [b.to_dict() for b in self.block_configs]
        params = dict(output.get("rope_parameters") or output.get("rope_scaling") or {})
        output["rope_theta"] = params.pop("rope_theta", output.get("rope_theta", self.rope_theta))
        kind = params.get("rope_type", params.get("type", "default"))
        output["rope_scaling"] = params if kind != "default" else None
        output["rope_parameters"] = {"rope_type": kind, **params, "rope_theta": output["rope_theta"]}
        dtype = output.get("torch_dtype") or output.get("dtype")
        if dtype is not None:
            output["torch_dtype"] = output["dtype"] = str(dtype).removeprefix("torch.")
        return output
