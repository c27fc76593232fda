"""What a pruning method decides, separate from how it is executed (`modeling.surgery`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["LayerPlan", "PruningPlan"]


@dataclass
class LayerPlan:
    """The decision for one decoder layer.

    Args:
        keep_heads (`list[int] | None`): query heads kept (`None`: attention untouched).
        keep_kv_heads (`list[int] | None`): KV heads kept (`None`: all).
        merge_kv (`list[list[int]] | None`): KV heads merged: each entry lists the KV heads that become one (in
            order; the new KV head takes the first one's place), every query head kept and regrouped so that the
            query heads of an entry's KV heads share the new one. The merged key / value weights are given in
            `weights`, written into the rows of every member (so that the zeroed form, every member holding the
            merged weights, computes what the removed form does); `None`: no merge. Not combined with `keep_heads`
            or `keep_kv_heads`.
        keep_channels (`list[int] | None`): MLP channels kept (`None`: MLP untouched).
        keep_qk (`list[int] | None`): q/k head dimensions kept in every head (SPP's QK pairs; indices into the
            current per-head q/k width; on rotary models both dimensions of a `rotate_half` pair, listed as
            `[pairs, pairs + d/2]`); `None`: untouched.
        keep_vo (`list[int] | None`): v head dimensions (and the matching o_proj inputs) kept in every head.
        scaling (`float | None`): new softmax scale of the attention (`None`: unchanged).
        keep_experts (`list[int] | None`): experts of a mixture-of-experts layer kept, in order (`None`: all).
        keep_expert_channels (`list[list[int]] | None`): channels kept in each kept expert (one list per entry of
            `keep_experts`, or per expert; all of one length); `None`: the experts' width untouched.
        weights (`dict[str, torch.Tensor]`): new full-size weights, (out, in) layout, keyed by the module path
            relative to the layer (e.g. `"self_attn.o_proj"`), or new values of a parameter in its own layout, keyed
            by its path (e.g. `"mlp.experts.down_proj"`); written before any removal.
        biases (`dict[str, torch.Tensor]`): new bias vectors (a bias is created where the module had none).
        info (`dict`): per-layer diagnostics for the report (e.g. the compensation residual).
        applied (`bool`): already executed on the block (a low-memory or resumed run writes each block as soon as it
            is decided; its `weights` / `biases` are then dropped).
    """

    keep_heads: list[int] | None = None
    keep_kv_heads: list[int] | None = None
    merge_kv: list[list[int]] | None = None
    keep_channels: list[int] | None = None
    keep_qk: list[int] | None = None
    keep_vo: list[int] | None = None
    scaling: float | None = None
    keep_experts: list[int] | None = None
    keep_expert_channels: list[list[int]] | None = None
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    biases: dict[str, torch.Tensor] = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    applied: bool = False

    @property
    def structured(self) -> bool:
        return any(
            x is not None
            for x in (
                self.keep_heads,
                self.merge_kv,
                self.keep_channels,
                self.keep_qk,
                self.keep_vo,
                *self.expert_decision.values(),
            )
        )

    @property
    def expert_decision(self) -> dict[str, list | None]:
        return {"keep_experts": self.keep_experts, "keep_expert_channels": self.keep_expert_channels}


@dataclass
class PruningPlan:
    """Per-layer plans for a whole model, keyed by decoder-layer index."""

    layers: dict[int, LayerPlan] = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    artifacts: dict = field(default_factory=dict)  # objects a method made besides the decision (SPP: its path)

    def summary(self) -> dict[int, dict]:
        """Kept heads / channels per layer, for determinism checks and the report."""
        return {
            i: {
                "keep_heads": p.keep_heads,
                "keep_kv_heads": p.keep_kv_heads,
                "keep_channels": p.keep_channels,
                **({"keep_qk": p.keep_qk, "keep_vo": p.keep_vo} if p.keep_qk or p.keep_vo else {}),
                **({"merge_kv": p.merge_kv} if p.merge_kv else {}),
                **{k: v for k, v in p.expert_decision.items() if v is not None},
            }
            for i, p in sorted(self.layers.items())
        }
