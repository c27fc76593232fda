"""Budget allocation: OWL's outlier-weighted layer ratios and per-layer budgets (`functional/allocation.py`)."""

import pytest
import torch

from optimum_prune.functional.allocation import (
    LayerUnits,
    allocate,
    allocate_per_layer,
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
