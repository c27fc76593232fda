"""`LayerView`: the modules and current (possibly pruned) geometry of one decoder layer, read from its weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

if TYPE_CHECKING:
    from .architectures import ArchitectureSpec

__all__ = ["LayerView", "layer_view", "present_linear_paths", "weight_oi"]


def weight_oi(module: nn.Module) -> torch.Tensor:
    """The weight in (out_features, in_features) layout, for `nn.Linear` and GPT-2 `Conv1D` alike (a view)."""
    return module.weight.T if isinstance(module, Conv1D) else module.weight


@dataclass
class LayerView:
    """Modules and head geometry of one decoder layer.

    `head_dim` is the attention's original head dimension (its softmax scale); `qk_head_dim` / `vo_head_dim` are the
    per-head widths of q/k and of v/o, smaller than `head_dim` once SPP pruned them (see `modeling.pair_attention`).
    """

    index: int
    layer: nn.Module
    spec: ArchitectureSpec
    head_dim: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    qk_head_dim: int | None = None
    vo_head_dim: int | None = None
    num_experts: int | None = None

    def __post_init__(self) -> None:
        self.qk_head_dim = self.qk_head_dim or self.head_dim
        self.vo_head_dim = self.vo_head_dim or self.head_dim

    @property
    def pair_shaped(self) -> bool:
        """Whether this layer's q/k or v/o head dimensions were pruned (SPP)."""
        return hasattr(self.attn, "qk_head_dim")

    @property
    def attn(self) -> nn.Module:
        return self.layer.get_submodule(self.spec.attn)

    def module(self, path: str) -> nn.Module:
        return self.layer.get_submodule(path)

    @property
    def o_proj(self) -> nn.Module:
        return self.module(self.spec.o_path)

    @property
    def mlp_out(self) -> nn.Module:
        if self.spec.mlp_out_path is None:
            raise ValueError(f"Layer {self.index} is a mixture-of-experts layer: its MLP is its experts.")
        return self.module(self.spec.mlp_out_path)

    @property
    def is_moe(self) -> bool:
        """Whether this layer's MLP is a sparse mixture of experts (`num_experts` experts of `intermediate_size`)."""
        return self.num_experts is not None

    @property
    def router(self) -> nn.Module:
        return self.module(self.spec.moe_path(self.spec.moe.router))

    @property
    def experts(self) -> nn.Module:
        return self.module(self.spec.moe_path(self.spec.moe.experts))

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads if self.num_kv_heads else 0

    def linears(self) -> dict[str, nn.Module]:
        return {p: self.module(p) for p in present_linear_paths(self.layer, self.spec)}


def _removed(module: nn.Module) -> bool:
    """Whether `module` stands for a removed sublayer (`modeling.sublayers`)."""
    return bool(getattr(module, "removed_sublayer", False))


def present_linear_paths(layer: nn.Module, spec: ArchitectureSpec) -> tuple[str, ...]:
    """`spec.linear_paths` of `layer`, without those of a removed attention or MLP sublayer (`modeling.sublayers`)."""
    gone = set()
    if _removed(layer.get_submodule(spec.attn)):
        gone |= {*spec.qkv_paths, spec.o_path}
    if spec.mlp and _removed(layer.get_submodule(spec.mlp)):
        gone |= {*spec.mlp_in_paths, spec.mlp_out_path}
    return tuple(p for p in spec.linear_paths if p not in gone)


def layer_view(layer: nn.Module, index: int, spec: ArchitectureSpec, config) -> LayerView:
    """Read the current (possibly already pruned) geometry of a decoder layer from its modules (a removed
    sublayer has 0 heads / 0 channels)."""
    attn = layer.get_submodule(spec.attn)
    head_dim = getattr(attn, "head_dim", None) or config.hidden_size // config.num_attention_heads
    qk_dim, vo_dim = getattr(attn, "qk_head_dim", head_dim), getattr(attn, "vo_head_dim", head_dim)
    if _removed(attn):
        num_heads = num_kv_heads = 0
    else:
        num_heads = weight_oi(layer.get_submodule(spec.o_path)).shape[1] // vo_dim
        if spec.fused_qkv:
            num_kv_heads = num_heads
        else:
            num_kv_heads = weight_oi(layer.get_submodule(spec.attn_path(spec.k))).shape[0] // qk_dim
    num_experts = None
    if spec.moe is None:
        removed_mlp = bool(spec.mlp) and _removed(layer.get_submodule(spec.mlp))
        intermediate = 0 if removed_mlp else weight_oi(layer.get_submodule(spec.mlp_out_path)).shape[1]
    else:
        block = layer.get_submodule(spec.mlp)
        experts = getattr(block, spec.moe.experts, None)
        if experts is not None:
            num_experts, intermediate = spec.moe.geometry(experts)
        else:  # a dense MLP layer of an MoE model (Qwen3-MoE's `mlp_only_layers`): never pruned
            intermediate = weight_oi(block.get_submodule(spec.moe.dense_out)).shape[1]
    view = LayerView(index, layer, spec, head_dim, num_heads, num_kv_heads, intermediate, qk_dim, vo_dim)
    view.num_experts = num_experts
    return view
