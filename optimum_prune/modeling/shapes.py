"""Shapes and parameter counts of decoder layers: the per-layer shape record that a pruned checkpoint, a low-memory
block file and a run checkpoint all store (`layer_row`), and what a unit (a head, a KV group, an MLP channel) costs in
parameters."""

from __future__ import annotations

from typing import Any

from torch import nn

from .architectures import ArchitectureSpec, LayerView, get_layers, layer_view, present_linear_paths, weight_oi
from .experts import moe_parameters

__all__ = [
    "layer_row",
    "layer_table",
    "attention_mlp_params",
    "layer_params",
    "head_costs",
    "mlp_channel_cost",
    "row_params",
    "col_params",
]


def layer_row(layer: nn.Module, index: int, spec: ArchitectureSpec, config) -> dict[str, Any]:
    """One decoder layer's heads, KV heads, head_dim, intermediate size (an MoE layer's: its experts' width, with
    `num_experts`), and which projections carry a bias; for a
    layer whose head dimensions were pruned (SPP) also `qk_head_dim`, `vo_head_dim`, the softmax scale and, on
    rotary models, the kept `rope_pairs` (`modeling.pair_attention`)."""
    v = layer_view(layer, index, spec, config)
    row = {
        "num_attention_heads": v.num_heads,
        "num_key_value_heads": v.num_kv_heads,
        "head_dim": v.head_dim,
        "intermediate_size": v.intermediate_size,
        "biases": sorted(p for p in v.linears() if getattr(layer.get_submodule(p), "bias", None) is not None),
    }
    if v.is_moe:
        row["num_experts"] = v.num_experts
    if v.pair_shaped:
        attn = v.attn
        row.update(qk_head_dim=v.qk_head_dim, vo_head_dim=v.vo_head_dim, attn_scaling=float(attn.scaling))
        if getattr(attn, "rope_pairs", None) is not None:
            row["rope_pairs"] = list(attn.rope_pairs)
    return row


def layer_table(model: nn.Module, spec: ArchitectureSpec) -> list[dict[str, Any]]:
    """`layer_row` of every decoder layer."""
    return [layer_row(layer, i, spec, model.config) for i, layer in enumerate(get_layers(model, spec))]


def row_params(mod: nn.Module) -> int:
    """Parameters of one output row of a projection (its weights and bias entry)."""
    return weight_oi(mod).shape[1] + (1 if getattr(mod, "bias", None) is not None else 0)


def col_params(mod: nn.Module) -> int:
    """Parameters of one input column of a projection."""
    return weight_oi(mod).shape[0]


def attention_mlp_params(model: nn.Module, spec: ArchitectureSpec) -> int:
    """Parameters of every q/k/v/o and MLP projection of the decoder (what `pruning_ratio` refers to); on a
    mixture-of-experts model the MLP is each MoE block (router and experts)."""
    total = 0
    for i, layer in enumerate(get_layers(model, spec)):
        for path in present_linear_paths(layer, spec):
            total += sum(p.numel() for p in layer.get_submodule(path).parameters(recurse=False))
        if spec.moe is not None:
            total += moe_parameters(layer_view(layer, i, spec, model.config))
    return total


def head_costs(view: LayerView) -> tuple[float, float]:
    """Parameters removed with one query head (its q rows and o columns) and with one whole KV group (its query
    heads plus the k / v rows of its KV head)."""
    spec, d = view.spec, view.head_dim
    if spec.fused_qkv:
        q_row = k_row = v_row = row_params(view.module(spec.qkv_paths[0]))
    else:
        q_row, k_row, v_row = (row_params(view.module(p)) for p in spec.qkv_paths)
    per_q_head = d * (q_row + col_params(view.o_proj))
    return float(per_q_head), float(view.group_size * per_q_head + d * (k_row + v_row))


def mlp_channel_cost(view: LayerView) -> float:
    """Parameters removed with one MLP channel (rows of the input projections, a column of the output one)."""
    return float(sum(row_params(view.module(p)) for p in view.spec.mlp_in_paths) + col_params(view.mlp_out))


def layer_params(view: LayerView) -> float:
    """Parameters of the layer's attention + MLP projections."""
    return float(sum(p.numel() for mod in view.linears().values() for p in mod.parameters(recurse=False)))
