"""The document bootstrap against a slow direct reference, on cases whose answer is known, and the verdict rule."""

import math
import random

import numpy as np
import pytest

from optimum_prune.evaluation import bootstrap_interval, compare, compare_geometric_mean, verdict


def _quantile(sorted_xs, q):
    """numpy's default (linear) quantile, written out."""
    pos = q * (len(sorted_xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (pos - lo) * (sorted_xs[hi] - sorted_xs[lo])


def _slow(nll, tokens, ref=None, resamples=300, seed=0, level=0.95):
    """One draw at a time, in plain Python, from the same seeded draws of document indices."""
    draws = np.random.default_rng(seed).integers(0, len(nll), size=(resamples, len(nll))).tolist()
    stats = []
    for idx in draws:
        ppl = math.exp(sum(nll[i] for i in idx) / sum(tokens[i] for i in idx))
        if ref is not None:
            ppl = ppl / math.exp(sum(ref[0][i] for i in idx) / sum(ref[1][i] for i in idx)) - 1
        stats.append(ppl)
    stats.sort()
    tail = (1 - level) / 2
    return _quantile(stats, tail), _quantile(stats, 1 - tail)


def _documents(n, seed, scale=1.0):
    rng = random.Random(seed)
    tokens = [rng.randint(50, 900) for _ in range(n)]
    nll = [t * (3.0 + scale * rng.gauss(0, 0.4)) for t in tokens]
    return nll, tokens


def test_interval_matches_the_slow_reference():
    nll, tokens = _documents(23, seed=1)
    assert bootstrap_interval(nll, tokens, resamples=300, seed=5) == pytest.approx(
        _slow(nll, tokens, resamples=300, seed=5), rel=1e-12
    )


def test_paired_comparison_matches_the_slow_reference():
    nll, tokens = _documents(17, seed=2)
    other = [x * (1.02 + 0.05 * math.sin(i)) for i, x in enumerate(nll)]
    got = compare(other, tokens, nll, tokens, resamples=300, seed=3)
    low, high = _slow(other, tokens, ref=(nll, tokens), resamples=300, seed=3)
    assert (got.low, got.high) == pytest.approx((low, high), rel=1e-10)
    assert got.delta == pytest.approx(math.exp(sum(other) / sum(tokens)) / math.exp(sum(nll) / sum(tokens)) - 1)


def test_two_documents_known_answer():
    """Two one-token documents with NLL a < b: a resample averages a, (a+b)/2 or b with probabilities 1/4, 1/2,
    1/4, so the 2.5% and 97.5% quantiles are exactly exp(a) and exp(b)."""
    low, high = bootstrap_interval([1.0, 2.0], [1, 1])
    assert (low, high) == (pytest.approx(math.e), pytest.approx(math.e**2))


def test_identical_documents_give_a_point_and_width_follows_the_standard_error():
    low, high = bootstrap_interval([3.0 * 100] * 40, [100] * 40)
    assert low == pytest.approx(math.exp(3.0)) and high == pytest.approx(math.exp(3.0))
    # many equal-size documents: the interval of the mean NLL is mean ± 1.96 · sd / sqrt(n) (normal limit)
    rng = random.Random(0)
    per_doc = [3.0 + rng.gauss(0, 0.5) for _ in range(400)]
    low, high = bootstrap_interval([x * 10 for x in per_doc], [10] * 400, log=False)
    half = 1.96 * float(np.std(per_doc, ddof=1)) / math.sqrt(len(per_doc))
    assert (high - low) / 2 == pytest.approx(half, rel=0.1)
    assert (low + high) / 2 == pytest.approx(float(np.mean(per_doc)), abs=0.2 * half)


def test_paired_bootstrap_cancels_what_the_models_share():
    """B = A + 1% on every document: the paired interval is the point (better), where unpaired intervals overlap."""
    nll, tokens = _documents(30, seed=4, scale=3.0)
    worse = [x + math.log(1.01) * t for x, t in zip(nll, tokens)]
    c = compare(worse, tokens, nll, tokens)
    assert (c.delta, c.low, c.high) == pytest.approx((0.01, 0.01, 0.01), rel=1e-9)
    assert c.verdict == "worse" and compare(nll, tokens, worse, tokens).verdict == "better"
    a, b = bootstrap_interval(nll, tokens), bootstrap_interval(worse, tokens)
    assert a[1] > b[0]  # unpaired, the two intervals overlap: only the pairing sees the 1%
    same = compare(nll, tokens, nll, tokens)
    assert (same.delta, same.low, same.high, same.verdict) == (0.0, 0.0, 0.0, "tie")


def test_accuracy_difference_is_absolute_and_higher_is_better():
    correct_a = [1, 1, 1, 0] * 25
    correct_b = [1, 0, 1, 0] * 25
    c = compare(correct_a, [1] * 100, correct_b, [1] * 100, log=False)
    assert c.delta == pytest.approx(0.25) and c.verdict == "better"
    assert 0 < c.low < 0.25 < c.high


def test_verdict_rule():
    assert verdict(-0.05, -0.01) == "better"
    assert verdict(0.01, 0.05) == "worse"
    assert verdict(-0.01, 0.02) == "tie"
    assert verdict(0.0, 0.02) == "tie"  # an interval touching 0 does not exclude it
    assert verdict(0.01, 0.03, lower_is_better=False) == "better"


def test_bad_input():
    with pytest.raises(ValueError, match="same, non-zero number of units"):
        bootstrap_interval([], [])
    with pytest.raises(ValueError, match="same, non-zero number of units"):
        compare([1.0, 2.0], [1, 1], [1.0], [1])


def test_geometric_mean_comparison():
    """Three texts, B worse than A by 1%, 2% and 6% on every document: the geometric mean is worse by exactly
    (1.01 · 1.02 · 1.06)^(1/3) − 1, the interval is that point; one text alone matches `compare`."""
    texts = [_documents(n, seed=s) for n, s in ((12, 5), (5, 6), (20, 7))]
    worse = [
        ([x + math.log(f) * t for x, t in zip(nll, tok)], tok) for (nll, tok), f in zip(texts, (1.01, 1.02, 1.06))
    ]
    c = compare_geometric_mean(worse, texts)
    want = (1.01 * 1.02 * 1.06) ** (1 / 3) - 1
    assert (c.delta, c.low, c.high) == pytest.approx((want, want, want), rel=1e-9) and c.verdict == "worse"
    mixed = [worse[0], texts[1], texts[2]]
    one = compare(*mixed[0], *texts[0])
    assert compare_geometric_mean(mixed[:1], texts[:1]).low == pytest.approx(one.low)
    with pytest.raises(ValueError, match="same texts"):
        compare_geometric_mean(texts[:2], texts)
