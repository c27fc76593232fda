"""Physical removal of heads / KV groups / MLP channels, and replay of recorded shapes on a skeleton.

Only this module changes module shapes. Everything works on `nn.Linear` and GPT-2 `Conv1D` alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..plan import LayerPlan
from .architectures import LayerView, get_layers, layer_view, weight_oi
from .experts import remove_expert_channels_, remove_experts_, reshape_experts_, zero_expert_channels_
from .pair_attention import set_pair_geometry_
from .sublayers import remove_attention_, remove_mlp_

__all__ = [
    "apply_plan_",
    "new_projection",
    "slice_projection",
    "set_submodule",
    "head_rows",
    "apply_layer_plan_",
    "set_attention_geometry_",
    "reshape_layer_",
    "dim_rows",
    "check_kv_merge",
    "merged_query_order",
]


def new_projection(like: nn.Module, in_features: int, out_features: int, bias: bool) -> nn.Module:
    """An empty projection of the same kind, dtype and device as `like`."""
    w = like.weight
    if isinstance(like, Conv1D):
        mod = Conv1D(out_features, in_features).to(device=w.device, dtype=w.dtype)
        if not bias:
            mod.bias = None
        return mod
    return nn.Linear(in_features, out_features, bias=bias, device=w.device, dtype=w.dtype)


def _conv1d_forward_no_bias(module: Conv1D, x: torch.Tensor) -> torch.Tensor:
    return x @ module.weight


def slice_projection(
    module: nn.Module,
    out_idx: Sequence[int] | torch.Tensor | None = None,
    in_idx: Sequence[int] | torch.Tensor | None = None,
) -> nn.Module:
    """A new projection holding `module`'s weights restricted to `out_idx` rows and `in_idx` columns."""
    w = weight_oi(module).detach()  # (out, in)
    dev = w.device
    if out_idx is not None:
        out_idx = torch.as_tensor(out_idx, dtype=torch.long, device=dev)
        w = w.index_select(0, out_idx)
    if in_idx is not None:
        in_idx = torch.as_tensor(in_idx, dtype=torch.long, device=dev)
        w = w.index_select(1, in_idx)
    bias = getattr(module, "bias", None)
    new = new_projection(module, w.shape[1], w.shape[0], bias is not None)
    with torch.no_grad():
        new.weight.copy_(w.T if isinstance(module, Conv1D) else w)
        if bias is not None:
            new.bias.copy_(bias.detach() if out_idx is None else bias.detach().index_select(0, out_idx))
    new.weight.requires_grad_(module.weight.requires_grad)
    return new


def set_submodule(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, new)


def head_rows(heads: Sequence[int], head_dim: int, offset: int = 0) -> torch.Tensor:
    """Row indices of the given heads in a projection whose output is laid out head by head."""
    heads_t = torch.as_tensor(list(heads), dtype=torch.long)
    return (offset + heads_t[:, None] * head_dim + torch.arange(head_dim)[None, :]).reshape(-1)


def _qkv_rows(view: LayerView, keep_heads: Sequence[int], keep_kv: Sequence[int]) -> dict[str, torch.Tensor]:
    spec, d = view.spec, view.head_dim
    if spec.fused_qkv:  # q | k | v blocks of width num_heads * head_dim each (no GQA in fused layouts)
        width = view.num_heads * d
        rows = torch.cat([head_rows(keep_heads, d, offset=i * width) for i in range(3)])
        return {spec.qkv_paths[0]: rows}
    q, k, v = spec.qkv_paths
    return {q: head_rows(keep_heads, d), k: head_rows(keep_kv, d), v: head_rows(keep_kv, d)}


def set_attention_geometry_(view: LayerView, num_heads: int, num_kv_heads: int) -> None:
    """Update the per-layer attributes that attention modules read at forward time."""
    attn, spec = view.attn, view.spec
    if hasattr(attn, "num_key_value_groups"):
        attn.num_key_value_groups = num_heads // num_kv_heads
    if spec.heads_attr:
        setattr(attn, spec.heads_attr, num_heads)
    if spec.split_attr:
        setattr(attn, spec.split_attr, num_heads * view.head_dim)
    if hasattr(attn, "num_heads") and not spec.heads_attr:
        attn.num_heads = num_heads
    if hasattr(attn, "num_key_value_heads"):
        attn.num_key_value_heads = num_kv_heads
    view.num_heads, view.num_kv_heads = num_heads, num_kv_heads


def _write_weights_(view: LayerView, plan: LayerPlan) -> None:
    for path, w in plan.weights.items():
        try:
            mod = view.module(path)
        except AttributeError:  # a parameter (fused experts), in its own layout
            param = view.layer.get_parameter(path)
            with torch.no_grad():
                param.copy_(w.to(param.dtype))
            continue
        with torch.no_grad():
            weight_oi(mod).copy_(w.to(mod.weight.dtype))
    for path, b in plan.biases.items():
        mod = view.module(path)
        if getattr(mod, "bias", None) is None:
            mod.bias = nn.Parameter(
                torch.zeros(weight_oi(mod).shape[0], dtype=mod.weight.dtype, device=mod.weight.device)
            )
        with torch.no_grad():
            mod.bias.copy_(b.to(mod.bias.dtype))


def _zero_rows_(mod: nn.Module, rows: torch.Tensor) -> None:
    with torch.no_grad():
        weight_oi(mod)[rows.to(mod.weight.device)] = 0
        if getattr(mod, "bias", None) is not None:
            mod.bias[rows.to(mod.weight.device)] = 0


def _zero_cols_(mod: nn.Module, cols: torch.Tensor) -> None:
    with torch.no_grad():
        weight_oi(mod)[:, cols.to(mod.weight.device)] = 0


def dim_rows(num_heads: int, width: int, keep: Sequence[int] | torch.Tensor, offset: int = 0) -> torch.Tensor:
    """Row indices of dimensions `keep` of every head, in a projection laid out head by head with `width` rows each."""
    keep_t = torch.as_tensor(list(keep) if not isinstance(keep, torch.Tensor) else keep, dtype=torch.long)
    return (offset + torch.arange(num_heads)[:, None] * width + keep_t[None, :]).reshape(-1)


def _pair_rows(view: LayerView, keep_qk, keep_vo) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Rows of q/k/v (or of the fused q|k|v) and o_proj columns holding the dimensions `keep_qk` / `keep_vo`."""
    spec, qk, vo, h, kv = view.spec, view.qk_head_dim, view.vo_head_dim, view.num_heads, view.num_kv_heads
    if spec.fused_qkv:  # q | k | v blocks of h * qk, h * qk, h * vo rows (no GQA in fused layouts)
        rows = torch.cat(
            [dim_rows(h, qk, keep_qk), dim_rows(h, qk, keep_qk, h * qk), dim_rows(h, vo, keep_vo, 2 * h * qk)]
        )
        return {spec.qkv_paths[0]: rows}, dim_rows(h, vo, keep_vo)
    q, k, v = spec.qkv_paths
    rows = {q: dim_rows(h, qk, keep_qk), k: dim_rows(kv, qk, keep_qk), v: dim_rows(kv, vo, keep_vo)}
    return rows, dim_rows(h, vo, keep_vo)


def _kept_rope_pairs(view: LayerView, keep_qk: list[int]) -> list[int] | None:
    """The original rotary pairs the kept q/k dimensions hold; raises unless they are whole `rotate_half` pairs."""
    if not view.spec.rotary:
        return None
    half = view.qk_head_dim // 2
    sel = sorted(j for j in keep_qk if j < half)
    if list(keep_qk) != sel + [j + half for j in sel]:
        raise ValueError(
            "Rotary q/k dimensions must be kept in whole rotate_half pairs (j, j + d/2), listed as [pairs, pairs + d/2]."
        )
    old = getattr(view.attn, "rope_pairs", None) or list(range(view.head_dim // 2))
    return [old[j] for j in sel]


def _slice_norms_(view: LayerView, keep: list[int]) -> None:
    """Per-head q/k norms (Qwen 3, Gemma 3) keep the weights of the kept dimensions."""
    for name in ("q_norm", "k_norm"):
        norm = getattr(view.attn, name, None)
        if norm is not None:
            idx = torch.as_tensor(keep, dtype=torch.long, device=norm.weight.device)
            norm.weight = nn.Parameter(norm.weight.detach().index_select(0, idx), norm.weight.requires_grad)


def _apply_pair_plan_(view: LayerView, plan: LayerPlan, mode: str) -> None:
    keep_qk = list(range(view.qk_head_dim)) if plan.keep_qk is None else list(plan.keep_qk)
    keep_vo = list(range(view.vo_head_dim)) if plan.keep_vo is None else list(plan.keep_vo)
    if mode == "remove":
        pairs = _kept_rope_pairs(view, keep_qk)
        rows, o_cols = _pair_rows(view, keep_qk, keep_vo)
        for path, r in rows.items():
            set_submodule(view.layer, path, slice_projection(view.module(path), out_idx=r))
        set_submodule(view.layer, view.spec.o_path, slice_projection(view.o_proj, in_idx=o_cols))
        _slice_norms_(view, keep_qk)
        set_pair_geometry_(view.attn, view.spec.pair_attention, len(keep_qk), len(keep_vo), pairs, plan.scaling)
        view.qk_head_dim, view.vo_head_dim = len(keep_qk), len(keep_vo)
        return
    drop_qk = sorted(set(range(view.qk_head_dim)) - set(keep_qk))
    drop_vo = sorted(set(range(view.vo_head_dim)) - set(keep_vo))
    rows, o_cols = _pair_rows(view, drop_qk, drop_vo)
    for path, r in rows.items():
        _zero_rows_(view.module(path), r)
    _zero_cols_(view.o_proj, o_cols)
    if plan.scaling is not None:
        view.attn.scaling = float(plan.scaling)


def apply_layer_plan_(view: LayerView, plan: LayerPlan, mode: str = "remove") -> None:
    """Execute a `LayerPlan` in place.

    Args:
        view (`LayerView`): the layer.
        plan (`LayerPlan`): the decision.
        mode (`str`, defaults to `"remove"`): `"remove"` physically drops the pruned units; `"zero"` keeps the shapes
            and zeroes them instead (same function, used to verify the removal).
    """
    if mode not in ("remove", "zero"):
        raise ValueError(f"mode must be 'remove' or 'zero', got {mode!r}")
    _write_weights_(view, plan)
    d = view.head_dim
    if plan.keep_qk is not None or plan.keep_vo is not None:
        if plan.keep_heads is not None:
            raise ValueError("A layer plan removes either heads or head dimensions, not both.")
        _apply_pair_plan_(view, plan, mode)
    if plan.merge_kv is not None:
        _apply_kv_merge_(view, plan.merge_kv, mode)
    if plan.keep_heads is not None:
        keep_kv = plan.keep_kv_heads if plan.keep_kv_heads is not None else list(range(view.num_kv_heads))
        if mode == "remove" and not plan.keep_heads:  # the whole attention sublayer goes
            remove_attention_(view.layer, view.spec)
            view.num_heads = view.num_kv_heads = 0
        elif mode == "remove":
            for path, rows in _qkv_rows(view, plan.keep_heads, keep_kv).items():
                set_submodule(view.layer, path, slice_projection(view.module(path), out_idx=rows))
            o = view.spec.o_path
            set_submodule(view.layer, o, slice_projection(view.module(o), in_idx=head_rows(plan.keep_heads, d)))
            set_attention_geometry_(view, len(plan.keep_heads), len(keep_kv))
        else:
            drop_h = sorted(set(range(view.num_heads)) - set(plan.keep_heads))
            drop_kv = sorted(set(range(view.num_kv_heads)) - set(keep_kv))
            for path, rows in _qkv_rows(view, drop_h, drop_kv).items():
                _zero_rows_(view.module(path), rows)
            _zero_cols_(view.o_proj, head_rows(drop_h, d))
    if plan.keep_channels is not None:
        keep = torch.as_tensor(plan.keep_channels, dtype=torch.long)
        if mode == "remove" and not plan.keep_channels:  # the whole MLP sublayer goes
            remove_mlp_(view.layer, view.spec)
            view.intermediate_size = 0
        elif mode == "remove":
            for path in view.spec.mlp_in_paths:
                set_submodule(view.layer, path, slice_projection(view.module(path), out_idx=keep))
            out = view.spec.mlp_out_path
            set_submodule(view.layer, out, slice_projection(view.module(out), in_idx=keep))
            view.intermediate_size = len(keep)
        else:
            drop = torch.as_tensor(
                sorted(set(range(view.intermediate_size)) - set(plan.keep_channels)), dtype=torch.long
            )
            for path in view.spec.mlp_in_paths:
                _zero_rows_(view.module(path), drop)
            _zero_cols_(view.mlp_out, drop)
    _apply_expert_plan_(view, plan, mode)


def merged_query_order(merge_kv: Sequence[Sequence[int]], group_size: int) -> list[int]:
    """The query heads in their new order after the KV heads of each entry of `merge_kv` became one: the query heads
    of the first entry's KV heads, then of the second's, and so on (`group_size` query heads per old KV head)."""
    return [kv * group_size + r for group in merge_kv for kv in group for r in range(group_size)]


def check_kv_merge(merge_kv: Sequence[Sequence[int]], num_kv_heads: int) -> None:
    """Raise unless `merge_kv` partitions the `num_kv_heads` KV heads into entries of one size."""
    flat = sorted(int(k) for group in merge_kv for k in group)
    sizes = {len(group) for group in merge_kv}
    if flat != list(range(num_kv_heads)) or len(sizes) != 1:
        raise ValueError(
            f"merge_kv must split the {num_kv_heads} KV heads into groups of one size, each head once; got "
            f"{[list(g) for g in merge_kv]}."
        )


def _apply_kv_merge_(view: LayerView, merge_kv: Sequence[Sequence[int]], mode: str) -> None:
    """KV heads merged (`LayerPlan.merge_kv`; the merged weights are already written into every member's rows).
    `"remove"` keeps the first member of each entry and regroups the query heads (q_proj rows and o_proj columns
    permuted); `"zero"` leaves the members' identical rows in place, which computes the same attention."""
    check_kv_merge(merge_kv, view.num_kv_heads)
    if mode == "zero":
        return
    if view.spec.fused_qkv:
        raise ValueError("Merging KV heads needs separate q/k/v projections.")
    d, keep_kv = view.head_dim, [int(group[0]) for group in merge_kv]
    order = merged_query_order(merge_kv, view.group_size)
    q, k, v = view.spec.qkv_paths
    set_submodule(view.layer, q, slice_projection(view.module(q), out_idx=head_rows(order, d)))
    for path in (k, v):
        set_submodule(view.layer, path, slice_projection(view.module(path), out_idx=head_rows(keep_kv, d)))
    o = view.spec.o_path
    set_submodule(view.layer, o, slice_projection(view.module(o), in_idx=head_rows(order, d)))
    set_attention_geometry_(view, view.num_heads, len(keep_kv))


def _apply_expert_plan_(view: LayerView, plan: LayerPlan, mode: str) -> None:
    """Whole experts, then channels inside the kept experts (`keep_expert_channels` lists them in kept order)."""
    if plan.keep_experts is None and plan.keep_expert_channels is None:
        return
    if not view.is_moe:
        raise ValueError(f"Layer {view.index} has no experts; an expert plan needs a mixture-of-experts layer.")
    if mode == "zero":
        if plan.keep_experts is not None:
            raise ValueError(
                "Removed experts cannot be expressed as zeroed weights (their router logits would still compete); "
                "compare with a router that masks them instead."
            )
        zero_expert_channels_(view, plan.keep_expert_channels)
        return
    if plan.keep_experts is not None:
        remove_experts_(view, plan.keep_experts)
    if plan.keep_expert_channels is not None:
        remove_expert_channels_(view, plan.keep_expert_channels)


def reshape_layer_(view: LayerView, shapes: dict) -> None:
    """Give a layer the recorded shapes (used on a fresh skeleton before weights load; values are not kept).

    Args:
        view (`LayerView`): the layer, at its configured (unpruned) shape.
        shapes (`dict`): `num_attention_heads`, `num_key_value_heads`, `intermediate_size` and `biases` (the
            layer-relative paths of every projection that has a bias); for mixture-of-experts layers also
            `num_experts` (`intermediate_size` is then the experts' width); for layers whose head dimensions were pruned
            (SPP) also `qk_head_dim`, `vo_head_dim`, `attn_scaling` and, on rotary models, `rope_pairs`.
    """
    spec, d = view.spec, view.head_dim
    heads, kv = shapes["num_attention_heads"], shapes["num_key_value_heads"]
    qk, vo = shapes.get("qk_head_dim", d), shapes.get("vo_head_dim", d)
    biases = set(shapes.get("biases", []))
    hidden = weight_oi(view.o_proj).shape[0]
    outs = {}
    if spec.fused_qkv:
        outs[spec.qkv_paths[0]] = (hidden, heads * (2 * qk + vo))
    else:
        q, k, v = spec.qkv_paths
        outs.update({q: (hidden, heads * qk), k: (hidden, kv * qk), v: (hidden, kv * vo)})
    outs[spec.o_path] = (heads * vo, hidden)
    for path in spec.mlp_in_paths:
        outs[path] = (hidden, shapes["intermediate_size"])
    if spec.mlp_out_path is not None:
        outs[spec.mlp_out_path] = (shapes["intermediate_size"], hidden)
    elif "num_experts" in shapes:
        reshape_experts_(view, shapes["num_experts"], shapes["intermediate_size"])
    if heads == 0:  # a removed sublayer (modeling.sublayers)
        outs = {p: s for p, s in outs.items() if p not in (*spec.qkv_paths, spec.o_path)}
    if shapes["intermediate_size"] == 0:
        outs = {p: s for p, s in outs.items() if p not in (*spec.mlp_in_paths, spec.mlp_out_path)}
    for path, (fan_in, fan_out) in outs.items():
        set_submodule(view.layer, path, new_projection(view.module(path), fan_in, fan_out, path in biases))
    if heads == 0:
        remove_attention_(view.layer, spec)
        view.num_heads = view.num_kv_heads = 0
    else:
        set_attention_geometry_(view, heads, kv)
    if shapes["intermediate_size"] == 0:
        remove_mlp_(view.layer, spec)
    if spec.moe is None or "num_experts" in shapes:  # a dense layer of an MoE model keeps its configured MLP
        view.intermediate_size = shapes["intermediate_size"]
    if "qk_head_dim" in shapes:
        for name in ("q_norm", "k_norm"):
            norm = getattr(view.attn, name, None)
            if norm is not None:
                norm.weight = nn.Parameter(torch.empty(qk, dtype=norm.weight.dtype, device=norm.weight.device))
        set_pair_geometry_(
            view.attn, spec.pair_attention, qk, vo, shapes.get("rope_pairs"), shapes.get("attn_scaling")
        )
        view.qk_head_dim, view.vo_head_dim = qk, vo


def apply_plan_(model: nn.Module, spec, plan) -> None:
    """Execute a plan's layer decisions in place (those a low-memory or resumed run has already written are
    restored by the session instead)."""
    layers = get_layers(model, spec)
    for idx, lp in plan.layers.items():
        if not lp.applied:
            apply_layer_plan_(layer_view(layers[idx], idx, spec, model.config), lp, mode="remove")
