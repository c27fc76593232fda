"""Tiny random mixture-of-experts models of the four supported architectures (built in memory, float64 for exact
comparisons)."""

import contextlib
import sys

import torch
import transformers

from optimum_prune.modeling.architectures import get_layers, get_spec, layer_view

MOE_TYPES = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss")

_COMMON = {
    "vocab_size": 256,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "num_experts_per_tok": 2,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
_EXTRA = {
    "qwen3_moe": {
        "moe_intermediate_size": 24,
        "intermediate_size": 48,
        "num_experts": 6,
        "head_dim": 8,
        "norm_topk_prob": True,
    },
    "mixtral": {"intermediate_size": 24, "num_local_experts": 6},
    "olmoe": {"intermediate_size": 24, "num_experts": 6, "norm_topk_prob": False},
    "gpt_oss": {
        "intermediate_size": 24,
        "num_local_experts": 6,
        "head_dim": 8,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
}


def tiny_moe_config(model_type: str, **overrides):
    return transformers.CONFIG_MAPPING[model_type](**{**_COMMON, **_EXTRA[model_type], **overrides})


def tiny_moe(model_type: str, dtype=torch.float64, seed: int = 0, **overrides):
    """A 2-layer random MoE causal LM in eval mode (router and expert weights drawn so that routing varies)."""
    config = tiny_moe_config(model_type, **overrides)
    torch.manual_seed(seed)
    # grouped_mm (the default experts kernel) has no float64 CPU kernel: float64 runs the eager loop
    impl = "eager" if dtype == torch.float64 else None
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation=impl).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "router" in name or name.endswith("gate.weight") or "experts" in name:
                p.normal_(0, 0.3)
    return model


@contextlib.contextmanager
def masked_router(model, masked: dict[int, list[int]]):
    """Route as if experts `masked[layer]` did not exist: their router logits become -inf before the routing function,
    which runs unchanged (the modeling module's `F.linear` is wrapped for the routers' weights only)."""
    module = sys.modules[type(model).__module__]
    spec = get_spec(model)
    layers = get_layers(model, spec)
    drop = {id(layer_view(layers[i], i, spec, model.config).router.weight): list(e) for i, e in masked.items()}
    real = module.F

    class _Functional:
        def __getattr__(self, name):
            return getattr(real, name)

        def linear(self, x, weight, bias=None):
            out = real.linear(x, weight, bias)
            experts = drop.get(id(weight))
            if experts:
                out = out.clone()
                out[..., experts] = float("-inf")
            return out

    module.F = _Functional()
    try:
        yield
    finally:
        module.F = real


# The contract rows of the expert method (tests/test_common.py checks every registered method has rows somewhere)
MOE_CASES = [
    {"expert_ratio": 0.34},
    {"expert_ratio": 0.34, "channel_ratio": 0.25, "round_to": 8},  # 24 channels -> 16
    {
        "expert_ratio": 0.5,
        "channel_ratio": 0.25,
        "round_to": 4,
        "allocation": "global",
        "channel_scores": "fluctuation",
    },
    {"expert_ratio": 0.34, "criterion": "random"},
    {"channel_ratio": 0.5, "gate": "router", "weighted_refit": False},  # 24 channels -> 12 (round_to 32: not rounded)
]


def moe_ids(num_samples: int = 8, seq_len: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (num_samples, seq_len), generator=torch.Generator().manual_seed(seed))
