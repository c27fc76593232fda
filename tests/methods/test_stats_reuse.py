"""`reuse_calibration_stats`: structured prunes that differ only in what acts after the calibration pass share one
pass, and give the weights a fresh pass gives."""

import copy

import pytest
import torch

from optimum_prune import FLAPConfig, NumericalConfig, prune_
from optimum_prune.methods.structured import CalibrationStatsCache, StructuredPruner, reuse_calibration_stats


def _ids(seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (4, 32), generator=torch.Generator().manual_seed(seed))


def _prune(dense, config, ids):
    model = copy.deepcopy(dense)
    prune_(model, config, calibration=ids, batch_size=2)
    return model


def _assert_same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].shape == sb[k].shape, k
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize(
    "configs",
    [
        [NumericalConfig(pruning_ratio=r, round_to=1) for r in (0.3, 0.4, 0.5)],
        [FLAPConfig(pruning_ratio=0.3, allocation=a, round_to=1) for a in ("global", "uniform")]
        + [FLAPConfig(pruning_ratio=0.4, round_to=8)],
    ],
    ids=["numerical-ratios", "flap-allocations"],
)
def test_reuse_gives_the_weights_of_a_fresh_pass(tiny_llama, configs):
    ids = _ids(0, tiny_llama.config.vocab_size)
    fresh = [_prune(tiny_llama, c, ids) for c in configs]
    calls = []
    original = StructuredPruner._collect_pass

    def counting(self, views, runner):
        calls.append(self.config.pruning_ratio)
        return original(self, views, runner)

    StructuredPruner._collect_pass = counting  # test-only spy on the real pass
    try:
        with reuse_calibration_stats() as cache:
            reused = [_prune(tiny_llama, c, ids) for c in configs]
    finally:
        StructuredPruner._collect_pass = original
    assert len(calls) == 1, "one calibration pass for runs that differ only after it"
    assert (cache.hits, cache.misses, len(cache)) == (len(configs) - 1, 1, 1)
    for a, b in zip(fresh, reused):
        _assert_same(a, b)
    # the run that filled the cache and the ones served from it differ from each other (the ratios differ)
    assert sum(p.numel() for p in reused[0].parameters()) != sum(p.numel() for p in reused[-1].parameters())


def test_ratios_that_change_nps_scores_do_not_share_a_pass(tiny_llama):
    """NP's default scores depend on the ratio (`scores="auto"`): 10% and 30% are two passes, and each equals a
    fresh run."""
    ids = _ids(0, tiny_llama.config.vocab_size)
    configs = [NumericalConfig(pruning_ratio=r, round_to=1) for r in (0.1, 0.3)]
    fresh = [_prune(tiny_llama, c, ids) for c in configs]
    with reuse_calibration_stats() as cache:
        reused = [_prune(tiny_llama, c, ids) for c in configs]
    assert (cache.hits, cache.misses) == (0, 2)
    for a, b in zip(fresh, reused):
        _assert_same(a, b)


def test_a_different_input_misses(tiny_llama):
    vocab = tiny_llama.config.vocab_size
    with reuse_calibration_stats() as cache:
        _prune(tiny_llama, NumericalConfig(pruning_ratio=0.2), _ids(0, vocab))
        _prune(tiny_llama, NumericalConfig(pruning_ratio=0.2), _ids(1, vocab))  # other calibration ids
        _prune(tiny_llama, NumericalConfig(pruning_ratio=0.2, compensate=False), _ids(0, vocab))  # config
        _prune(tiny_llama, NumericalConfig(pruning_ratio=0.2, allocation="owl"), _ids(0, vocab))  # OWL pass
        other = copy.deepcopy(tiny_llama)
        with torch.no_grad():
            other.model.layers[1].mlp.up_proj.weight.mul_(1.5)
        _prune(other, NumericalConfig(pruning_ratio=0.2), _ids(0, vocab))  # other weights
    assert (cache.hits, cache.misses, len(cache)) == (0, 5, 5)


def test_a_cache_outlives_its_block_and_is_inactive_outside(tiny_llama):
    ids = _ids(0, tiny_llama.config.vocab_size)
    cache = CalibrationStatsCache()
    with reuse_calibration_stats(cache):
        _prune(tiny_llama, FLAPConfig(pruning_ratio=0.2), ids)
    _prune(tiny_llama, FLAPConfig(pruning_ratio=0.3), ids)  # outside any block: not consulted
    assert (cache.hits, cache.misses) == (0, 1)
    with reuse_calibration_stats(cache):
        _prune(tiny_llama, FLAPConfig(pruning_ratio=0.3), ids)
    assert (cache.hits, cache.misses) == (1, 1)
