"""Tiny random-weight models of every supported architecture, built from config in memory (no Hub)."""

from __future__ import annotations

import torch
from transformers import (
    DeiTConfig,
    Dinov2Config,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    Qwen2Config,
    Qwen3Config,
    ViTConfig,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING,
    MODEL_MAPPING,
)

VOCAB = 128


def tiny_config(arch: str):
    common = {"vocab_size": VOCAB, "num_hidden_layers": 3}
    if arch == "llama":  # MHA
        return LlamaConfig(
            hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4, **common
        )
    if arch == "llama_gqa":  # SmolLM2 / Llama-3 shape: groups of 3 query heads
        return LlamaConfig(
            hidden_size=72,
            intermediate_size=96,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=12,
            tie_word_embeddings=True,
            **common,
        )
    if arch == "mistral":
        return MistralConfig(
            hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, **common
        )
    if arch == "qwen2":
        return Qwen2Config(
            hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, **common
        )
    if arch == "qwen3":
        return Qwen3Config(
            hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16, **common
        )
    if arch == "gemma3":  # one KV head; sliding-window and full layers alternate
        return Gemma3TextConfig(
            hidden_size=64,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            **common,
        )
    if arch == "opt":
        return OPTConfig(
            hidden_size=64,
            ffn_dim=96,
            num_attention_heads=4,
            word_embed_proj_dim=64,
            max_position_embeddings=64,
            vocab_size=VOCAB,
            num_hidden_layers=3,
        )
    if arch == "gpt2":
        return GPT2Config(n_embd=64, n_inner=96, n_head=4, n_positions=64, n_layer=3, vocab_size=VOCAB)
    vision = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3, "image_size": IMAGE_SIZE,
              "patch_size": 4, "num_labels": 5}  # fmt: skip
    if arch in ("vit", "vit_backbone"):  # 16 patches + CLS
        return ViTConfig(intermediate_size=96, **vision)
    if arch == "deit":  # ViT's layout, plus a distillation token
        return DeiTConfig(intermediate_size=96, **vision)
    if arch in ("dinov2", "dinov2_backbone"):  # MLP width hidden * mlp_ratio = 128; layer scale
        return Dinov2Config(mlp_ratio=2, layerscale_value=0.5, **vision)
    if arch == "dinov2_swiglu":  # gate/up/down MLP of width 88
        return Dinov2Config(mlp_ratio=2, use_swiglu_ffn=True, **vision)
    raise ValueError(arch)


ARCHS = ["llama", "llama_gqa", "mistral", "qwen2", "qwen3", "gemma3", "opt", "gpt2"]
# Encoder-only image classifiers (pixel-value calibration); `*_backbone` are the headless base models.
VISION_ARCHS = ["vit", "dinov2"]  # (the SwiGLU Dinov2 and the backbones are tested in tests/test_vision.py)
IMAGE_SIZE = 16


def is_vision(arch: str) -> bool:
    return arch.startswith(("vit", "deit", "dinov2"))


def tiny_model(arch: str, seed: int = 0, **overrides):
    """A tiny random model of `arch`; `overrides` set config attributes (e.g. `vocab_size`) before it is built."""
    torch.manual_seed(seed)
    config = tiny_config(arch)
    for k, v in overrides.items():
        setattr(config, k, v)
    config._attn_implementation = "eager"
    if arch.endswith("_backbone"):
        mapping = MODEL_MAPPING
    else:
        mapping = MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING if is_vision(arch) else MODEL_FOR_CAUSAL_LM_MAPPING
    model_cls = mapping[type(config)]
    model_cls = model_cls[0] if isinstance(model_cls, tuple) else model_cls  # DeiT: with / without teacher head
    model = model_cls(config).eval()
    # Random init gives tiny weights; scale them so pruning decisions are not ties, and add bias noise.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0, 0.05)
    return model


def calibration_ids(num_samples: int = 8, seq_len: int = 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (num_samples, seq_len), generator=g)


def calibration_pixels(num_samples: int = 8, seed: int = 0, size: int = IMAGE_SIZE) -> torch.Tensor:
    """Random pixel values `(num_samples, 3, size, size)`, as an image processor's normalised output."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_samples, 3, size, size, generator=g)


def calibration_for(arch: str, num_samples: int = 8, seed: int = 0, labelled: bool = False):
    """Calibration inputs of a tiny model: token ids, or pixel values for the vision architectures (`labelled`: as
    `{"pixel_values", "labels"}` examples of the 5 tiny classes, what a search on an image classifier trains on)."""
    if not is_vision(arch):
        return calibration_ids(num_samples, 16, seed)
    px = calibration_pixels(num_samples, seed)
    return [{"pixel_values": p, "labels": i % 5} for i, p in enumerate(px)] if labelled else px


def model_inputs(arch: str, n: int = 2, seq_len: int = 16, seed: int = 0) -> dict:
    """Forward keyword arguments of a tiny model: token ids (no cache), or pixel values."""
    if is_vision(arch):
        return {"pixel_values": calibration_pixels(n, seed)}
    return {"input_ids": calibration_ids(n, seq_len, seed), "use_cache": False}


@torch.no_grad()
def logits(model, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Output logits (an image backbone: its last hidden state) on fixed inputs (or `ids`: token ids / pixels)."""
    if getattr(model, "main_input_name", "input_ids") == "pixel_values":
        out = model(pixel_values=calibration_pixels(2, seed=123) if ids is None else ids)
        return (out.logits if hasattr(out, "logits") else out.last_hidden_state).float()
    ids = calibration_ids(2, 12, seed=123) if ids is None else ids
    return model(input_ids=ids, use_cache=False).logits.float()


@torch.no_grad()
def assert_cached_decoding_matches(model, prompt_len: int = 6, new_tokens: int = 4, atol: float = 1e-4) -> None:
    """Decoding with the key/value cache gives the logits of a full forward at every step, and `generate` (greedy)
    picks the tokens a full forward ranks first: a pruned attention whose cache is not filled attends to the new
    token only, which prefill alone never shows."""
    model.eval()
    ids = calibration_ids(2, prompt_len + new_tokens, seed=321)
    full = model(input_ids=ids, use_cache=False).logits.float()
    out = model(input_ids=ids[:, :prompt_len], use_cache=True)
    torch.testing.assert_close(out.logits.float(), full[:, :prompt_len], rtol=0, atol=atol)
    cache = out.past_key_values
    for t in range(prompt_len, ids.shape[1]):
        out = model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        torch.testing.assert_close(out.logits[:, -1].float(), full[:, t], rtol=0, atol=atol, msg=f"cached step {t}")
    generated = model.generate(ids[:1, :prompt_len], max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    for t in range(prompt_len, generated.shape[1]):
        step = model(input_ids=generated[:, :t], use_cache=False).logits[0, -1]
        assert int(step.argmax()) == int(generated[0, t]), f"generate() token {t} is not the full forward's argmax"


# The demo's settings, small: `run_demo` with these (the `smollm2_small_demo` fixture) is what the quickstart,
# shortened the same way, and the command line are checked against (the full settings take minutes; the committed
# run holds their figures).
SMALL_DEMO = {"ratio": 0.2, "num_samples": 4, "seq_len": 64, "eval_seq_len": 128, "eval_tokens": 1024}
