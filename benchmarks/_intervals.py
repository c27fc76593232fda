"""Uncertainty in the results tables: a perplexity (or accuracy) with its bootstrap 95% interval, a Δ against a
baseline with its paired interval and verdict, from the per-document sums (per-image hits) a results file stores.
The statistics and the verdict rule are the library's (`optimum_prune.evaluation.bootstrap_interval` / `compare` /
`verdict`); `harness` re-exports these helpers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from optimum_prune.evaluation import Comparison, bootstrap_interval, compare, compare_geometric_mean

__all__ = [
    "accuracy_cell",
    "accuracy_delta_cell",
    "comparison",
    "delta_cell",
    "geomean_delta_cell",
    "has_documents",
    "interval",
    "interval_table",
    "ppl_cell",
]


def interval_table(
    rows: Sequence[dict[str, Any]], texts: Sequence[tuple[str, str]], *, group: str = "ratio", baseline: str = "FLAP"
) -> list[str]:
    """Markdown lines of a table: per row its perplexity on each text with the bootstrap 95% interval, and its Δ
    against its baseline row with the paired interval and the verdict.

    Args:
        rows: `{"group": str, "label": str, "ppl": {text: float}, "docs": {text: sums}, "ref": baseline row or
            None}` (a baseline row has `"ref": None`).
        texts: `(key of "ppl" / "docs", column label)` per text.
        group / baseline: the first column's name (e.g. `"ratio"`) and how the Δ columns name the baseline.
    """
    head = [group, "model"]
    for _, label in texts:
        head += [f"{label} [95%]", f"Δ vs {baseline} [95%]"]
    lines = ["| " + " | ".join(head) + " |", "|---:|---|" + "---:|---|" * len(texts)]
    for r in rows:
        cells = [r["group"], r["label"]]
        for key, _ in texts:
            x, docs, ref = r["ppl"].get(key), (r.get("docs") or {}).get(key), r.get("ref")
            cells.append(ppl_cell(x, docs))
            cells.append(
                "" if ref is None else delta_cell(x, ref["ppl"].get(key), docs, (ref.get("docs") or {}).get(key))
            )
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def accuracy_cell(hits: str | None) -> str:
    """`0.7230 [0.695, 0.750]`: an accuracy from its per-image hits (`"0110..."`) with the bootstrap 95% interval."""
    if not hits:
        return "–"
    num = [int(c) for c in hits]
    low, high = bootstrap_interval(num, [1] * len(num), log=False)
    return f"{sum(num) / len(num):.4f} [{low:.3f}, {high:.3f}]"


def accuracy_delta_cell(hits: str | None, ref_hits: str | None) -> str:
    """`+0.0120 [+0.002, +0.022] better`: the difference of two accuracies on the same images, its paired bootstrap
    95% interval and the verdict (higher is better)."""
    if not hits or not ref_hits or len(hits) != len(ref_hits):
        return "–"
    a, b = [int(c) for c in hits], [int(c) for c in ref_hits]
    c = compare(a, [1] * len(a), b, [1] * len(b), log=False)
    return f"{c.delta:+.4f} [{c.low:+.3f}, {c.high:+.3f}] {c.verdict}"


def has_documents(obj: Any) -> bool:
    """Whether a results structure holds per-document sums anywhere (`{"nll": [...], "tokens": [...]}`)."""
    if isinstance(obj, dict):
        if "nll" in obj and "tokens" in obj:
            return True
        return any(has_documents(v) for v in obj.values())
    if isinstance(obj, list):
        return any(has_documents(v) for v in obj)
    return False


def interval(docs: dict[str, Any] | None) -> tuple[float, float] | None:
    """The bootstrap 95% interval of a perplexity from its stored per-document sums (None without them)."""
    if not docs:
        return None
    return bootstrap_interval(docs["nll"], docs["tokens"])


def comparison(docs: dict[str, Any] | None, ref_docs: dict[str, Any] | None) -> Comparison | None:
    """The paired bootstrap of a perplexity against a baseline's (`optimum_prune.evaluation.compare`), or None when
    either lacks per-document sums or they were scored on different documents."""
    if not docs or not ref_docs or docs["tokens"] != ref_docs["tokens"] or docs.get("units") != ref_docs.get("units"):
        return None
    return compare(docs["nll"], docs["tokens"], ref_docs["nll"], ref_docs["tokens"])


def ppl_cell(x: float | None, docs: dict[str, Any] | None = None, fmt: str = ".2f") -> str:
    """`35.22 [34.10, 36.51]`: a perplexity and its bootstrap 95% interval (the value alone without document sums,
    `–` without a value)."""
    if x is None:
        return "–"
    ci = interval(docs)
    return f"{x:{fmt}}" + (f" [{ci[0]:{fmt}}, {ci[1]:{fmt}}]" if ci else "")


def delta_cell(
    x: float | None, ref: float | None, docs: dict[str, Any] | None = None, ref_docs: dict[str, Any] | None = None
) -> str:
    """`-3.9% [-5.1, -2.6] better`: a perplexity's relative change against a baseline's, its paired bootstrap 95%
    interval and the verdict (better / worse only when the interval excludes 0, else tie); the change alone when the
    pair has no common per-document sums."""
    if x is None or not ref:
        return "–"
    c = comparison(docs, ref_docs)
    if c is None:
        return f"{100 * (x / ref - 1):+.1f}%"
    return f"{100 * c.delta:+.1f}% [{100 * c.low:+.1f}, {100 * c.high:+.1f}] {c.verdict}"


def geomean(ppl: dict[str, float], keys: Sequence[str]) -> float:
    """The geometric mean of the perplexities `ppl[k]` over the texts `keys` (the selection criterion's point)."""
    return math.exp(sum(math.log(ppl[k]) for k in keys) / len(keys))


def geomean_delta_cell(row: dict[str, Any], ref: dict[str, Any], keys: Sequence[str]) -> str:
    """`-2.1% [-3.0, -1.2] better`: the selection criterion's Δ (the geometric mean of the perplexities on the texts
    `keys`) of a row against its reference, each text's documents resampled, the same draws for both
    (`compare_geometric_mean`); `–` when a text lacks paired per-document sums."""
    docs, ref_docs = row.get("docs") or {}, ref.get("docs") or {}
    pairs = [(docs.get(k), ref_docs.get(k)) for k in keys]
    if any(not a or not b or a["tokens"] != b["tokens"] or a.get("units") != b.get("units") for a, b in pairs):
        return "–"
    c = compare_geometric_mean(
        [(a["nll"], a["tokens"]) for a, _ in pairs], [(b["nll"], b["tokens"]) for _, b in pairs]
    )
    return f"{100 * c.delta:+.1f}% [{100 * c.low:+.1f}, {100 * c.high:+.1f}] {c.verdict}"
