"""One table that maps each supported `config.model_type` to the roles pruning needs.

Methods speak in roles (`q`, `k`, `v`, `o`, `mlp_in`, `mlp_out`); only this module knows attribute paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from torch import nn

from ..constants import PRUNED_MODEL_TYPE_PREFIX
from .moe import MoESpec
from .targets import ROLES, Target, resolve_targets
from .views import LayerView, layer_view, present_linear_paths, weight_oi

__all__ = [
    "ArchitectureSpec",
    "LayerView",
    "MoESpec",
    "ROLES",
    "Target",
    "resolve_targets",
    "UnsupportedArchitectureError",
    "ARCHITECTURES",
    "get_spec",
    "get_layers",
    "is_image_model",
    "require_causal_lm",
    "layer_view",
    "present_linear_paths",
    "spec_for_config",
    "supported_model_types",
    "weight_oi",
]


class UnsupportedArchitectureError(ValueError):
    """Raised, before any weight changes, for a model whose `model_type` is not in the table."""


@dataclass(frozen=True)
class ArchitectureSpec:
    """Where the prunable modules of one architecture live.

    Args:
        layers (`str`): dotted path of the decoder-layer `ModuleList`, from the `*ForCausalLM` model (image models:
            from the `*ForImageClassification` model; their backbone, e.g. `Dinov2Model`, drops the prefix).
        attn (`str`): attribute of a decoder layer holding the self-attention module.
        q, k, v, o (`str`): attributes of the attention module (`q`/`k`/`v` are `None` when `fused_qkv` is set).
        fused_qkv (`str | None`): attribute of a fused q|k|v projection (GPT-2 `c_attn`).
        mlp (`str`): attribute of the layer holding the MLP (`""`: the layer itself, as in OPT).
        mlp_in (`tuple[str, ...]`): projections whose *output* channels are the MLP channels (gate/up, fc1).
        mlp_out (`str | None`): projection whose *input* channels are the MLP channels (down, fc2); `None` for
            mixture-of-experts models, whose MLP is the experts (`moe`).
        heads_attr (`str | None`): attention attribute holding the number of query heads, if the module keeps one.
        split_attr (`str | None`): attention attribute holding the q/k/v split width (GPT-2 `split_size`).
        config_keys (`dict`): config attribute names for heads, kv heads, head_dim and intermediate size.
        mlp_in_roles (`tuple[str, ...]`): architecture-independent role of each `mlp_in` projection (`"gate_proj"`,
            `"up_proj"`; OPT's `fc1` and GPT-2's `c_fc` are `"up_proj"`).
        modality (`str`, defaults to `"text"`): `"text"` (causal LMs, calibrated on token ids) or `"image"`
            (encoder-only vision transformers: non-causal attention, calibrated on pixel values).
        pair_attention (`str | None`): which forward of `modeling.pair_attention` runs the attention once its q/k and
            v/o head dimensions differ (SPP): `"rope"` (Llama-style, rotary `rotate_half` pairs (j, j + d/2)),
            `"opt"`, `"gpt2"`, `"vit"` (encoder-only, non-causal); `None`: head dimensions cannot be pruned here.
        moe (`MoESpec | None`): the router / experts / shared-expert roles of a sparse mixture-of-experts block at
            `mlp` (`config_keys` then also names `"experts"`, the config key of the expert count, and
            `"intermediate"` is the experts' width).
        heads_prunable (`bool`, defaults to `True`): whether whole heads / KV groups can be removed exactly (not
            where a q/k norm spans every head, or heads carry extra per-head parameters such as attention sinks).
        output_bias (`bool`, defaults to `True`): whether `o` and `mlp_out` may carry a bias wherever a model of this
            architecture goes; `False` where its GGUF graph in llama.cpp has no such bias (Qwen3, Gemma-3), so a
            compensation that adds one (FLAP's, NP's intercept) is off by default there.
    """

    layers: str
    attn: str
    o: str
    mlp: str
    mlp_in: tuple[str, ...]
    mlp_out: str | None
    q: str | None = "q_proj"
    k: str | None = "k_proj"
    v: str | None = "v_proj"
    fused_qkv: str | None = None
    heads_attr: str | None = None
    split_attr: str | None = None
    config_keys: dict[str, str] = field(
        default_factory=lambda: {
            "heads": "num_attention_heads",
            "kv_heads": "num_key_value_heads",
            "head_dim": "head_dim",
            "intermediate": "intermediate_size",
        }
    )

    mlp_in_roles: tuple[str, ...] = ("gate_proj", "up_proj")
    modality: str = "text"
    pair_attention: str | None = None
    moe: MoESpec | None = None
    heads_prunable: bool = True
    output_bias: bool = True

    @property
    def rotary(self) -> bool:
        """Whether q and k carry rotary embeddings in the `rotate_half` layout (dims j and j + d/2 rotate together)."""
        return self.pair_attention == "rope"

    def attn_path(self, name: str) -> str:
        return f"{self.attn}.{name}"

    def mlp_path(self, name: str) -> str:
        return f"{self.mlp}.{name}" if self.mlp else name

    @property
    def qkv_paths(self) -> tuple[str, ...]:
        if self.fused_qkv:
            return (self.attn_path(self.fused_qkv),)
        return tuple(self.attn_path(n) for n in (self.q, self.k, self.v))

    @property
    def o_path(self) -> str:
        return self.attn_path(self.o)

    @property
    def mlp_in_paths(self) -> tuple[str, ...]:
        return tuple(self.mlp_path(n) for n in self.mlp_in)

    @property
    def mlp_out_path(self) -> str | None:
        return self.mlp_path(self.mlp_out) if self.mlp_out else None

    @property
    def linear_paths(self) -> tuple[str, ...]:
        """Every prunable projection of a layer, in forward order (the attention only on MoE models: their MLP is
        the experts, see `moe`)."""
        out = (*self.qkv_paths, self.o_path, *self.mlp_in_paths)
        return (*out, self.mlp_out_path) if self.mlp_out else out

    def moe_path(self, name: str) -> str:
        """Path of a part of the MoE block (`moe.router`, `moe.experts`), relative to the decoder layer."""
        return self.mlp_path(name)

    def role_targets(self) -> dict[str, Target]:
        """Every role this architecture has, mapped to its module (and row slice of a fused q|k|v projection)."""
        out: dict[str, Target] = {}
        for j, role in enumerate(("q_proj", "k_proj", "v_proj")):
            if self.fused_qkv:
                out[role] = Target(role, self.attn_path(self.fused_qkv), part=j, parts=3)
            else:
                out[role] = Target(role, self.attn_path((self.q, self.k, self.v)[j]))
        out["o_proj"] = Target("o_proj", self.o_path)
        for role, path in zip(self.mlp_in_roles, self.mlp_in_paths):
            out[role] = Target(role, path)
        if self.mlp_out:
            out["down_proj"] = Target("down_proj", self.mlp_out_path)
        return {r: out[r] for r in ROLES if r in out}


_LLAMA_LIKE = ArchitectureSpec(
    layers="model.layers",
    attn="self_attn",
    o="o_proj",
    mlp="mlp",
    mlp_in=("gate_proj", "up_proj"),
    mlp_out="down_proj",
    pair_attention="rope",
)

_NO_OUTPUT_BIAS = replace(_LLAMA_LIKE, output_bias=False)  # llama.cpp's qwen3 / gemma3 graphs read no o / down bias

ARCHITECTURES: dict[str, ArchitectureSpec] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _NO_OUTPUT_BIAS,
    "gemma3_text": _NO_OUTPUT_BIAS,
    "opt": ArchitectureSpec(
        layers="model.decoder.layers",
        attn="self_attn",
        o="out_proj",
        mlp="",
        mlp_in=("fc1",),
        mlp_out="fc2",
        mlp_in_roles=("up_proj",),
        heads_attr="num_heads",
        config_keys={"heads": "num_attention_heads", "intermediate": "ffn_dim"},
        pair_attention="opt",
    ),
    "gpt2": ArchitectureSpec(
        layers="transformer.h",
        attn="attn",
        o="c_proj",
        mlp="mlp",
        mlp_in=("c_fc",),
        mlp_out="c_proj",
        q=None,
        k=None,
        v=None,
        fused_qkv="c_attn",
        mlp_in_roles=("up_proj",),
        heads_attr="num_heads",
        split_attr="split_size",
        config_keys={"heads": "n_head", "intermediate": "n_inner"},
        pair_attention="gpt2",
    ),
}


# Sparse mixture-of-experts decoders (transformers >= 5 layout, see `modeling.moe`): the attention as in the dense
# entries, the MLP of a layer is a router plus fused experts. OLMoE's q/k norms span all heads and gpt-oss has
# per-head attention sinks, so their heads are not removable (`heads_prunable=False`).
def _moe_keys(intermediate: str, experts: str, head_dim: bool = True) -> dict[str, str]:
    keys = {"heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "intermediate": intermediate}
    return {**keys, "experts": experts, **({"head_dim": "head_dim"} if head_dim else {})}


def _moe(
    keys: dict[str, str], moe: MoESpec, heads_prunable: bool = True, output_bias: bool = True
) -> ArchitectureSpec:
    return ArchitectureSpec(
        layers="model.layers",
        attn="self_attn",
        o="o_proj",
        mlp="mlp",
        mlp_in=(),
        mlp_out=None,
        config_keys=keys,
        moe=moe,
        heads_prunable=heads_prunable,
        output_bias=output_bias,
    )


ARCHITECTURES.update(
    {
        "qwen3_moe": _moe(  # llama.cpp's qwen3moe and olmoe graphs read no o bias
            _moe_keys("moe_intermediate_size", "num_local_experts"), MoESpec(dense_out="down_proj"), output_bias=False
        ),
        "mixtral": _moe(
            _moe_keys("intermediate_size", "num_local_experts"),
            MoESpec(norm_key=None, always_norm=True, legacy_block="block_sparse_moe", legacy_names=("w1", "w3", "w2")),
        ),
        "olmoe": _moe(
            _moe_keys("intermediate_size", "num_experts", head_dim=False),
            MoESpec(),
            heads_prunable=False,
            output_bias=False,
        ),  # fmt: skip
        "gpt_oss": _moe(
            _moe_keys("intermediate_size", "num_local_experts"),
            MoESpec(
                router="router",
                transposed=True,
                interleaved=True,
                expert_bias=True,
                routing="topk_softmax",
                norm_key=None,
                legacy_block=None,  # stored fused
            ),  # fmt: skip
            heads_prunable=False,
        ),
    }
)

# Encoder-only vision transformers (transformers >= 5 names: q/k/v/o_proj, `mlp.fc1` / `mlp.fc2`). No KV heads
# (MHA); Dinov2's layer scales act on the hidden size, which pruning never changes. Dinov2 has no
# `intermediate_size`: its MLP width is `hidden_size * mlp_ratio` (an int), so most pruned widths need the pruned
# model type even when every layer has the same shape.
_VIT_KEYS = {"heads": "num_attention_heads", "head_dim": "head_dim", "intermediate": "intermediate_size"}
_DINOV2_KEYS = {"heads": "num_attention_heads", "head_dim": "head_dim", "intermediate": "mlp_ratio"}


def _vit_like(layers: str, keys: dict[str, str], swiglu: bool = False) -> ArchitectureSpec:
    return ArchitectureSpec(
        layers=layers,
        attn="attention",
        o="o_proj",
        mlp="mlp",
        mlp_in=("gate_proj", "up_proj") if swiglu else ("fc1",),
        mlp_out="down_proj" if swiglu else "fc2",
        mlp_in_roles=("gate_proj", "up_proj") if swiglu else ("up_proj",),
        heads_attr="num_attention_heads",
        config_keys=keys,
        modality="image",
        pair_attention="vit",
    )


ARCHITECTURES.update(
    {
        "vit": _vit_like("vit.layers", _VIT_KEYS),
        "deit": _vit_like("deit.layers", _VIT_KEYS),
        "dinov2": _vit_like("dinov2.encoder.layer", _DINOV2_KEYS),
    }
)
# Config flags that switch an architecture to another layout: Dinov2 with `use_swiglu_ffn` has a SwiGLU MLP
# (`gate_proj` / `up_proj` / `down_proj`, pruned together like Llama's).
_VARIANTS: dict[str, tuple[str, ArchitectureSpec]] = {
    "dinov2": ("use_swiglu_ffn", _vit_like("dinov2.encoder.layer", _DINOV2_KEYS, swiglu=True)),
}


def supported_model_types() -> list[str]:
    return sorted(ARCHITECTURES)


def base_model_type(model_type: str) -> str:
    """The model type a pruned checkpoint's `optimum_pruned_<base>` type was made from (others as they are)."""
    return model_type.removeprefix(PRUNED_MODEL_TYPE_PREFIX)


def spec_for_config(config) -> ArchitectureSpec | None:
    """The table entry for a config (`None` when unsupported), with the layout variant its flags select."""
    base = base_model_type(getattr(config, "model_type", None) or "")
    spec = ARCHITECTURES.get(base)
    variant = _VARIANTS.get(base)
    if spec is not None and variant is not None and getattr(config, variant[0], False):
        spec = variant[1]
    return spec


def is_image_model(model: nn.Module) -> bool:
    """Whether `model` is a supported image model (its calibration and fine-tuning data are pixel values)."""
    spec = spec_for_config(getattr(model, "config", None))
    return spec is not None and spec.modality == "image"


def require_causal_lm(model: nn.Module, what: str) -> None:
    """Refuse an image model where only causal LMs make sense (perplexity, generation, GGUF export, LM tasks)."""
    if is_image_model(model):
        raise ValueError(
            f"{what} is for causal language models; {type(model).__name__} is an image model. Measure it on labelled "
            "images instead (e.g. the accuracy `finetune_` reports before and after training)."
        )


def get_spec(model: nn.Module) -> ArchitectureSpec:
    """The `ArchitectureSpec` of `model`; raises `UnsupportedArchitectureError` listing the supported types."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise UnsupportedArchitectureError(
            f"{type(model).__name__} has no `config.model_type`; optimum_prune needs a transformers "
            f"`*ForCausalLM` model. Supported model types: {', '.join(supported_model_types())}."
        )
    spec = spec_for_config(config)
    if spec is None:
        raise UnsupportedArchitectureError(
            f"Model type {model_type!r} is not supported yet. Supported model types: "
            f"{', '.join(supported_model_types())}. Nothing was changed."
        )
    try:
        model.get_submodule(_layers_path(model, spec))
    except AttributeError as e:
        wanted = (
            "`*ForImageClassification` model or its backbone" if spec.modality == "image" else "`*ForCausalLM` model"
        )
        raise UnsupportedArchitectureError(
            f"{type(model).__name__} ({model_type}) has no `{spec.layers}`; pass the {wanted}."
        ) from e
    return spec


def _layers_path(model: nn.Module, spec: ArchitectureSpec) -> str:
    """`spec.layers` relative to `model`: an image backbone (`ViTModel`, `Dinov2Model`: its own base model) drops
    the head model's `base_model_prefix`."""
    prefix = getattr(model, "base_model_prefix", "")
    if spec.modality == "image" and prefix and spec.layers.startswith(prefix + "."):
        if getattr(model, "base_model", None) is model:
            return spec.layers[len(prefix) + 1 :]
    return spec.layers


def get_layers(model: nn.Module, spec: ArchitectureSpec) -> nn.ModuleList:
    return model.get_submodule(_layers_path(model, spec))
