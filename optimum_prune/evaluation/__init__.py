"""Evaluation: perplexity (SparseGPT/Wanda protocol, also per document), bootstrap intervals and verdicts, speed /
memory benchmarks and zero-shot tasks (lm-eval).

`zero_shot` imports `lm-eval` (the `[eval]` extra) only when called.
"""

from .perplexity import DocumentScores, perplexity, score_documents
from .speed import benchmark_speed, compare_speed, format_speed, speed_verdicts, speedup_spread
from .uncertainty import Comparison, bootstrap_interval, compare, compare_geometric_mean, verdict
from .zero_shot import zero_shot

__all__ = [
    "Comparison",
    "DocumentScores",
    "benchmark_speed",
    "bootstrap_interval",
    "compare",
    "compare_geometric_mean",
    "compare_speed",
    "format_speed",
    "perplexity",
    "score_documents",
    "speed_verdicts",
    "speedup_spread",
    "verdict",
    "zero_shot",
]
