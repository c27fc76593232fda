"""Light evaluation metrics: perplexity (SparseGPT/Wanda protocol) and speed / memory benchmarks."""

from .perplexity import perplexity
from .speed import benchmark_speed, compare_speed

__all__ = ["benchmark_speed", "compare_speed", "perplexity"]
