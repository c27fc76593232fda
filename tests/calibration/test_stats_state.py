import pytest
import torch

from optimum_prune.calibration.stats import CrossGramStats, GramStats, MomentStats, SquaredNormStats


@pytest.mark.parametrize(
    "make", [lambda: GramStats(6), lambda: MomentStats(6), lambda: SquaredNormStats(6), lambda: CrossGramStats(6)]
)
def test_state_dict_round_trip(make):
    """A statistic rebuilt from its `state_dict` (e.g. after a trip to disk) reads as the original, and keeps adding."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 5, 6, generator=g, dtype=torch.float64) for _ in range(3)]
    stat = make()
    if isinstance(stat, CrossGramStats):
        feed = lambda s, x: s.update(x, 2 * x + 1)  # noqa: E731
    else:
        feed = lambda s, x: s.update(x)  # noqa: E731
    for x in xs[:2]:
        feed(stat, x)
    state = stat.state_dict()
    assert set(state) == {name.lstrip("_") for name in stat._fields} | {"count"}
    copy = type(stat).from_state_dict(state)
    assert copy.count == stat.count == 20
    for name in stat._fields:
        assert torch.equal(getattr(copy, name), getattr(stat, name))
    for name in ("gram", "mean", "value"):  # every derived reading works on the rebuilt statistic
        if hasattr(type(stat), name):
            assert torch.equal(torch.as_tensor(getattr(copy, name)), torch.as_tensor(getattr(stat, name))), name
    feed(copy, xs[2])
    assert copy.count == 30
    with pytest.raises(KeyError):
        type(stat).from_state_dict({"count": 1})
