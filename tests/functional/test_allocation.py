"""Budget allocation: OWL's outlier-weighted layer ratios and per-layer budgets (`functional/allocation.py`)."""

import pytest
import torch

from optimum_prune.functional.allocation import (
    LayerUnits,
    allocate,
    allocate_channel_blocks,
    allocate_per_layer,
    allocate_servable,
    outlier_fraction,
    owl_layer_ratios,
)


def test_outlier_fraction_counts_weights_above_threshold_times_the_layer_mean():
    a = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    b = torch.tensor([10.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # mean over all 10 entries: 1.9; 10 > 5 × 1.9
    assert outlier_fraction([a, b], 5.0) == pytest.approx(0.1)
    assert outlier_fraction([a, b], 6.0) == 0.0


def test_owl_ratios_keep_the_mean_and_spare_outlier_rich_layers():
    fractions = [0.01, 0.03, 0.02, 0.06]
    ratios = owl_layer_ratios(fractions, 0.3, 0.08)
    assert sum(ratios) / 4 == pytest.approx(0.3)
    assert max(ratios) - min(ratios) == pytest.approx(0.16)  # the fractions span [0, 2λ]
    assert sorted(range(4), key=lambda i: ratios[i]) == sorted(range(4), key=lambda i: -fractions[i])
    torch.testing.assert_close(torch.tensor(owl_layer_ratios([0.02] * 3, 0.3, 0.08)), torch.full((3,), 0.3))
    assert owl_layer_ratios(fractions, 0.05, 0.08)[3] == 0.0  # clipped at 0


def test_allocate_per_layer_spends_each_layers_budget_on_its_lowest_units():
    g = torch.Generator().manual_seed(0)
    units = [
        LayerUnits(torch.rand(4, generator=g), 40.0, 3, torch.rand(100, generator=g), 1.0, 99),
        LayerUnits(torch.rand(4, generator=g), 40.0, 3, torch.rand(100, generator=g), 1.0, 99),
    ]
    totals = [260.0, 260.0]  # 4 units × 40 + 100 channels
    heads, chans = allocate_per_layer(units, [0.1, 0.4], totals)
    for li, r in enumerate((0.1, 0.4)):
        removed = 40.0 * len(heads[li]) + len(chans[li])
        assert abs(removed - r * totals[li]) <= 40.0 / 2  # within half of the largest unit
        # the same as a global allocation over that layer alone
        assert (heads[li], chans[li]) == tuple(x[0] for x in allocate([units[li]], r, totals[li]))
    assert allocate_per_layer(units, [0.0, 0.0], totals) == ([[], []], [[], []])


def _channel_units(g, widths, costs):
    return [LayerUnits(None, 0.0, 0, torch.randn(w, generator=g), c, w - 1) for w, c in zip(widths, costs)]


def test_channel_blocks_of_one_are_the_global_ranking():
    g = torch.Generator().manual_seed(0)
    units = _channel_units(g, [40, 50, 30], [1.0, 2.0, 1.5])
    budget = 0.3 * sum(u.channel_cost * u.channel_scores.numel() for u in units)
    blocks = allocate_channel_blocks([u.channel_scores for u in units], [u.channel_cost for u in units], budget, 1)
    total = sum(u.channel_cost * u.channel_scores.numel() for u in units)
    assert blocks == allocate(units, 0.3, total)[1]


def test_channel_blocks_keep_multiples_remove_the_weakest_and_meet_the_budget():
    g = torch.Generator().manual_seed(1)
    scores = [torch.randn(96, generator=g), torch.randn(64, generator=g) + 1.0, torch.randn(80, generator=g), None]
    costs = [1.0, 1.0, 2.0, 1.0]
    removed = allocate_channel_blocks(scores, costs, 100.0, 16)
    spent = 0.0
    for s, c, r in zip(scores, costs, removed):
        if s is None:
            assert r == []
            continue
        kept = s.numel() - len(r)
        assert kept % 16 == 0 and kept >= 16  # a positive multiple of the block
        if r:  # the layer's weakest channels went
            assert s[r].max() <= s[[i for i in range(s.numel()) if i not in r]].min()
        spent += c * len(r)
    assert abs(spent - 100.0) <= 16 * 2.0 / 2  # within half of the largest block's cost
    assert len(removed[1]) < len(removed[0])  # the layer with higher scores loses less


def test_servable_allocation_removes_whole_attention_and_spends_the_rest_on_mlp_blocks():
    g = torch.Generator().manual_seed(2)
    units = [LayerUnits(torch.rand(2, generator=g), 30.0, 1, torch.randn(64, generator=g), 1.0, 63) for _ in range(3)]
    total = 3 * (2 * 30.0 + 64)
    heads, chans = allocate_servable(units, 0.4, total, 16, attention_layers=[2])
    assert heads == [[], [], [0, 1]]
    spent = 60.0 + sum(len(c) for c in chans)
    assert abs(spent - 0.4 * total) <= 8 and all((64 - len(c)) % 16 == 0 for c in chans)
    assert allocate_servable(units, 0.2, total, 16)[0] == [[], [], []]
    with pytest.raises(ValueError, match="allocation='servable'"):
        allocate_servable(units, 0.9, total, 16)
