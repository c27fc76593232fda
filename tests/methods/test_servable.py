"""`allocation="servable"`: the structured methods keep shapes the DeciLM format holds (every head, MLP widths in
multiples of 256, no bias) and the saved model is that format."""

import copy
import dataclasses
import json

import pytest
import torch
from testing_utils import assert_cached_decoding_matches, calibration_ids, logits, tiny_model

from optimum_prune import (
    AutoPrunedModelForCausalLM,
    FLAPConfig,
    NumericalConfig,
    ServingConfig,
    SPPConfig,
    prune_,
    save_pruned_model,
)
from optimum_prune.modeling.architectures import get_layers, layer_view
from optimum_prune.modeling.surgery import apply_layer_plan_
from optimum_prune.prune import _compute_plan


def _wide(arch="llama_gqa", seed=0):
    return tiny_model(arch, seed=seed, intermediate_size=768, num_hidden_layers=4)


@pytest.mark.parametrize(
    "config",
    [
        NumericalConfig(pruning_ratio=0.2, allocation="servable"),  # FLAP's metric: a bias refit unless servable
        FLAPConfig(pruning_ratio=0.3, allocation="servable"),
    ],
    ids=["np-0.2", "flap"],
)
def test_servable_pruning_keeps_deci_shapes_and_saves_the_deci_format(config, tmp_path):
    model = _wide()
    heads = model.config.num_attention_heads
    report = prune_(model, config, calibration_ids())
    assert abs(report.measured - config.pruning_ratio) <= 0.05, report
    assert {r["num_attention_heads"] for r in report.layers} == {heads}
    assert all(r["intermediate_size"] % 256 == 0 and r["intermediate_size"] > 0 for r in report.layers)
    assert not any(r["biases"] for r in report.layers)
    out = save_pruned_model(model, tmp_path / "out", format="deci")
    assert json.loads((out / "config.json").read_text())["model_type"] == "nemotron-nas"
    reloaded = AutoPrunedModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    torch.testing.assert_close(logits(reloaded), logits(model), rtol=0, atol=0)
    assert_cached_decoding_matches(reloaded)


def test_servable_removed_equals_zeroed():
    model = _wide()
    spec, plan = _compute_plan(model, NumericalConfig(pruning_ratio=0.3, allocation="servable"), calibration_ids())
    zeroed, removed = copy.deepcopy(model), copy.deepcopy(model)
    for m, mode in ((zeroed, "zero"), (removed, "remove")):
        for i, lp in plan.layers.items():
            apply_layer_plan_(layer_view(get_layers(m, spec)[i], i, spec, m.config), lp, mode=mode)
    assert sum(p.numel() for p in removed.parameters()) < sum(p.numel() for p in zeroed.parameters())
    torch.testing.assert_close(logits(removed), logits(zeroed), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("model", "config", "match"),
    [
        (lambda: tiny_model("qwen3"), NumericalConfig(allocation="servable"), "'qwen3' model"),
        (lambda: tiny_model("llama"), NumericalConfig(allocation="servable"), "multiple of 256"),
        (_wide, NumericalConfig(allocation="servable", compensation_bias=True), "add biases"),
        (_wide, FLAPConfig(allocation="servable", bias_compensation=True), "add biases"),
        (lambda: tiny_model("gemma3", intermediate_size=768), ServingConfig(), "ServingConfig writes nothing else"),
    ],
    ids=["qwen3", "narrow-mlp", "np-bias", "flap-bias", "serving-gemma3"],
)
def test_servable_refuses_models_and_settings_the_format_cannot_hold(model, config, match):
    m = model()
    before = logits(m)
    with pytest.raises(ValueError, match=match) as err:
        prune_(m, config, calibration_ids())
    assert "allocation='global'" in str(err.value)
    torch.testing.assert_close(logits(m), before, rtol=0, atol=0)  # nothing changed


def test_spp_refuses_servable():
    with pytest.raises(ValueError, match="head dimensions"):
        SPPConfig(allocation="servable")


@pytest.mark.parametrize(
    ("model", "config", "expected"),
    [
        (_wide, NumericalConfig(pruning_ratio=0.2, allocation="auto"), "servable"),
        (_wide, FLAPConfig(pruning_ratio=0.3, allocation="auto"), "servable"),
        (lambda: tiny_model("qwen3", intermediate_size=768), NumericalConfig(allocation="auto"), "global"),
        # Qwen2's q/k/v biases: the DeciLM format holds them (attention_bias, for vLLM, SGLang, MLX)
        (lambda: tiny_model("qwen2", intermediate_size=768), NumericalConfig(allocation="auto"), "servable"),
        (lambda: tiny_model("llama"), NumericalConfig(allocation="auto"), "global"),  # MLP narrower than 256
        (_wide, NumericalConfig(allocation="auto", compensation_bias=True), "global"),
        (_wide, NumericalConfig(allocation="auto", ranking="literal"), "global"),
        (_wide, NumericalConfig(pruning_ratio=0.65, allocation="auto"), "global"),  # beyond the MLP blocks
    ],
    ids=["np", "flap", "qwen3", "qwen2", "narrow-mlp", "bias", "literal", "unreachable"],
)
def test_auto_allocation_is_servable_where_the_format_holds_the_result(model, config, expected, caplog):
    """`allocation="auto"` gives the DeciLM shapes where they can be made, and the per-layer ones otherwise; the
    report and the saved config record which, and the result is the one of asking for it by name."""
    auto, named = model(), model()
    report = prune_(auto, config, calibration_ids())
    assert report.config["allocation"] == expected
    named_report = prune_(named, dataclasses.replace(config, allocation=expected), calibration_ids())
    assert report.layers == named_report.layers
    torch.testing.assert_close(logits(auto), logits(named), rtol=0, atol=0)
