"""Hardware-aligned MLP widths: the structured configs keep a multiple of `round_to` channels (default 64)."""

from __future__ import annotations

import pytest
import torch
from testing_utils import calibration_ids
from transformers import LlamaConfig, LlamaForCausalLM

from optimum_prune import FLAPConfig, MagnitudeConfig, NumericalConfig, StructuredPruningConfig, prune_
from optimum_prune.functional.allocation import round_kept_channels


def _wide_llama(seed: int = 0):
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=640,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return model


def test_default_is_64_and_round_to_1_stays_available():
    assert StructuredPruningConfig().round_to == 64
    for cls in (NumericalConfig, FLAPConfig, MagnitudeConfig):
        assert cls().round_to == 64
        assert cls(round_to=1).round_to == 1


@pytest.mark.parametrize("allocation", ["global", "uniform"])
@pytest.mark.parametrize("cls", [NumericalConfig, FLAPConfig, MagnitudeConfig])
def test_default_keeps_multiples_of_64(cls, allocation):
    model = _wide_llama()
    report = prune_(model, cls(pruning_ratio=0.3, allocation=allocation), calibration_ids())
    widths = [layer.mlp.down_proj.in_features for layer in model.model.layers]
    assert all(w % 64 == 0 for w in widths), widths
    assert all(layer.mlp.up_proj.out_features == w for layer, w in zip(model.model.layers, widths))
    assert abs(report.measured - 0.3) < 0.06, report.measured
    if allocation == "uniform":
        assert len(set(widths)) == 1


def test_round_to_1_keeps_exact_allocation():
    model = _wide_llama()
    prune_(model, NumericalConfig(pruning_ratio=0.3, round_to=1), calibration_ids())
    widths = [layer.mlp.down_proj.in_features for layer in model.model.layers]
    assert any(w % 64 for w in widths), widths  # unaligned widths: the alignment really comes from round_to


def test_round_kept_channels_nearest_multiple_within_guards():
    scores = torch.arange(640, dtype=torch.float64)
    removed = list(range(200))  # keeps 440 -> nearest multiple of 64 is 448
    kept = 640 - len(round_kept_channels(scores, removed, 64, max_remove=639))
    assert kept == 448
    assert round_kept_channels(scores, removed, 64, max_remove=639) == list(range(192))  # lowest scores go
    assert 640 - len(round_kept_channels(scores, list(range(630)), 64, max_remove=639)) == 64  # at least one block
    assert round_kept_channels(scores, removed, 1, max_remove=639) == removed
