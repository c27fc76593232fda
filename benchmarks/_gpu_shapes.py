"""Model shapes for the GPU benchmarks: published model sizes, per-layer pruned shapes from a real allocation, the
configs that build them with random weights, and the exact work each does (the ideal speedups).

Latency depends on the shapes only, so a GPU run needs no model file: `SHAPES` holds the published sizes (hidden
width, MLP width, layers, heads, KV heads, head dimension, vocabulary), `ALLOCATIONS` turns a pruning ratio into one
`LayerShape` per layer, and `build_config` writes the config a `transformers` model is built from (per-layer shapes
through the library's registered pruned types, exactly as a saved pruned checkpoint holds them).

Allocations:

- `"np"`: Numerical Pruning's per-layer pattern, taken from a real run of the library's default on SmolLM2-135M
  (`np_grid_smollm2_protocol.json`, test split): each layer of the big model takes the kept fractions (KV groups,
  MLP channels) of the SmolLM2 layer at the same depth; the MLP fractions are scaled together so that the removed
  share of the attention + MLP parameters equals the ratio; widths are rounded to `round_to` as the library does.
- `"uniform"`: `allocation="uniform"`: every layer loses the same share of KV groups and MLP channels.

A new allocation (e.g. a servable per-layer format) is one more entry of `ALLOCATIONS`: a function
`(shape, ratio, round_to) -> list[LayerShape]`; `pattern_layers` maps any results file whose runs record per-layer
`shapes` (`{"<layer>": [query heads, MLP channels]}` or a dict of `num_attention_heads` / `num_key_value_heads` /
`intermediate_size`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
GRID = RESULTS_DIR / "np_grid_smollm2_protocol.json"
BIASES = ["self_attn.o_proj", "mlp.down_proj"]  # NP's / FLAP's compensation biases, as `pruned_layers` records them


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only model that set its latency (`model_type`: a `transformers` type)."""

    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tie_embeddings: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over each query / key head (head_dim weights each)

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.heads // self.kv_heads


# Published sizes (config.json of each model on the Hub); "tiny" is the CPU smoke test's.
SHAPES = {
    "smollm2-135m": ModelShape("llama", 576, 1536, 30, 9, 3, 64, 49152, tie_embeddings=True),
    "llama-3.2-1b": ModelShape("llama", 2048, 8192, 16, 32, 8, 64, 128256, tie_embeddings=True),
    "llama-3.1-8b": ModelShape("llama", 4096, 14336, 32, 32, 8, 128, 128256),
    "qwen3-8b": ModelShape("qwen3", 4096, 12288, 36, 32, 8, 128, 151936, qk_norm=True),
    "tiny": ModelShape("llama", 64, 256, 4, 4, 2, 16, 512),
}


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer: query heads, KV heads, MLP channels, and whether o_proj / down_proj carry a bias."""

    heads: int
    kv_heads: int
    intermediate: int
    biases: bool = False

    def as_config(self) -> dict[str, Any]:
        """The layer's entry of a pruned config's `pruned_layers`."""
        return {
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "intermediate_size": self.intermediate,
            "biases": list(BIASES) if self.biases else [],
        }


def dense_layers(shape: ModelShape) -> list[LayerShape]:
    return [LayerShape(shape.heads, shape.kv_heads, shape.intermediate)] * shape.layers


def round_width(kept: float, multiple: int, total: int) -> int:
    """MLP channels kept after rounding to `multiple`, as the library's `round_to` does: the nearest multiple, at
    least one multiple, at most the full width (a layer no wider than `multiple` keeps its allocation)."""
    if multiple <= 1 or total <= multiple:
        return max(1, min(total, round(kept)))
    return min(total, max(multiple, round(kept / multiple) * multiple))


# ---------------------------------------------------------------------------------------------------------- exact work
def layer_params(shape: ModelShape, layer: LayerShape) -> int:
    """Parameters of one decoder layer (projections, biases, norms)."""
    h, d = shape.hidden, shape.head_dim
    attn = h * layer.heads * d * 2 + h * layer.kv_heads * d * 2  # q, o; k, v
    mlp = 3 * h * layer.intermediate
    norms = 2 * h + (2 * d if shape.qk_norm else 0)
    return attn + mlp + norms + (2 * h if layer.biases else 0)


def model_params(shape: ModelShape, layers: list[LayerShape]) -> int:
    """Every parameter of the model (tied embeddings counted once)."""
    embed = shape.vocab * shape.hidden * (1 if shape.tie_embeddings else 2)
    return sum(layer_params(shape, lay) for lay in layers) + embed + shape.hidden


def attention_mlp_params(shape: ModelShape, layers: list[LayerShape]) -> int:
    """The parameters a pruning ratio refers to: the attention and MLP projections (with their biases)."""
    h, d = shape.hidden, shape.head_dim
    return sum(
        2 * h * d * (lay.heads + lay.kv_heads) + 3 * h * lay.intermediate + 2 * h * lay.biases for lay in layers
    )


def prefill_flop_parts(shape: ModelShape, layers: list[LayerShape], batch: int, tokens: int, causal: bool = True):
    """`{projections, attention, lm_head}` FLOPs (2 per multiply-add) of one forward over `batch` x `tokens` new
    tokens that computes the logits of the last token only: the attention products are QKᵀ and AV (`causal`: only
    the token pairs the causal mask keeps, as flash kernels skip the rest)."""
    n, d = batch * tokens, shape.head_dim
    pairs = tokens * (tokens + 1) // 2 if causal else tokens * tokens
    proj = sum(
        shape.hidden * d * 2 * (lay.heads + lay.kv_heads) + 3 * shape.hidden * lay.intermediate for lay in layers
    )
    return {
        "projections": 2 * n * proj,
        "attention": sum(2 * 2 * batch * lay.heads * d * pairs for lay in layers),
        "lm_head": 2 * batch * shape.hidden * shape.vocab,
    }


def prefill_flops(shape: ModelShape, layers: list[LayerShape], batch: int, tokens: int, causal: bool = True) -> int:
    """Total FLOPs of `prefill_flop_parts`."""
    return sum(prefill_flop_parts(shape, layers, batch, tokens, causal).values())


def decode_bytes(shape: ModelShape, layers: list[LayerShape], batch: int, cache_len: int, dtype_bytes: int = 2) -> int:
    """Bytes one decoding step must read or write at least: every weight once (the embedding table: only the `batch`
    rows looked up, unless it is also the LM head), the whole static KV cache (`cache_len` positions: the kernels
    read all of it under the mask) and the new keys / values."""
    weights = model_params(shape, layers) - (0 if shape.tie_embeddings else shape.vocab * shape.hidden)
    embed_rows = 0 if shape.tie_embeddings else batch * shape.hidden
    kv = sum(2 * batch * lay.kv_heads * shape.head_dim * (cache_len + 1) for lay in layers)
    return (weights + embed_rows + kv) * dtype_bytes


def decode_flops(shape: ModelShape, layers: list[LayerShape], batch: int, cache_len: int) -> int:
    """FLOPs of one decoding step of `batch` sequences against `cache_len` cached positions (the full static cache)."""
    d = shape.head_dim
    proj = sum(
        shape.hidden * d * 2 * (lay.heads + lay.kv_heads) + 3 * shape.hidden * lay.intermediate for lay in layers
    )
    attn = sum(2 * 2 * lay.heads * d * cache_len for lay in layers)
    return batch * (2 * proj + attn + 2 * shape.hidden * shape.vocab)


# ---------------------------------------------------------------------------------------------------------- allocations
@lru_cache(maxsize=8)
def _grid(path: str) -> dict[str, Any]:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def np_default_variant(ratio: float) -> str:
    """The grid variant that is Numerical Pruning's per-layer (`allocation="global"`) default at `ratio` (FLAP's metric
    with a half-strength bias refit below the library's per-layer light ratio, NP's own scores from it)."""
    from optimum_prune.methods.numerical.config import LIGHT_RATIOS

    return "np_fluct_bias_s0.5" if ratio < LIGHT_RATIOS["global"] else "np_unit"


def grid_pattern(path: Path | str, variant: str, ratio: float, source: ModelShape) -> tuple[list[tuple], bool]:
    """`([(kept share of KV groups, kept share of MLP channels)] per source layer, biases)` of the run `variant` at
    `ratio` in an allocation results file (`source`: the model it was pruned from)."""
    runs = [r for r in _grid(str(path))["runs"] if r["variant"] == variant and math.isclose(r["ratio"], ratio)]
    if not runs:
        raise KeyError(f"{Path(path).name} has no {variant!r} run at ratio {ratio}")
    run = runs[0]
    pattern = []
    for i in range(len(run["shapes"])):
        entry = run["shapes"][str(i)]
        if isinstance(entry, dict):
            kv = entry.get("num_key_value_heads", entry["num_attention_heads"] // source.group)
            mlp = entry["intermediate_size"]
        else:
            kv, mlp = entry[0] // source.group, entry[1]
        pattern.append((kv / source.kv_heads, mlp / source.intermediate))
    cfg = run.get("config", {})
    return pattern, bool(cfg.get("compensation_bias") or cfg.get("bias_compensation"))


def pattern_layers(
    shape: ModelShape, pattern: list[tuple], ratio: float, round_to: int, biases: bool = False
) -> list[LayerShape]:
    """The big model's layers from a per-layer pattern of kept shares (see the module docstring)."""
    n = len(pattern)
    src = [pattern[min(n - 1, (2 * j + 1) * n // (2 * shape.layers))] for j in range(shape.layers)]
    kv = [min(shape.kv_heads, max(1, round(a * shape.kv_heads))) for a, _ in src]
    h, d, inter = shape.hidden, shape.head_dim, shape.intermediate
    attn_kept = sum(2 * h * d * k * (shape.group + 1) for k in kv)
    target_kept = (1 - ratio) * attention_mlp_params(shape, dense_layers(shape))

    def mlp_kept(scale: float) -> float:
        return sum(3 * h * min(inter, scale * m * inter) for _, m in src)

    lo, hi = 0.0, 1.0 / max(min(m for _, m in src), 1e-9)
    for _ in range(100):  # the MLP scale whose kept parameters meet the target (monotone in the scale)
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if attn_kept + mlp_kept(mid) < target_kept else (lo, mid)
    widths = [round_width(min(inter, hi * m * inter), round_to, inter) for _, m in src]
    return [LayerShape(k * shape.group, k, w, biases) for k, w in zip(kv, widths)]


def _np_pattern(ratio: float, grid: Path | str) -> tuple[list[tuple], bool]:
    """Numerical Pruning's default per-layer pattern at `ratio` on SmolLM2-135M (NP's own scores where the grid has
    no run of the default's variant at that ratio)."""
    source = SHAPES["smollm2-135m"]
    try:
        return grid_pattern(grid, np_default_variant(ratio), ratio, source)
    except KeyError:
        return grid_pattern(grid, "np_unit", ratio, source)


def np_layers(shape: ModelShape, ratio: float, round_to: int, grid: Path | str = GRID) -> list[LayerShape]:
    """Numerical Pruning's default allocation at `ratio` on SmolLM2-135M, mapped onto `shape`."""
    pattern, biases = _np_pattern(ratio, grid)
    return pattern_layers(shape, pattern, ratio, round_to, biases)


SERVABLE_MULTIPLE = 256  # the MLP width multiple every DeciLM reader accepts (`ffn_mult` round-trips it)


def servable_layers(shape: ModelShape, ratio: float, round_to: int, grid: Path | str = GRID) -> list[LayerShape]:
    """`allocation="servable"` (the DeciLM `block_configs` format that vLLM, SGLang, TensorRT-LLM and MLX load): every
    attention head kept, the whole ratio taken from the MLP, per-layer widths in multiples of 256 following NP's
    per-layer MLP pattern, no bias."""
    pattern, _ = _np_pattern(ratio, grid)
    return pattern_layers(shape, [(1.0, m) for _, m in pattern], ratio, max(round_to, SERVABLE_MULTIPLE))


def uniform_layers(shape: ModelShape, ratio: float, round_to: int) -> list[LayerShape]:
    """`allocation="uniform"`: every layer loses round(ratio x units) KV groups and MLP channels."""
    kv = max(1, shape.kv_heads - round(ratio * shape.kv_heads))
    width = round_width(shape.intermediate - round(ratio * shape.intermediate), round_to, shape.intermediate)
    return [LayerShape(kv * shape.group, kv, width)] * shape.layers


@dataclass(frozen=True)
class Allocation:
    label: str
    layers: Callable[[ModelShape, float, int], list[LayerShape]] = field(repr=False)


ALLOCATIONS = {
    "np": Allocation("NP", np_layers),
    "uniform": Allocation("uniform", uniform_layers),
    "servable": Allocation("servable", servable_layers),
}


# ---------------------------------------------------------------------------------------------------------- configs
def build_config(shape: ModelShape, layers: list[LayerShape] | None = None) -> Any:
    """The `transformers` config of `shape` (dense), or of a pruned model with one entry of `layers` per layer."""
    from transformers import AutoConfig

    from optimum_prune.modeling.auto_classes import pruned_classes

    base = AutoConfig.for_model(
        shape.model_type, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, vocab_size=shape.vocab, tie_word_embeddings=shape.tie_embeddings,
        max_position_embeddings=8192,
    )  # fmt: skip
    if layers is None:
        return base
    return pruned_classes(shape.model_type)[0](**base.to_dict(), pruned_layers=[lay.as_config() for lay in layers])


def build_model(shape: ModelShape, layers: list[LayerShape] | None, dtype, device: str):
    """A random-weight model of `shape` built directly on `device` in `dtype` (see `build_config`)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = build_config(shape, layers)
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def describe(shape: ModelShape, layers: list[LayerShape]) -> dict[str, Any]:
    """What a results file records of a model's shapes."""
    dense = dense_layers(shape)
    return {
        "layers": [[lay.heads, lay.kv_heads, lay.intermediate, int(lay.biases)] for lay in layers],
        "params": model_params(shape, layers),
        "removed": 1 - attention_mlp_params(shape, layers) / attention_mlp_params(shape, dense),
    }
