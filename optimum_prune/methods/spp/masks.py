"""SPP's structural units and the search masks on them, attached to a stock model with forward hooks.

Per decoder layer (its current geometry, so an already pruned model works too):
  - `qk`: head dimensions of q and k, one mask shared by every head of the layer (query and KV heads alike, so GQA
    groups stay intact); on rotary models one unit per `rotate_half` pair (j, j + d/2), the mask multiplying both;
  - `vo`: head dimensions of v, shared by every KV head (the o_proj inputs they feed go with them);
  - `mlp`: channels; the mask multiplies the input of down_proj on gated MLPs (SwiGLU: `silu(gate)·up`; our extension)
    and the fc1 output before the activation on two-layer MLPs (the authors' ViT code).
The masks multiply projection outputs (q/k before any q/k norm and before the rotary embedding, which commutes with a
mask tied over each pair), so a 0/1 mask is exactly the model with those rows / columns zeroed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ...modeling.architectures import ArchitectureSpec, LayerView, weight_oi
from ...modeling.shapes import col_params, mlp_channel_cost, row_params

__all__ = ["KINDS", "layer_units", "unit_costs", "MaskSet", "SearchMasks", "attach_masks", "folded_weights"]

KINDS = ("qk", "vo", "mlp")


def layer_units(view: LayerView, prune_attention: bool, prune_mlp: bool) -> dict[str, int]:
    """Number of units of each kind in one layer."""
    out = {}
    if prune_attention:
        out["qk"] = view.qk_head_dim // 2 if view.spec.rotary else view.qk_head_dim
        out["vo"] = view.vo_head_dim
    if prune_mlp:
        out["mlp"] = view.intermediate_size
    return out


def unit_costs(view: LayerView) -> dict[str, float]:
    """Parameters removed with one unit of each kind: q/k rows of every head (x2 for a rotary pair), v rows of every
    KV head plus the o_proj column of every query head, MLP rows and column."""
    spec, h, kv = view.spec, view.num_heads, view.num_kv_heads
    if spec.fused_qkv:
        q_row = k_row = v_row = row_params(view.module(spec.qkv_paths[0]))
    else:
        q_row, k_row, v_row = (row_params(view.module(p)) for p in spec.qkv_paths)
    qk = h * q_row + kv * k_row
    return {
        "qk": float(2 * qk if spec.rotary else qk),
        "vo": float(kv * v_row + h * col_params(view.o_proj)),
        "mlp": mlp_channel_cost(view),
    }


class MaskSet(nn.Module):
    """Trainable mask tensors keyed `(layer, kind)`, initialised to 1 (float32): what the search optimises."""

    def __init__(self, shapes: dict[tuple[int, str], tuple[int, ...]], device: torch.device | str | None = None):
        super().__init__()
        self.keys = list(shapes)
        self.masks = nn.ParameterList(
            [nn.Parameter(torch.ones(shape, dtype=torch.float32, device=device)) for shape in shapes.values()]
        )
        self._index = {key: j for j, key in enumerate(self.keys)}

    def get(self, layer: int, kind: str) -> nn.Parameter | None:
        j = self._index.get((layer, kind))
        return None if j is None else self.masks[j]

    def items(self) -> Iterator[tuple[int, str, nn.Parameter]]:
        for (i, kind), p in zip(self.keys, self.masks):
            yield i, kind, p


class SearchMasks(MaskSet):
    """One mask vector per layer and unit kind (`qk`, `vo`, `mlp`)."""

    def __init__(self, units: dict[int, dict[str, int]], device: torch.device | str | None = None) -> None:
        super().__init__({(i, k): (n,) for i, per in sorted(units.items()) for k, n in per.items()}, device)
        self.units = units

    @torch.no_grad()
    def set_binary_(self, keep: dict[int, dict[str, list[int]]]) -> None:
        """Set every mask to 1 on the kept units and 0 elsewhere (units of layers / kinds not in `keep`: 1)."""
        for i, kind, p in self.items():
            kept = keep.get(i, {}).get(kind)
            if kept is not None:
                p.zero_()
                p[torch.as_tensor(kept, dtype=torch.long, device=p.device)] = 1


def _expand_qk(mask: torch.Tensor, rotary: bool) -> torch.Tensor:
    return torch.cat([mask, mask]) if rotary else mask  # a rotary pair (j, j + d/2) shares one mask value


def _per_head(out: torch.Tensor, heads: int, mask: torch.Tensor) -> torch.Tensor:
    return (out.unflatten(-1, (heads, mask.numel())) * mask.to(out.dtype)).flatten(-2)


def _layer_hooks(view: LayerView, masks: SearchMasks) -> list:
    spec, i = view.spec, view.index
    qk, vo, mlp = masks.get(i, "qk"), masks.get(i, "vo"), masks.get(i, "mlp")
    h, kv = view.num_heads, view.num_kv_heads
    handles = []

    def out_hook(fn):
        return lambda module, args, out: fn(out)

    if qk is not None or vo is not None:
        if spec.fused_qkv:
            w_qk, w_vo = h * view.qk_head_dim, h * view.vo_head_dim

            def fused(out):
                q, k, v = out.split([w_qk, w_qk, w_vo], dim=-1)
                if qk is not None:
                    full = _expand_qk(qk, spec.rotary)
                    q, k = _per_head(q, h, full), _per_head(k, h, full)
                if vo is not None:
                    v = _per_head(v, h, vo)
                return torch.cat([q, k, v], dim=-1)

            handles.append(view.module(spec.qkv_paths[0]).register_forward_hook(out_hook(fused)))
        else:
            q_path, k_path, v_path = spec.qkv_paths
            if qk is not None:
                handles.append(view.module(q_path).register_forward_hook(
                    out_hook(lambda o: _per_head(o, h, _expand_qk(qk, spec.rotary)))))  # fmt: skip
                handles.append(view.module(k_path).register_forward_hook(
                    out_hook(lambda o: _per_head(o, kv, _expand_qk(qk, spec.rotary)))))  # fmt: skip
            if vo is not None:
                handles.append(view.module(v_path).register_forward_hook(out_hook(lambda o: _per_head(o, kv, vo))))
    if mlp is not None:
        if len(spec.mlp_in_paths) > 1:  # gated: the input of down_proj
            handles.append(view.mlp_out.register_forward_pre_hook(lambda m, args: (args[0] * mlp.to(args[0].dtype),)))
        else:  # fc1 output, before the activation
            handles.append(view.module(spec.mlp_in_paths[0]).register_forward_hook(
                out_hook(lambda o: o * mlp.to(o.dtype))))  # fmt: skip
    return handles


@contextlib.contextmanager
def attach_masks(views: list[LayerView], spec: ArchitectureSpec, masks: SearchMasks):
    """Within the block, the layers of `views` run with `masks` applied; the hooks are always removed."""
    handles = []
    try:
        for view in views:
            if view.index in masks.units:
                handles += _layer_hooks(view, masks)
        yield masks
    finally:
        for h in handles:
            h.remove()


def folded_weights(view: LayerView, masks: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """Weights and biases of layer `view` with the mask values `masks` (`{kind: (units,)}`) multiplied in, so that the
    plain layer computes what the masked one did: q and k rows times the QK mask (a logit then scales by its square,
    as in the search), v rows times the VO mask, down_proj columns (gated MLPs) or fc1 rows (two-layer MLPs) times
    the MLP mask. Returns `(weights, biases)` keyed by layer-relative path, in (out, in) layout."""
    spec, h, kv = view.spec, view.num_heads, view.num_kv_heads
    rows: dict[str, torch.Tensor] = {}
    qk = masks.get("qk")
    f_qk = None if qk is None else _expand_qk(qk.float(), spec.rotary)
    f_vo = None if masks.get("vo") is None else masks["vo"].float()
    ones_qk, ones_vo = torch.ones(view.qk_head_dim), torch.ones(view.vo_head_dim)
    if f_qk is not None or f_vo is not None:
        q, k = (ones_qk if f_qk is None else f_qk), (ones_qk if f_qk is None else f_qk)
        v = ones_vo if f_vo is None else f_vo
        if spec.fused_qkv:
            rows[spec.qkv_paths[0]] = torch.cat([q.repeat(h), k.repeat(h), v.repeat(h)])
        else:
            q_path, k_path, v_path = spec.qkv_paths
            rows.update({q_path: q.repeat(h), k_path: k.repeat(kv), v_path: v.repeat(kv)})
    weights, biases = {}, {}
    mlp = masks.get("mlp")
    if mlp is not None and len(spec.mlp_in_paths) > 1:
        W = weight_oi(view.mlp_out).detach()
        weights[spec.mlp_out_path] = W * mlp.to(W)[None, :]
    elif mlp is not None:
        rows[spec.mlp_in_paths[0]] = mlp.float()
    for path, factor in rows.items():
        module = view.module(path)
        W = weight_oi(module).detach()
        weights[path] = W * factor.to(W)[:, None]
        if getattr(module, "bias", None) is not None:
            biases[path] = module.bias.detach() * factor.to(module.bias)
    return weights, biases
