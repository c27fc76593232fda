"""Evaluation: perplexity (SparseGPT/Wanda protocol), speed / memory benchmarks and zero-shot tasks (lm-eval).

`zero_shot` imports `lm-eval` (the `[eval]` extra) only when called.
"""

from .perplexity import perplexity
from .speed import benchmark_speed, compare_speed, format_speed, speedup_spread
from .zero_shot import zero_shot

__all__ = ["benchmark_speed", "compare_speed", "format_speed", "perplexity", "speedup_spread", "zero_shot"]
