"""Sparse mixture-of-experts blocks: each routed expert's computation, and the physical removal of whole experts and
of channels inside the experts (the MoE counterpart of `surgery`).

Works on the fused layout of transformers >= 5 (`modeling.moe`): `gate_up_proj (E, 2I, H)` / `down_proj (E, H, I)`
(concatenated gate | up rows), or transposed `(E, H, 2I)` / `(E, I, H)` with interleaved gate / up columns and
biases (gpt-oss). Every expert of a layer keeps one width, so channel removal keeps the same number of channels in
every expert (each expert its own channels).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import nn

from .views import LayerView

__all__ = [
    "routing",
    "expert_forward",
    "routed_experts",
    "remove_experts_",
    "remove_expert_channels_",
    "zero_expert_channels_",
    "reshape_experts_",
    "moe_parameters",
    "check_top_k",
]


def _replace(module: nn.Module, name: str, value: torch.Tensor) -> None:
    old = getattr(module, name)
    setattr(module, name, nn.Parameter(value.detach().contiguous(), requires_grad=old.requires_grad))


def _expert_params(view: LayerView) -> dict[str, nn.Parameter]:
    experts, moe = view.experts, view.spec.moe
    return {n: getattr(experts, n) for n in (*moe.gate_up_names, *moe.down_names)}


def moe_parameters(view: LayerView) -> int:
    """Parameters of the layer's MoE block (router, experts, shared expert); 0 for a dense layer."""
    if not view.is_moe:
        return 0
    return sum(p.numel() for p in view.module(view.spec.mlp).parameters())


def top_k(view: LayerView) -> int:
    return int(view.router.top_k)


def check_top_k(view: LayerView, kept: int) -> None:
    """Raise unless `kept` experts leave the router its `num_experts_per_tok` choices."""
    k = top_k(view)
    if kept < k:
        raise ValueError(
            f"Layer {view.index} would keep {kept} experts but routes every token to num_experts_per_tok={k}: keep "
            f"at least {k} experts per layer (a smaller expert ratio, or min_experts_per_layer >= {k}). Nothing was "
            "changed."
        )


# ------------------------------------------------------------------------------------------------- forward parts
def routing(view: LayerView, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's decision for tokens `x` (`(..., H)`): `(probs (T, E): softmax over every expert (at least in
    float32), indices (T, k), weights (T, k): what the forward multiplies the chosen experts' outputs by)`."""
    logits, weights, indices = view.router(x.reshape(-1, x.shape[-1]))
    return torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32)), indices, weights


def expert_forward(view: LayerView, j: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert `j` on tokens `x` (`(n, H)`): `(h (n, I): the input of its down projection, out (n, H))`, computed
    with the experts module's own gate (`_apply_gate`)."""
    experts, moe = view.experts, view.spec.moe
    W = experts.gate_up_proj[j]
    gate_up = x @ W if moe.transposed else x @ W.T  # (n, 2I)
    if moe.expert_bias:
        gate_up = gate_up + experts.gate_up_proj_bias[j]
    h = experts._apply_gate(gate_up)  # (n, I)
    D = experts.down_proj[j]
    out = h @ D if moe.transposed else h @ D.T  # (n, H)
    if moe.expert_bias:
        out = out + experts.down_proj_bias[j]
    return h, out


def routed_experts(
    view: LayerView, x: torch.Tensor
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """For every expert the router picks among tokens `x`: `(j, tokens (n,), prob (n,): its softmax probability over
    every expert, weight (n,): what the forward multiplies its output by, h (n, I), out (n, H))`.

    The layer's output is `Σ_j weight · out` summed onto each token (what `tests` check against the stock forward).
    """
    x = x.reshape(-1, x.shape[-1])
    probs, indices, weights = routing(view, x)
    for j in range(view.num_experts):
        tokens, slot = (indices == j).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        h, out = expert_forward(view, j, x[tokens])
        yield j, tokens, probs[tokens, j], weights[tokens, slot], h, out


# ------------------------------------------------------------------------------------------------------- surgery
def remove_experts_(view: LayerView, keep: Sequence[int]) -> None:
    """Keep only experts `keep` (in that order): their slices of every expert parameter and the router's rows."""
    check_top_k(view, len(keep))
    experts, router = view.experts, view.router
    idx = torch.as_tensor(list(keep), dtype=torch.long, device=experts.down_proj.device)
    for name, p in _expert_params(view).items():
        _replace(experts, name, p.detach().index_select(0, idx))
    _replace(router, "weight", router.weight.detach().index_select(0, idx.to(router.weight.device)))
    if getattr(router, "bias", None) is not None:
        _replace(router, "bias", router.bias.detach().index_select(0, idx.to(router.bias.device)))
    _set_count(view, len(keep))


def _set_count(view: LayerView, n: int) -> None:
    view.experts.num_experts = n
    view.router.num_experts = n
    view.num_experts = n


def _set_width(view: LayerView, width: int) -> None:
    for attr in ("intermediate_dim", "intermediate_size"):  # kept by the experts modules (Qwen3-MoE: the former)
        if hasattr(view.experts, attr):
            setattr(view.experts, attr, width)
    view.intermediate_size = width


def _channel_index(view: LayerView, keep: Sequence[Sequence[int]]) -> torch.Tensor:
    idx = torch.as_tensor([list(k) for k in keep], dtype=torch.long, device=view.experts.down_proj.device)
    if idx.dim() != 2 or idx.shape[0] != view.num_experts:
        raise ValueError(
            f"Layer {view.index}: give the kept channels of each of its {view.num_experts} experts, one list per "
            "expert, all of the same length (the fused experts have one width)."
        )
    return idx  # (E, k)


def _gate_up_columns(view: LayerView, idx: torch.Tensor) -> torch.Tensor:
    """`(E, 2k)` positions of the gate and up units of channels `idx` along the gate_up output dimension."""
    if view.spec.moe.interleaved:
        return torch.stack([2 * idx, 2 * idx + 1], dim=-1).reshape(idx.shape[0], -1)
    return torch.cat([idx, idx + view.intermediate_size], dim=1)


def _gather(p: torch.Tensor, dim: int, idx: torch.Tensor) -> torch.Tensor:
    """`p[e]` restricted to positions `idx[e]` along `dim` (1 or 2), for every expert e."""
    shape = list(p.shape)
    shape[dim] = idx.shape[1]
    index = idx.view(idx.shape[0], *([1] * (dim - 1)), idx.shape[1], *([1] * (p.dim() - dim - 1)))
    return p.gather(dim, index.expand(shape))


def _channel_dims(view: LayerView) -> dict[str, tuple[int, bool]]:
    """`{parameter: (dimension holding the channels, whether they are gate | up units)}`."""
    moe = view.spec.moe
    dims = {"gate_up_proj": (2 if moe.transposed else 1, True), "down_proj": (1 if moe.transposed else 2, False)}
    if moe.expert_bias:
        dims["gate_up_proj_bias"] = (1, True)
    return dims


def remove_expert_channels_(view: LayerView, keep: Sequence[Sequence[int]]) -> None:
    """Keep channels `keep[e]` of every expert `e` (the same number in each): the gate / up units producing them and
    the down-projection inputs reading them."""
    idx = _channel_index(view, keep)
    experts = view.experts
    for name, (dim, gate_up) in _channel_dims(view).items():
        p = getattr(experts, name).detach()
        _replace(experts, name, _gather(p, dim, _gate_up_columns(view, idx) if gate_up else idx))
    _set_width(view, idx.shape[1])


def zero_expert_channels_(view: LayerView, keep: Sequence[Sequence[int]]) -> None:
    """Zero every channel not in `keep[e]` of every expert, keeping the shapes (the reference of the removal)."""
    idx = _channel_index(view, keep)
    mask = torch.ones(view.num_experts, view.intermediate_size, dtype=torch.bool, device=idx.device)
    mask.scatter_(1, idx, False)  # (E, I) True = removed
    drop = [mask[e].nonzero()[:, 0] for e in range(view.num_experts)]
    width = min(len(d) for d in drop)
    if any(len(d) != width for d in drop):
        raise ValueError("every expert must keep the same number of channels")
    drop_idx = torch.stack(drop) if width else idx[:, :0]
    with torch.no_grad():
        for name, (dim, gate_up) in _channel_dims(view).items():
            p = getattr(view.experts, name)
            pos = _gate_up_columns(view, drop_idx) if gate_up else drop_idx
            index = pos.view(pos.shape[0], *([1] * (dim - 1)), pos.shape[1], *([1] * (p.dim() - dim - 1)))
            shape = list(p.shape)
            shape[dim] = pos.shape[1]
            p.scatter_(dim, index.expand(shape), 0.0)


def reshape_experts_(view: LayerView, num_experts: int, width: int) -> None:
    """Give an MoE layer `num_experts` experts of `width` channels (on a fresh skeleton, before weights load; the
    values are not kept)."""
    experts, router = view.experts, view.router
    for name, p in _expert_params(view).items():
        shape = list(p.shape)
        shape[0] = num_experts
        if name in _channel_dims(view):
            dim, gate_up = _channel_dims(view)[name]
            shape[dim] = 2 * width if gate_up else width
        _replace(experts, name, torch.empty(shape, dtype=p.dtype, device=p.device))
    _replace(router, "weight", torch.empty(num_experts, router.weight.shape[1], dtype=router.weight.dtype,
                                           device=router.weight.device))  # fmt: skip
    if getattr(router, "bias", None) is not None:
        _replace(router, "bias", torch.empty(num_experts, dtype=router.bias.dtype, device=router.bias.device))
    _set_count(view, num_experts)
    _set_width(view, width)
