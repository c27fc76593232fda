"""The GPU benchmarks' CPU-checkable parts: the exact work behind each ideal speedup (against real models and
PyTorch's FLOP counter), the per-layer shapes mapped from a real allocation, and that every timed call can be captured
in a CUDA graph (it never reads a device value on the host: run on the meta device, where any such read raises)."""

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import _gpu_shapes as gs  # noqa: E402
from _gpu_timing import Runner, Scenario  # noqa: E402

from optimum_prune import MagnitudeConfig, prune_  # noqa: E402
from optimum_prune.functional.allocation import round_kept_channels  # noqa: E402
from optimum_prune.modeling.architectures import get_layers, get_spec, layer_view  # noqa: E402
from optimum_prune.modeling.shapes import attention_mlp_params  # noqa: E402

TINY_QWEN3 = gs.ModelShape("qwen3", 48, 80, 3, 6, 2, 8, 96, qk_norm=True)
TINY_TIED = gs.ModelShape("llama", 48, 80, 3, 6, 3, 8, 96, tie_embeddings=True)
PRUNED = [gs.LayerShape(6, 2, 80), gs.LayerShape(3, 1, 40, True), gs.LayerShape(3, 1, 16)]  # of TINY_QWEN3
PRUNED_TIED = [gs.LayerShape(6, 3, 80), gs.LayerShape(2, 1, 40, True), gs.LayerShape(4, 2, 16)]


def _model(shape, layers, device="cpu", dtype=torch.float32, attn="sdpa"):
    model = gs.build_model(shape, layers, dtype, device)
    model.config._attn_implementation = attn
    return model


@pytest.mark.parametrize("shape", [TINY_QWEN3, TINY_TIED], ids=["qwen3", "llama_tied"])
@pytest.mark.parametrize("pruned", [False, True], ids=["dense", "per_layer"])
def test_parameter_counts_match_the_built_model(shape, pruned):
    layers = (PRUNED if shape is TINY_QWEN3 else PRUNED_TIED) if pruned else gs.dense_layers(shape)
    model = _model(shape, layers if pruned else None)
    assert gs.model_params(shape, layers) == sum(p.numel() for p in model.parameters())
    assert gs.attention_mlp_params(shape, layers) == attention_mlp_params(model, get_spec(model))
    spec = get_spec(model)
    built = [layer_view(lay, i, spec, model.config) for i, lay in enumerate(get_layers(model, spec))]
    assert [(v.num_heads, v.intermediate_size) for v in built] == [(lay.heads, lay.intermediate) for lay in layers]


def test_prefill_flops_match_pytorchs_flop_counter():
    """Projections + attention products + the last token's LM head: every matmul of an eager-attention forward."""
    shape, batch, tokens = TINY_QWEN3, 2, 12
    model = _model(shape, PRUNED, attn="eager")  # attention as plain matmuls, which the counter sees (all P x P)
    ids = torch.randint(0, shape.vocab, (batch, tokens))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=ids, use_cache=True, logits_to_keep=1)
    rope = counter.get_total_flops() - gs.prefill_flops(shape, PRUNED, batch, tokens, causal=False)
    # some transformers versions compute the rotary angles by a (tiny) matmul, which the counter sees too
    assert 0 <= rope <= 2 * batch * (shape.head_dim // 2) * tokens
    # causal: only the query / key pairs the mask keeps
    kept = int(torch.ones(tokens, tokens).tril().sum())
    masked = sum(2 * 2 * batch * lay.heads * shape.head_dim * (tokens * tokens - kept) for lay in PRUNED)
    full = gs.prefill_flops(shape, PRUNED, batch, tokens, causal=False)
    assert gs.prefill_flops(shape, PRUNED, batch, tokens) == full - masked


@pytest.mark.parametrize("shape", [TINY_QWEN3, TINY_TIED], ids=["untied", "tied"])
def test_decode_bytes_are_the_weights_and_the_static_cache(shape):
    """Every weight read once (one embedding row per sequence unless the table is also the LM head) plus the KV
    cache `transformers` allocates, read whole, and the new position written."""
    layers = PRUNED if shape is TINY_QWEN3 else PRUNED_TIED
    batch, cache_len = 3, 10
    model = _model(shape, layers, dtype=torch.bfloat16)
    runner = Runner(model, Scenario("decode", batch, cache_len - 2, "eager", 2), "cpu")
    cache = runner.cache
    kv = sum(t.numel() * t.element_size() for lay in cache.layers for t in (lay.keys, lay.values))
    params = {p.data_ptr(): p for p in model.parameters()}.values()
    weights = sum(p.numel() * p.element_size() for p in params)
    table = model.get_input_embeddings().weight
    if not shape.tie_embeddings:
        weights += (batch - shape.vocab) * shape.hidden * table.element_size()
    written = sum(2 * batch * lay.kv_heads * shape.head_dim * 2 for lay in layers)
    assert gs.decode_bytes(shape, layers, batch, cache_len) == weights + kv + written


def test_round_width_is_the_librarys_round_to():
    g = torch.Generator().manual_seed(0)
    for total, multiple in [(1536, 64), (14336, 256), (100, 64), (64, 64), (300, 1)]:
        for removed in torch.randint(0, total, (20,), generator=g).tolist():
            scores = torch.rand(total, generator=g)
            drop = round_kept_channels(scores, list(range(removed)), multiple, total - 1)
            assert gs.round_width(total - removed, multiple, total) == total - len(drop), (total, multiple, removed)


def test_uniform_layers_are_what_the_library_prunes():
    shape = gs.ModelShape("llama", 48, 96, 2, 6, 3, 8, 96)
    for ratio, round_to in [(0.2, 1), (0.5, 8), (0.3, 16)]:
        model = _model(shape, None)
        prune_(model, MagnitudeConfig(pruning_ratio=ratio, allocation="uniform", round_to=round_to))
        spec = get_spec(model)
        views = [layer_view(lay, i, spec, model.config) for i, lay in enumerate(get_layers(model, spec))]
        expected = gs.uniform_layers(shape, ratio, round_to)
        assert [(v.num_heads, v.num_kv_heads, v.intermediate_size) for v in views] == [
            (lay.heads, lay.kv_heads, lay.intermediate) for lay in expected
        ], (ratio, round_to)


def test_np_pattern_maps_depths_and_meets_the_ratio():
    shape = gs.SHAPES["llama-3.1-8b"]
    for ratio in (0.2, 0.3, 0.5):
        exact = gs.np_layers(shape, ratio, 1)
        assert len(exact) == shape.layers and all(lay.heads == lay.kv_heads * shape.group for lay in exact)
        assert gs.describe(shape, exact)["removed"] == pytest.approx(ratio, abs=2e-4)
        rounded = gs.np_layers(shape, ratio, 256)
        assert all(lay.intermediate % 256 == 0 for lay in rounded)
        assert gs.describe(shape, rounded)["removed"] == pytest.approx(ratio, abs=0.01)
    assert gs.np_layers(shape, 0.2, 64)[0].biases  # the default below 25% refits a bias; from 25% it does not
    assert not gs.np_layers(shape, 0.5, 64)[0].biases
    # depth: 4 layers from a 2-layer pattern take the first pattern layer, then the second
    small = gs.ModelShape("llama", 64, 100, 4, 4, 4, 16, 10)
    layers = gs.pattern_layers(small, [(1.0, 1.0), (0.5, 0.25)], 0.3, 1)
    assert [lay.kv_heads for lay in layers] == [4, 4, 2, 2]
    assert layers[0].intermediate > layers[2].intermediate


def test_servable_layers_keep_attention_and_take_the_ratio_from_the_mlp_in_blocks_of_256():
    for name in ("llama-3.1-8b", "llama-3.2-1b"):
        shape = gs.SHAPES[name]
        for ratio in (0.2, 0.3, 0.5):
            layers = gs.servable_layers(shape, ratio, 64)
            assert all((lay.heads, lay.kv_heads) == (shape.heads, shape.kv_heads) for lay in layers)
            assert all(lay.intermediate % 256 == 0 and not lay.biases for lay in layers)
            assert gs.describe(shape, layers)["removed"] == pytest.approx(ratio, abs=0.01), (name, ratio)
            assert len({lay.intermediate for lay in layers}) > 1  # per-layer widths, not a uniform cut


@pytest.mark.parametrize(
    "scenario", [Scenario("prefill", 2, 8, "eager"), Scenario("decode", 2, 8, "eager", 2)], ids=["prefill", "decode"]
)
def test_timed_calls_never_read_a_device_value(scenario):
    """A CUDA graph cannot hold a host read of a device value (a `.item()`, a `bool(tensor)`): on the meta device
    such a read raises, so the timed calls running there is the capture's precondition, on a per-layer model."""
    model = _model(TINY_QWEN3, PRUNED, device="meta")
    runner = Runner(model, scenario, "meta")
    runner.time_ms()
    runner.close()
    # the check can fail: transformers' uncached forward inspects its positions on the host
    with pytest.raises(RuntimeError, match="meta"), torch.inference_mode():
        model(input_ids=runner.ids, use_cache=False)


def test_decode_runner_replays_the_same_positions():
    """Every timed round starts from the same cache position, so a round never writes past the static cache."""
    model = _model(TINY_TIED, None)
    runner = Runner(model, Scenario("decode", 2, 5, "eager", 3), "cpu")
    for _ in range(3):
        runner.time_ms()
    lengths = {int(lay.cumulative_length) for lay in runner.cache.layers}
    assert lengths == {5 + 3}
    assert runner.cache.layers[0].keys.shape[2] == 5 + 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_graph_replays_compute_the_eager_logits(dtype):
    """The benchmark's preflight, on a per-layer model: prefill and decode replayed from CUDA graphs give the eager
    logits."""
    import structured_gpu

    args = structured_gpu.parse_args(["--dtype", str(dtype).removeprefix("torch.")])
    result = structured_gpu.preflight(args)
    assert result["ok"], result


def test_projection_paths_say_why_one_cannot_run():
    """Each 2:4 path of the one-projection timings is built and called on its own: one that cannot run here (on a
    CPU: all of them) is an error text, and the others still run."""
    import _semi_structured_layers as layers

    assert layers.projections("llama-3.1-8b") == {"q_proj": (4096, 4096), "gate_proj": (14336, 4096),
                                                  "down_proj": (4096, 14336)}  # fmt: skip
    calls = layers._calls(torch.randn(32, 64), torch.randn(16, 64))
    assert set(calls) == set(layers.VARIANTS)
    fn, alg = calls["dense"]
    assert fn().shape == (16, 32) and alg is None
    for v in layers.VARIANTS[1:]:  # the device, not a bug of the script
        assert isinstance(calls[v], str) and ("CPU" in calls[v] or "CUDA" in calls[v]), calls[v]


def test_semi_structured_masks_every_projection_to_2_4():
    import semi_structured

    from optimum_prune.modeling.semi_structured import find_non_24_layers

    model = _model(TINY_QWEN3, PRUNED)
    assert find_non_24_layers(model)  # dense weights are not 2:4
    semi_structured._mask_24_(model)
    assert find_non_24_layers(model) == []
    spec = get_spec(model)
    w = get_layers(model, spec)[1].get_submodule(spec.linear_paths[0]).weight
    assert (w == 0).float().mean().item() == 0.5
