"""`export_gguf`: write a (pruned) model as a GGUF file that llama.cpp (and Ollama / LM Studio, which embed it) runs.

- Every layer the same shape: the base's own llama.cpp architecture (`llama` for llama / mistral, `qwen2`, `qwen3`,
  `gemma3`), so every GGUF runtime loads it. A uniform qwen2 whose heads were pruned is written as `llama` (llama.cpp's
  `qwen2` graph requires `num_heads * head_dim == hidden_size`); both graphs are the same apart from the rotary layout.
- Per-layer shapes (llama / mistral / qwen2): llama.cpp's `deci` architecture, which reads `head_count`,
  `head_count_kv` and `feed_forward_length` as per-layer arrays.
- Mixture-of-experts models with one expert count: llama.cpp's `qwen3moe`, `olmoe`, or `llama` with experts
  (Mixtral); see `gguf_moe`.
- Architectures with llama.cpp's interleaved rotary layout (`llama`, `deci`) get their Q/K rows reordered the way
  llama.cpp's own converter does (`_permute`).
Every check runs before the file is opened; the file is written under a temporary name and renamed into place.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from ..constants import HISTORY_ATTR
from ..modeling.architectures import base_model_type, get_layers, get_spec, require_causal_lm
from ..modeling.shapes import layer_table
from ..serialization import load_pruned_model
from ..version import __version__
from .gguf_moe import is_moe_tensor, moe_arch, moe_tensors, write_moe_hparams
from .gguf_tokenizer import tokenizer_metadata, write_tokenizer

__all__ = ["GGUFExportError", "OUTTYPES", "export_gguf", "gguf_layout"]

logger = logging.getLogger(__name__)

OUTTYPES = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}
_ARCH = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "deci": gguf.MODEL_ARCH.DECI,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "gemma3": gguf.MODEL_ARCH.GEMMA3,
    "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE,
    "olmoe": gguf.MODEL_ARCH.OLMOE,
}
_GGUF_NAMED = "gguf:"  # `_tensors` yields these with their llama.cpp name already (the experts)
_INTERLEAVED_ROPE = ("llama", "deci")  # llama.cpp's LLAMA_ROPE_TYPE_NORM: HF's rotate_half layout must be permuted
# Biases llama.cpp's graph of each architecture reads (anything else would be silently ignored or fail to load).
_QKV_BIAS = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}
_ALL_BIAS = _QKV_BIAS | {"self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
_BIASES = {"llama": _ALL_BIAS, "deci": _ALL_BIAS, "qwen2": _QKV_BIAS, "qwen3": set(), "gemma3": set(), "qwen3moe": set(),
           "olmoe": set()}  # fmt: skip
_ACTIVATION = {
    "llama": "silu",
    "mistral": "silu",
    "qwen2": "silu",
    "qwen3": "silu",
    "gemma3_text": "gelu_pytorch_tanh",
    "qwen3_moe": "silu",
    "mixtral": "silu",
    "olmoe": "silu",
}


class GGUFExportError(ValueError):
    """The model cannot be written as a GGUF file llama.cpp runs exactly (raised before anything is written)."""


def _rope(config) -> tuple[dict[str, Any], dict[str, Any]]:
    """(full-attention rope parameters, sliding-attention rope parameters) of a transformers >= 5 config."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "full_attention" in params:
        return dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
    if not params:
        params = {"rope_type": "default", "rope_theta": getattr(config, "rope_theta", 10000.0)}
    return params, {}


def gguf_layout(model: nn.Module) -> dict[str, Any]:
    """Which llama.cpp architecture `model` is written as, and its per-layer shapes; raises `GGUFExportError`.

    Returns a dict with `arch` (llama.cpp architecture name), `per_layer` (bool), `permute_qk` (bool) and `layers`
    (the `layer_table` rows).
    """
    spec = get_spec(model)
    config = model.config
    base = base_model_type(config.model_type)
    if base not in _ACTIVATION:
        raise GGUFExportError(
            f"GGUF export supports {', '.join(sorted(_ACTIVATION))} models, not {base!r}. Save the model with "
            "save_pretrained and convert it with llama.cpp's convert_hf_to_gguf.py if llama.cpp supports it."
        )
    layers = layer_table(model, spec)
    pruned_dims = [i for i, row in enumerate(layers) if "qk_head_dim" in row]
    if pruned_dims:
        raise GGUFExportError(
            f"Layers {pruned_dims[:5]}{'...' if len(pruned_dims) > 5 else ''} have pruned q/k or v/o head dimensions "
            "(SPP): llama.cpp's graphs take one key/value width for the whole model, rotate every q/k dimension with "
            "frequencies derived from that width and scale attention by it, so they cannot run these layers exactly. "
            "Keep the model in transformers (save_pretrained), or prune with SPPConfig(prune_attention=False) for a "
            "GGUF export."
        )
    uniform = all(row == layers[0] for row in layers)
    hidden = config.hidden_size
    for i, row in enumerate(layers):
        if row["num_attention_heads"] > 0 and row["intermediate_size"] == 0:
            raise GGUFExportError(
                f"Layer {i} keeps attention but no MLP channel: llama.cpp drops such a layer's attention output. "
                "Prune again with min_mlp_channels_per_layer >= 1 (or prune_mlp=False)."
            )
    if len(layers) > 1 and layers[-1]["num_attention_heads"] == 0 and layers[-1]["intermediate_size"] == 0:
        raise GGUFExportError(
            "The last layer has neither attention nor MLP: llama.cpp (0.3.36's) aborts on such a model. Keep a "
            "sublayer in the last layer (prune it again with that layer in skip_layers)."
        )
    if layers[0]["num_attention_heads"] == 0 and any(row["num_attention_heads"] > 0 for row in layers):
        raise GGUFExportError(
            "Layer 0 has no attention: llama.cpp (0.3.36's) takes the head size from the first layer's head count, "
            "so it cannot load this model. Keep layer 0's attention (prune it again with layer 0 in skip_layers)."
        )
    biases = {b for row in layers for b in row["biases"]}
    if spec.moe is not None:
        arch = moe_arch(model, spec, base, layers, GGUFExportError)
        if not uniform:
            raise GGUFExportError("llama.cpp's MoE graphs take one attention shape for every layer: prune uniformly.")
    elif base in ("qwen3", "gemma3_text"):
        if not uniform:
            raise GGUFExportError(
                f"llama.cpp has no per-layer-shape variant of {base} ({'q/k norms' if base == 'qwen3' else 'gemma3'}"
                "): prune with allocation='uniform' (then every GGUF runtime loads it), or keep the per-layer model "
                "in transformers via save_pretrained."
            )
        arch = "qwen3" if base == "qwen3" else "gemma3"
    elif not uniform:
        arch = "deci"
    elif base == "qwen2" and layers[0]["num_attention_heads"] * layers[0]["head_dim"] == hidden:
        arch = "qwen2" if biases <= _BIASES["qwen2"] else "llama"
    else:
        arch = "llama"
    extra = sorted(biases - _BIASES[arch])
    if extra:
        raise GGUFExportError(
            f"llama.cpp's {arch} graph has no bias for {extra}: prune this model without the bias refit "
            "(NumericalConfig(compensation_bias=False), FLAPConfig(bias_compensation=False); their default, None, "
            "leaves it off on Qwen3 and Gemma-3)."
        )
    act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
    if act != _ACTIVATION[base]:
        raise GGUFExportError(f"{base} with hidden_act={act!r} is not what llama.cpp's {arch} graph computes.")
    if getattr(config, "partial_rotary_factor", 1.0) not in (None, 1.0):
        raise GGUFExportError("Partial rotary embeddings are not supported by the GGUF export.")
    if base == "gemma3_text" and getattr(config, "query_pre_attn_scalar", None) != layers[0]["head_dim"]:
        raise GGUFExportError(
            "llama.cpp's gemma3 graph scales attention by 1/sqrt(head_dim); this model uses query_pre_attn_scalar="
            f"{config.query_pre_attn_scalar}, head_dim={layers[0]['head_dim']}."
        )
    rope, _ = _rope(config)
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("default", "linear", "yarn") and not (rope_type == "llama3" and arch in _INTERLEAVED_ROPE):
        raise GGUFExportError(f"RoPE scaling {rope_type!r} is not supported by the GGUF export of {arch}.")
    return {"arch": arch, "per_layer": not uniform, "permute_qk": arch in _INTERLEAVED_ROPE, "layers": layers}


def _permute(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """HF's rotate_half Q/K rows -> llama.cpp's interleaved pairs (`LlamaModel.permute` of convert_hf_to_gguf.py)."""
    n_head = weight.shape[0] // head_dim
    return weight.reshape(n_head, 2, head_dim // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _llama3_rope_freqs(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """The `rope_freqs` tensor llama.cpp uses for Llama-3 rope scaling (as its converter computes it)."""
    base = rope.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _per_layer(values: list[int], per_layer: bool) -> int | list[int]:
    return list(values) if per_layer else values[0]


def _write_hparams(writer: gguf.GGUFWriter, model: nn.Module, layout: dict[str, Any], outtype: str) -> None:
    config, layers, per_layer = model.config, layout["layers"], layout["per_layer"]
    head_dim = layers[0]["head_dim"]
    writer.add_name(Path(str(getattr(config, "_name_or_path", "") or "model")).name or "model")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(len(layers))
    writer.add_feed_forward_length(_per_layer([r["intermediate_size"] for r in layers], per_layer))
    writer.add_head_count(_per_layer([r["num_attention_heads"] for r in layers], per_layer))
    writer.add_head_count_kv(_per_layer([r["num_key_value_heads"] for r in layers], per_layer))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(model.get_input_embeddings().weight.shape[0])
    rope, rope_swa = _rope(config)
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    if rope.get("rope_type") in ("linear", "yarn"):
        kind = gguf.RopeScalingType.LINEAR if rope["rope_type"] == "linear" else gguf.RopeScalingType.YARN
        writer.add_rope_scaling_type(kind)
        writer.add_rope_scaling_factor(rope["factor"])
        if kind == gguf.RopeScalingType.YARN:
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if layout["arch"] == "gemma3":
        if rope_swa.get("rope_theta") is not None:
            writer.add_rope_freq_base_swa(rope_swa["rope_theta"])
        if getattr(config, "final_logit_softcapping", None):
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
        kinds = list(getattr(config, "layer_types", None) or [])
        if config.sliding_window and "sliding_attention" in kinds:
            writer.add_sliding_window(config.sliding_window)
            writer.add_sliding_window_pattern([k == "sliding_attention" for k in kinds])
    elif getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        if config.sliding_window < config.max_position_embeddings:
            logger.warning(
                "llama.cpp's %s graph attends to the whole context; this model's sliding window (%d tokens) is "
                "not written. Outputs match for sequences up to the window.",
                layout["arch"],
                config.sliding_window,
            )
    if "num_experts" in layers[0]:
        write_moe_hparams(writer, model, layers)
    writer.add_file_type(OUTTYPES[outtype])
    history = getattr(model, HISTORY_ATTR, None) or []
    writer.add_string("optimum_prune.version", __version__)
    writer.add_string("optimum_prune.layout", "per_layer" if per_layer else "uniform")
    if history:
        last = history[-1]
        cfg = last.get("config", {})
        writer.add_string("optimum_prune.method", str(last.get("method")))
        ratio = cfg.get("pruning_ratio", cfg.get("sparsity"))
        if ratio is not None:
            writer.add_float32("optimum_prune.pruning_ratio", float(ratio))
        measured = last.get("report", {}).get("measured")
        if measured is not None:
            writer.add_float32("optimum_prune.measured_ratio", float(measured))
        writer.add_string("optimum_prune.config", json.dumps(cfg, sort_keys=True, default=str))


def _encode(name: str, data: torch.Tensor, outtype: str, unquantized: list[str]) -> tuple[np.ndarray, Any]:
    """The array to write and its GGML type: 1-D tensors stay f32 (as llama.cpp's converter does)."""
    arr = data.detach().to(torch.float32).cpu().numpy()
    if arr.ndim == 1 or outtype == "f32":
        return arr, gguf.GGMLQuantizationType.F32
    if outtype == "f16":
        return arr.astype(np.float16), gguf.GGMLQuantizationType.F16
    qtype = gguf.GGMLQuantizationType.BF16 if outtype == "bf16" else gguf.GGMLQuantizationType.Q8_0
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if arr.shape[-1] % block:
        unquantized.append(f"{name} (rows of {arr.shape[-1]})")
        return arr.astype(np.float16), gguf.GGMLQuantizationType.F16
    return gguf.quants.quantize(arr, qtype), qtype


def _tensors(model: nn.Module, layout: dict[str, Any]):
    """(HF name, tensor) pairs in GGUF order, Q/K rows permuted where the layout needs it."""
    layers = layout["layers"]
    embed = model.get_input_embeddings().weight
    yield "model.embed_tokens.weight", embed
    head = model.get_output_embeddings()
    if head is not None and head.weight.data_ptr() != embed.data_ptr():
        yield "lm_head.weight", head.weight
    yield "model.norm.weight", model.get_submodule("model.norm").weight
    rope, _ = _rope(model.config)
    if rope.get("rope_type") == "llama3":
        yield "rope_freqs.weight", torch.from_numpy(_llama3_rope_freqs(rope, layers[0]["head_dim"]))
    spec = get_spec(model)
    for i, layer in enumerate(get_layers(model, spec)):
        row = layers[i]
        if spec.moe is not None:
            yield from ((_GGUF_NAMED + n, t) for n, t in moe_tensors(layer, i, spec, model.config))
        for name, tensor in layer.state_dict().items():
            if is_moe_tensor(spec, name):
                continue
            if row["num_attention_heads"] == 0 and ("self_attn." in name or name.startswith("input_layernorm")):
                continue
            if row["intermediate_size"] == 0 and ("mlp." in name or name.startswith("post_attention_layernorm")):
                continue
            if layout["permute_qk"] and name.split(".")[1] in ("q_proj", "k_proj"):
                tensor = _permute(tensor, row["head_dim"])
            yield f"model.layers.{i}.{name}", tensor


def _gemma_norm_shift(hf_name: str, arch: str) -> float:
    return 1.0 if arch == "gemma3" and hf_name.endswith("norm.weight") else 0.0


def _load(model: Any, tokenizer: Any) -> tuple[nn.Module, Any]:
    if isinstance(model, (str, os.PathLike)):
        directory = Path(model)
        if not (directory / "config.json").is_file():
            raise FileNotFoundError(f"{directory} is not a model directory (no config.json); pass a loaded model.")
        loaded = load_pruned_model(directory, dtype=torch.float32)
        require_causal_lm(loaded, "GGUF export (llama.cpp)")
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(directory)
        return loaded.eval(), tokenizer
    if tokenizer is None:
        raise GGUFExportError(
            "A GGUF file carries the tokenizer: pass tokenizer=... (the model's Hugging Face tokenizer), or export "
            "a directory written by save_pretrained (it holds the tokenizer)."
        )
    return model, tokenizer


def export_gguf(
    model: nn.Module | str | os.PathLike,
    path: str | os.PathLike,
    outtype: str = "f16",
    *,
    tokenizer: Any = None,
    overwrite: bool = False,
) -> Path:
    """Write `model` as a GGUF file for llama.cpp (per-layer pruned shapes included); returns the file's path.

    Args:
        model (`PreTrainedModel | str | os.PathLike`): a loaded (pruned or dense) model, or a directory written by
            `save_pretrained` (tokenizer included).
        path (`str | os.PathLike`): the `.gguf` file to write; parent directories are created.
        outtype (`str`, defaults to `"f16"`): `"f32"`, `"f16"`, `"bf16"` or `"q8_0"` for the 2-D weights (norms and
            biases stay f32). With `"q8_0"`, a weight whose rows are not a multiple of 32 stays f16 (logged).
        tokenizer (`PreTrainedTokenizerBase`, *optional*): required with a loaded model; a fast byte-level BPE
            tokenizer, written complete (vocabulary, merges, types, special ids, add-BOS, chat template,
            pre-tokenizer) so that llama.cpp tokenizes exactly as transformers does.
        overwrite (`bool`, defaults to `False`): replace an existing file (still atomically).

    Raises:
        `GGUFExportError` (a `ValueError`) for a model or tokenizer llama.cpp cannot run exactly, before anything is
        written; `FileExistsError` when `path` exists and `overwrite` is False.
    """
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {sorted(OUTTYPES)}, got {outtype!r}.")
    target = Path(path).absolute()
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists. Choose another path or pass overwrite=True.")
    if target.is_dir():
        raise IsADirectoryError(f"{target} is a directory; give the path of the .gguf file to write.")
    if isinstance(model, nn.Module):
        require_causal_lm(model, "GGUF export (llama.cpp)")
    model, tokenizer = _load(model, tokenizer)
    layout = gguf_layout(model)
    vocab = tokenizer_metadata(tokenizer, model.get_input_embeddings().weight.shape[0])
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; the file gets the permissions of a normal new file
    try:
        writer = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[_ARCH[layout["arch"]]])
        _write_hparams(writer, model, layout, outtype)
        write_tokenizer(writer, vocab)
        names = gguf.get_tensor_name_map(_ARCH[layout["arch"]], len(layout["layers"]))
        unquantized: list[str] = []
        with torch.no_grad():
            for hf_name, tensor in tqdm(list(_tensors(model, layout)), desc="GGUF export", leave=False):
                name = hf_name.removeprefix(_GGUF_NAMED) if hf_name.startswith(_GGUF_NAMED) else None
                name = name or ("rope_freqs.weight" if hf_name == "rope_freqs.weight" else None)
                name = name or names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
                if name is None:
                    raise GGUFExportError(f"internal error: no llama.cpp name for {hf_name}")
                tensor = tensor.float() + _gemma_norm_shift(hf_name, layout["arch"])
                arr, qtype = _encode(name, tensor, outtype, unquantized)
                writer.add_tensor(name, arr, raw_dtype=qtype)
        if unquantized:
            logger.warning(
                "%d tensors stay f16 because their rows are not a multiple of the %s block: %s",
                len(unquantized),
                outtype,
                ", ".join(unquantized),
            )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    logger.info(
        "Wrote %s (%s, %s, %s)", target, layout["arch"], "per-layer" if layout["per_layer"] else "uniform", outtype
    )
    return target
