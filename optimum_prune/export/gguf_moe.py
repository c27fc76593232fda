"""GGUF export of mixture-of-experts models to llama.cpp's own MoE architectures: Qwen3-MoE → `qwen3moe`, OLMoE →
`olmoe`, Mixtral → `llama` with experts. Every MoE layer must keep the same number of experts (llama.cpp has one
expert count per model) of one width; the router's top-k renormalisation must be the one llama.cpp's graph hard-codes
(`qwen3moe` and `llama` renormalise, `olmoe` does not)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gguf
import torch
from torch import nn

from ..modeling.architectures import ArchitectureSpec, layer_view

__all__ = ["MOE_ARCH", "moe_arch", "write_moe_hparams", "moe_tensors", "is_moe_tensor"]

# base model type -> llama.cpp architecture, and whether that graph renormalises the top-k weights
MOE_ARCH = {"qwen3_moe": ("qwen3moe", True), "olmoe": ("olmoe", False), "mixtral": ("llama", True)}


def moe_arch(model: nn.Module, spec: ArchitectureSpec, base: str, layers: list[dict], error: type) -> str:
    """The llama.cpp architecture of an MoE model; raises `error` (before anything is written) where llama.cpp
    cannot run it exactly."""
    if base not in MOE_ARCH:
        raise error(
            f"GGUF export of {base} mixture-of-experts models is not supported (llama.cpp's converter handles it from "
            "a saved checkpoint: save_pretrained, then convert_hf_to_gguf.py)."
        )
    arch, norm = MOE_ARCH[base]
    moe_rows = [r for r in layers if "num_experts" in r]
    if len(moe_rows) != len(layers):
        raise error(f"llama.cpp's {arch} graph has experts in every layer; this model mixes dense-MLP layers in.")
    counts = sorted({(r["num_experts"], r["intermediate_size"]) for r in moe_rows})
    if len(counts) > 1:
        raise error(
            f"llama.cpp takes one expert count and width for the whole model; the layers have {counts}. Prune with "
            "ExpertConfig(allocation='uniform')."
        )
    if spec.moe.normalizes(model.config) != norm:
        raise error(
            f"llama.cpp's {arch} graph {'renormalises' if norm else 'does not renormalise'} the top-k routing weights "
            f"and this model does{'' if not norm else ' not'} (norm_topk_prob): its logits would differ."
        )
    if arch == "olmoe" and any(r["num_key_value_heads"] != r["num_attention_heads"] for r in layers):
        raise error("llama.cpp's olmoe graph has one key head per query head (its k norm spans the hidden size).")
    if getattr(model.config, "clip_qkv", None):
        raise error(f"llama.cpp's {arch} graph does not clip q/k/v (clip_qkv={model.config.clip_qkv}).")
    if moe_rows[0]["num_experts"] < model.config.num_experts_per_tok:
        raise error("fewer experts than num_experts_per_tok")
    return arch


def write_moe_hparams(writer: gguf.GGUFWriter, model: nn.Module, layers: list[dict]) -> None:
    writer.add_expert_count(layers[0]["num_experts"])
    writer.add_expert_used_count(model.config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(layers[0]["intermediate_size"])


def moe_tensors(layer: nn.Module, i: int, spec: ArchitectureSpec, config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """`(GGUF name, tensor)` of block `i`'s router and experts: `ffn_gate_inp (E, H)`, `ffn_gate_exps` /
    `ffn_up_exps (E, I, H)`, `ffn_down_exps (E, H, I)` (llama.cpp's ne are these shapes reversed)."""
    view = layer_view(layer, i, spec, config)
    gate_up, down = view.experts.gate_up_proj.detach(), view.experts.down_proj.detach()
    if spec.moe.transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    gate, up = (gate_up[:, 0::2], gate_up[:, 1::2]) if spec.moe.interleaved else gate_up.chunk(2, dim=1)
    name = lambda t: gguf.TENSOR_NAMES[t].format(bid=i) + ".weight"  # noqa: E731
    yield name(gguf.MODEL_TENSOR.FFN_GATE_INP), view.router.weight.detach()
    yield name(gguf.MODEL_TENSOR.FFN_GATE_EXP), gate
    yield name(gguf.MODEL_TENSOR.FFN_UP_EXP), up
    yield name(gguf.MODEL_TENSOR.FFN_DOWN_EXP), down


def is_moe_tensor(spec: ArchitectureSpec, name: str) -> bool:
    """Whether a layer-relative state-dict name belongs to the MoE block's router or experts."""
    moe = spec.moe
    return moe is not None and any(name.startswith(spec.moe_path(p) + ".") for p in (moe.router, moe.experts))
