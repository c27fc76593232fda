"""FISTA warns when the calibration set is too small for the layer widths (more outer steps and overfitting)."""

import logging

from testing_utils import calibration_ids, tiny_model

from optimum_prune import FISTAConfig, prune_
from optimum_prune.methods.fista.pruner import MIN_TOKENS_PER_FEATURE


def _warnings(caplog, ids):
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="optimum_prune.methods.fista.pruner"):
        prune_(tiny_model("llama"), FISTAConfig(sparsity=0.5, K=1, max_outer=1), ids)
    return [r.getMessage() for r in caplog.records if "calibration tokens" in r.getMessage()]


def test_small_calibration_set_warns_once_with_the_remedy(caplog):
    model = tiny_model("llama")
    widest = max(m.in_features for m in model.modules() if hasattr(m, "in_features"))
    few = calibration_ids(4, 16)  # 64 tokens
    assert few.numel() < MIN_TOKENS_PER_FEATURE * widest
    messages = _warnings(caplog, few)
    assert len(messages) == 1 and "eps=1e-2" in messages[0] and "more calibration tokens" in messages[0]
    tokens_needed = MIN_TOKENS_PER_FEATURE * widest
    seq_len = 32
    enough = calibration_ids(-(-tokens_needed // seq_len), seq_len)
    assert _warnings(caplog, enough) == []
