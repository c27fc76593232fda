"""Expert surgery on the four MoE architectures: removed experts ≡ a router masking them, removed expert channels ≡
zeroed channels, save → reload (stock class when uniform) → identical logits, cached generation exact."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from experts.tiny import MOE_TYPES, masked_router, tiny_moe
from optimum_prune import AutoPrunedModelForCausalLM
from optimum_prune.modeling.architectures import get_layers, get_spec, layer_view
from optimum_prune.modeling.surgery import apply_layer_plan_, apply_plan_
from optimum_prune.plan import LayerPlan, PruningPlan
from optimum_prune.serialization import save_pruned_model

IDS = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(0))


def _plan(layers: dict[int, dict]) -> PruningPlan:
    return PruningPlan(layers={i: LayerPlan(**kw) for i, kw in layers.items()})


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_removed_experts_equal_masked_router(model_type):
    model = tiny_moe(model_type)
    drop = {0: [1, 4], 1: [0, 5]}
    with masked_router(model, drop):
        ref = _logits(model)
    assert not torch.allclose(ref, _logits(model))  # the masking changes the routing
    keep = {i: [e for e in range(6) if e not in d] for i, d in drop.items()}
    apply_plan_(model, get_spec(model), _plan({i: {"keep_experts": k} for i, k in keep.items()}))
    torch.testing.assert_close(_logits(model), ref, rtol=0, atol=1e-10)
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_removed_expert_channels_equal_zeroed(model_type):
    model = tiny_moe(model_type)
    g = torch.Generator().manual_seed(1)
    keep = [sorted(torch.randperm(24, generator=g)[:16].tolist()) for _ in range(6)]
    zeroed = copy.deepcopy(model)
    spec = get_spec(model)
    for m, mode in ((zeroed, "zero"), (model, "remove")):
        view = layer_view(get_layers(m, spec)[1], 1, spec, m.config)
        apply_layer_plan_(view, LayerPlan(keep_expert_channels=keep), mode=mode)
    assert model.model.layers[1].mlp.experts.down_proj.numel() == 6 * 32 * 16
    torch.testing.assert_close(_logits(model), _logits(zeroed), rtol=0, atol=1e-10)
    assert not torch.allclose(_logits(zeroed), _logits(tiny_moe(model_type)))


def _prune_both(model, per_layer: bool):
    """Experts 2 and 3 (layer 1: only 2 unless uniform) removed, then 8 channels of every kept expert."""
    g = torch.Generator().manual_seed(2)
    layers = {}
    for i in range(2):
        experts = [0, 1, 4, 5] if (i == 0 or not per_layer) else [0, 1, 3, 4, 5]
        channels = [sorted(torch.randperm(24, generator=g)[:16].tolist()) for _ in experts]
        layers[i] = {"keep_experts": experts, "keep_expert_channels": channels}
    apply_plan_(model, get_spec(model), _plan(layers))


@pytest.mark.parametrize("model_type", MOE_TYPES)
@pytest.mark.parametrize("per_layer", [False, True])
def test_save_reload_identical(model_type, per_layer, tmp_path):
    model = tiny_moe(model_type)
    _prune_both(model, per_layer)
    ref = _logits(model)
    save_pruned_model(model, tmp_path / "out")
    config = (tmp_path / "out" / "config.json").read_text()
    assert ("optimum_pruned_" in config) == per_layer
    loader = AutoPrunedModelForCausalLM if per_layer else AutoModelForCausalLM
    kw = {"experts_implementation": "eager"}
    reloaded = loader.from_pretrained(tmp_path / "out", dtype=torch.float64, **kw).eval()
    torch.testing.assert_close(_logits(reloaded), ref, rtol=0, atol=1e-12)
    if not per_layer:
        key = get_spec(model).config_keys["experts"]
        assert getattr(reloaded.config, key) == 4
        assert reloaded.config.num_experts_per_tok == 2


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_cached_generation_exact(model_type):
    model = tiny_moe(model_type)
    drop = {0: [1, 4], 1: [0, 5]}
    with masked_router(model, drop):
        ref = model.generate(IDS[:1], max_new_tokens=8, do_sample=False, use_cache=False)
    keep = {i: [e for e in range(6) if e not in d] for i, d in drop.items()}
    apply_plan_(model, get_spec(model), _plan({i: {"keep_experts": k} for i, k in keep.items()}))
    out = model.generate(IDS[:1], max_new_tokens=8, do_sample=False, use_cache=True)
    assert torch.equal(out, ref)


def test_too_few_experts_for_top_k_is_refused():
    model = tiny_moe("mixtral")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="num_experts_per_tok=2"):
        apply_plan_(model, get_spec(model), _plan({0: {"keep_experts": [3]}}))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
