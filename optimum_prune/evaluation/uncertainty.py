"""Bootstrap intervals over documents, and the one rule that calls a difference a win, a loss or a tie.

A perplexity (or an accuracy) is a ratio of sums over the scored units (documents, images):
`exp(Σ nll / Σ tokens)` (or `Σ correct / Σ seen`). Its interval resamples the units with replacement (percentile
bootstrap, seeded); the difference of two models scored on the same units resamples the same units for both (paired
bootstrap), so what the models share (a hard document) cancels. `verdict` reads a difference's interval: a model is
better or worse only when the interval excludes 0, else the two tie.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Comparison", "RESAMPLES", "bootstrap_interval", "compare", "compare_geometric_mean", "verdict"]

RESAMPLES = 2000
LEVEL = 0.95
SEED = 0


def _resampled_sums(values: Sequence[Sequence[float]], resamples: int, seed: int) -> list[np.ndarray]:
    """For each array of per-unit values (all over the same units), its sum over each of `resamples` draws of the
    units with replacement (the same draws for every array)."""
    n = len(values[0])
    if n == 0 or any(len(v) != n for v in values):
        raise ValueError(f"every array needs the same, non-zero number of units, got {[len(v) for v in values]}")
    draws = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    return [np.asarray(v, dtype=np.float64)[draws].sum(axis=1) for v in values]


def _statistic(num: np.ndarray, den: np.ndarray, log: bool) -> np.ndarray:
    ratio = num / den
    return np.exp(ratio) if log else ratio


def bootstrap_interval(
    num: Sequence[float],
    den: Sequence[float],
    *,
    log: bool = True,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    seed: int = SEED,
) -> tuple[float, float]:
    """Percentile bootstrap interval of `f(Σ num / Σ den)` over the units (documents, images).

    Args:
        num / den: per-unit sums: a document's summed NLL and its scored tokens (perplexity, `log=True`: `f = exp`),
            or an image's correct / seen counts (accuracy, `log=False`: `f` is the identity).
        log (`bool`, defaults to `True`): exponentiate the ratio (perplexity).
        resamples (`int`, defaults to `2000`): bootstrap draws of the units, with replacement.
        level (`float`, defaults to `0.95`): the interval's coverage.
        seed (`int`, defaults to `0`): the draws' seed (the same draws for the same number of units).

    Returns:
        `(low, high)`.
    """
    s_num, s_den = _resampled_sums([num, den], resamples, seed)
    stat = _statistic(s_num, s_den, log)
    tail = (1 - level) / 2
    low, high = np.quantile(stat, [tail, 1 - tail])
    return float(low), float(high)


@dataclass(frozen=True)
class Comparison:
    """A model against a reference on the same units: `delta` (relative change of the perplexity, `a / b - 1`, or
    the difference of the accuracies, `a - b`), its paired bootstrap interval `(low, high)` and `verdict`."""

    delta: float
    low: float
    high: float
    verdict: str


def verdict(low: float, high: float, *, lower_is_better: bool = True) -> str:
    """`"better"` / `"worse"` when the interval `(low, high)` of a difference (model − reference) excludes 0, else
    `"tie"`: the one rule every table and text of the project applies. A perplexity's difference is better below 0
    (`lower_is_better=True`), an accuracy's above 0."""
    if low > 0:
        return "worse" if lower_is_better else "better"
    if high < 0:
        return "better" if lower_is_better else "worse"
    return "tie"


def compare(
    num: Sequence[float],
    den: Sequence[float],
    ref_num: Sequence[float],
    ref_den: Sequence[float],
    *,
    log: bool = True,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    seed: int = SEED,
) -> Comparison:
    """Paired bootstrap of a model (`num`, `den`) against a reference (`ref_num`, `ref_den`) scored on the same units
    in the same order: every draw resamples the same units for both.

    With `log=True` (perplexity) the difference is relative, `exp(Σnum/Σden) / exp(Σref_num/Σref_den) − 1`, and lower
    is better; with `log=False` (accuracy) it is `Σnum/Σden − Σref_num/Σref_den`, and higher is better.

    Returns:
        [`Comparison`].
    """
    a_num, a_den, b_num, b_den = _resampled_sums([num, den, ref_num, ref_den], resamples, seed)

    def diff(an, ad, bn, bd):
        a, b = _statistic(an, ad, log), _statistic(bn, bd, log)
        return a / b - 1 if log else a - b

    point = diff(*(np.asarray([sum(map(float, v))]) for v in (num, den, ref_num, ref_den)))[0]
    tail = (1 - level) / 2
    low, high = np.quantile(diff(a_num, a_den, b_num, b_den), [tail, 1 - tail])
    return Comparison(float(point), float(low), float(high), verdict(low, high, lower_is_better=log))


def compare_geometric_mean(
    texts: Sequence[tuple[Sequence[float], Sequence[float]]],
    ref_texts: Sequence[tuple[Sequence[float], Sequence[float]]],
    *,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    seed: int = SEED,
) -> Comparison:
    """Paired bootstrap of the geometric mean of a model's perplexities over several texts against a reference's:
    each text's documents are resampled on their own (the same draws for both models), and the difference is the
    relative change of the geometric means (lower is better).

    Args:
        texts / ref_texts: per text, `(per-document NLL sums, per-document scored tokens)`, the same texts and
            documents in the same order for both.

    Returns:
        [`Comparison`].
    """
    if len(texts) != len(ref_texts) or not texts:
        raise ValueError(f"compare the same texts: {len(texts)} against {len(ref_texts)}")
    log_ratio = np.zeros(resamples)
    point = 0.0
    for i, ((num, den), (ref_num, ref_den)) in enumerate(zip(texts, ref_texts)):
        a_num, a_den, b_num, b_den = _resampled_sums([num, den, ref_num, ref_den], resamples, seed + i)
        log_ratio += a_num / a_den - b_num / b_den  # log ppl_a - log ppl_b of this text
        point += sum(map(float, num)) / sum(map(float, den)) - sum(map(float, ref_num)) / sum(map(float, ref_den))
    n = len(texts)
    tail = (1 - level) / 2
    low, high = np.quantile(np.exp(log_ratio / n) - 1, [tail, 1 - tail])
    return Comparison(float(np.exp(point / n) - 1), float(low), float(high), verdict(low, high))
