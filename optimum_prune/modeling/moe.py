"""How a sparse mixture-of-experts block is laid out: the description the architecture table holds for MoE models.

transformers >= 5 stores the experts of a layer as fused 3-D parameters, `experts.gate_up_proj` and
`experts.down_proj` (plus `*_bias` on gpt-oss), so every expert of a layer has one width, and routes each token with
a router module (`weight` of shape `(num_experts, hidden)`, and a `bias` on gpt-oss) whose forward returns
`(logits, top-k weights, top-k indices)`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MoESpec", "ROUTINGS"]

# How the router turns logits into the top-k weights (what "masking an expert" must reproduce):
#   "softmax_topk": softmax over every expert, then top-k; renormalised over the k when `norm_key` is set in the
#       config (Qwen3-MoE, OLMoE) or always (`norm_key=None`, `always_norm=True`: Mixtral);
#   "topk_softmax": top-k of the logits, then a softmax over those k (gpt-oss).
# In both, an expert whose logit is -inf is never chosen and takes no share of any softmax: removing the expert and
# its router row gives exactly the routing of the full router with that logit masked to -inf.
ROUTINGS = ("softmax_topk", "topk_softmax")


@dataclass(frozen=True)
class MoESpec:
    """Where the parts of a sparse MoE block live (paths relative to the block, the layer's `ArchitectureSpec.mlp`).

    Args:
        router (`str`): the router module (`weight (E, hidden)`, optional `bias (E,)`).
        experts (`str`): the experts module holding the fused `gate_up_proj` / `down_proj` parameters.
        transposed (`bool`): experts stored `(E, in, out)` (gpt-oss) instead of `(E, out, in)`.
        interleaved (`bool`): gate and up channels interleaved in `gate_up_proj` (gate `2c`, up `2c + 1`: gpt-oss)
            instead of concatenated (gate rows `[0, I)`, up rows `[I, 2I)`).
        expert_bias (`bool`): the experts carry `gate_up_proj_bias` / `down_proj_bias`.
        routing (`str`): one of `ROUTINGS`.
        norm_key (`str | None`): config flag renormalising the top-k weights (`"norm_topk_prob"`), `None` when fixed.
        always_norm (`bool`): with `norm_key=None`, whether the top-k weights are always renormalised (Mixtral).
        shared_expert (`str | None`): a dense MLP every token also goes through (none of the supported models).
        dense_out (`str | None`): output projection of the dense MLP of a non-MoE layer of the same model
            (Qwen3-MoE's `mlp_only_layers`), to read its width.
        legacy_block (`str | None`): the block's name in checkpoints that store one tensor per expert (what
            transformers writes and the Hub holds: `mlp`; Mixtral's `block_sparse_moe`); `None`: stored fused.
        legacy_names (`tuple[str, str, str]`): the gate, up and down projections of one expert in those checkpoints
            (`experts.{j}.<name>.weight`).
    """

    router: str = "gate"
    experts: str = "experts"
    transposed: bool = False
    interleaved: bool = False
    expert_bias: bool = False
    routing: str = "softmax_topk"
    norm_key: str | None = "norm_topk_prob"
    always_norm: bool = False
    shared_expert: str | None = None
    dense_out: str | None = None
    legacy_block: str | None = "mlp"
    legacy_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")

    def legacy_tensors(self, block: str, num_experts: int) -> dict[str, tuple[str, list[str]]]:
        """How the fused tensors of the MoE block at `block` (full name, e.g. `model.layers.3.mlp`) are stored in a
        per-expert checkpoint: `{fused name: ("gate_up" | "stack" | "same", stored names)}` (`"gate_up"`: expert j's
        gate and up rows concatenated, `"stack"`: one tensor per expert stacked, `"same"`: one tensor renamed)."""
        if self.legacy_block is None:
            return {}
        old = block.rsplit(".", 1)[0] + "." + self.legacy_block
        gate, up, down = (
            [f"{old}.{self.experts}.{j}.{name}.weight" for j in range(num_experts)] for name in self.legacy_names
        )
        out = {
            f"{block}.{self.experts}.gate_up_proj": ("gate_up", [t for pair in zip(gate, up) for t in pair]),
            f"{block}.{self.experts}.down_proj": ("stack", down),
        }
        if old != block:
            out[f"{block}.{self.router}.weight"] = ("same", [f"{old}.{self.router}.weight"])
        return out

    def to_legacy(self, block: str, tensors: dict) -> dict:
        """`tensors` (a block's state, full names) with the fused experts of the MoE block at `block` split into the
        per-expert tensors `legacy_tensors` names (what transformers writes, and llama.cpp's converter reads)."""
        fused = f"{block}.{self.experts}.down_proj"
        if self.legacy_block is None or fused not in tensors:
            return tensors
        out = dict(tensors)
        for name, (how, parts) in self.legacy_tensors(block, tensors[fused].shape[0]).items():
            t = out.pop(name)
            if how == "same":
                out[parts[0]] = t
                continue
            pieces = [p for j in range(t.shape[0]) for p in (t[j].chunk(2) if how == "gate_up" else (t[j],))]
            out.update({p: x.contiguous() for p, x in zip(parts, pieces)})
        return out

    def normalizes(self, config) -> bool:
        """Whether the top-k weights are renormalised to sum to 1 (for `"softmax_topk"`)."""
        return bool(getattr(config, self.norm_key, False)) if self.norm_key else self.always_norm

    def geometry(self, experts) -> tuple[int, int]:
        """`(num_experts, expert width)` of an experts module, read from its `down_proj`."""
        E, a, b = experts.down_proj.shape
        return E, (a if self.transposed else b)

    @property
    def gate_up_names(self) -> tuple[str, ...]:
        return ("gate_up_proj", "gate_up_proj_bias") if self.expert_bias else ("gate_up_proj",)

    @property
    def down_names(self) -> tuple[str, ...]:
        return ("down_proj", "down_proj_bias") if self.expert_bias else ("down_proj",)
