"""`prune_(..., stats_cache=)`: structured prunes that differ only in what acts after the calibration pass share one
pass, and give the weights a fresh pass gives."""

import copy

import pytest
import torch

import optimum_prune.pipeline.passes.structured as structured_pass
from optimum_prune import CalibrationStatsCache, FLAPConfig, NumericalConfig, prune_


def _ids(seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (4, 32), generator=torch.Generator().manual_seed(seed))


def _prune(dense, config, ids, cache=None):
    model = copy.deepcopy(dense)
    prune_(model, config, calibration=ids, batch_size=2, stats_cache=cache)
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
    original = structured_pass._score_blocks

    def counting(pruner, stage, views):
        calls.append(pruner.config.pruning_ratio)
        return original(pruner, stage, views)

    structured_pass._score_blocks = counting  # test-only spy on the real pass
    try:
        cache = CalibrationStatsCache()
        reused = [_prune(tiny_llama, c, ids, cache) for c in configs]
    finally:
        structured_pass._score_blocks = original
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
    cache = CalibrationStatsCache()
    reused = [_prune(tiny_llama, c, ids, cache) for c in configs]
    assert (cache.hits, cache.misses) == (0, 2)
    for a, b in zip(fresh, reused):
        _assert_same(a, b)


def test_a_different_input_misses(tiny_llama):
    vocab = tiny_llama.config.vocab_size
    cache = CalibrationStatsCache()
    _prune(tiny_llama, NumericalConfig(pruning_ratio=0.2), _ids(0, vocab), cache)
    _prune(tiny_llama, NumericalConfig(pruning_ratio=0.2), _ids(1, vocab), cache)  # other calibration ids
    _prune(tiny_llama, NumericalConfig(pruning_ratio=0.2, compensate=False), _ids(0, vocab), cache)  # config
    _prune(tiny_llama, NumericalConfig(pruning_ratio=0.2, allocation="owl"), _ids(0, vocab), cache)  # OWL pass
    other = copy.deepcopy(tiny_llama)
    with torch.no_grad():
        other.model.layers[1].mlp.up_proj.weight.mul_(1.5)
    _prune(other, NumericalConfig(pruning_ratio=0.2), _ids(0, vocab), cache)  # other weights
    assert (cache.hits, cache.misses, len(cache)) == (0, 5, 5)


def test_a_cache_is_consulted_only_when_given(tiny_llama):
    ids = _ids(0, tiny_llama.config.vocab_size)
    cache = CalibrationStatsCache()
    _prune(tiny_llama, FLAPConfig(pruning_ratio=0.2), ids, cache)
    _prune(tiny_llama, FLAPConfig(pruning_ratio=0.3), ids)  # without the cache: not consulted
    assert (cache.hits, cache.misses) == (0, 1)
    _prune(tiny_llama, FLAPConfig(pruning_ratio=0.3), ids, cache)
    assert (cache.hits, cache.misses) == (1, 1)
