"""Helpers shared by the deployment benchmarks (`alignment.py`, `deploy.py`)."""

from __future__ import annotations

import contextlib
import copy
import json
import logging

from optimum_prune.methods.structured import StructuredPruner

__all__ = ["head_documents", "reuse_calibration_pass"]

logger = logging.getLogger(__name__)

# Config fields that act only after the calibration pass (allocation, rounding): runs that differ only in these
# share one calibration pass.
_AFTER_SCORING = ("pruning_ratio", "allocation", "round_to")


def head_documents(docs: list[str], tokens: int) -> list[str]:
    """The first documents, enough for `tokens` tokens (~8 characters each, generous): perplexity tokenizes every
    document it is given before cutting to `max_tokens`."""
    out, chars = [], 0
    for doc in docs:
        out.append(doc)
        chars += len(doc)
        if chars >= 8 * tokens:
            break
    return out


@contextlib.contextmanager
def reuse_calibration_pass():
    """Within the block, structured runs on the same model and calibration ids that differ only in `pruning_ratio`,
    `allocation` or `round_to` reuse the first run's calibration pass (statistics and scores; deep-copied), which is
    what those runs would compute again. The caller must not change the model or the calibration ids in between."""
    original = StructuredPruner._collect
    cache: dict[str, tuple] = {}

    def collect(self, views, runner):
        key = json.dumps({k: v for k, v in self.config.to_dict().items() if k not in _AFTER_SCORING}, sort_keys=True)
        if key not in cache:
            cache[key] = original(self, views, runner)
        else:
            logger.info("reusing the calibration pass of %s", key)
        return copy.deepcopy(cache[key])

    StructuredPruner._collect = collect
    try:
        yield
    finally:
        StructuredPruner._collect = original
