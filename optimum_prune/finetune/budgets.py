"""Recovery recipes by token budget: what `FinetuneConfig.for_budget` returns, each the recipe that the protocol's
selection split ranked best at that budget (SmolLM2-135M after Numerical Pruning's default at 20%; one run per
budget, its cosine schedule that budget's length, batch 2 × 512 tokens; the criterion fixed in advance: the
geometric mean of the three texts' perplexities at the run's end). The record is `MEASURED_IN`."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["BUDGET_RECIPES", "MEASURED_IN", "WARMUP_FRACTION", "recipe_for_budget"]

MEASURED_IN = "benchmarks/results/recovery_budgets_smollm2_selection.md"
WARMUP_FRACTION = 0.05  # linear warm-up, share of the run's steps (as measured)

_SHAPE = {"batch_size": 2, "seq_len": 512}
_LORA = {"method": "lora", "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "learning_rate": 1e-3, **_SHAPE}
_FULL = {"method": "full", "learning_rate": 1e-4, **_SHAPE}


def _kd(lr: float) -> dict[str, Any]:
    return {"method": "full", "distill": "kl", "distill_alpha": 0.5, "distill_temperature": 2.0, "learning_rate": lr,
            **_SHAPE}  # fmt: skip


# measured budget (training tokens) -> its recipes, best first (the screen's order). At 256k distillation first
# (geometric mean -2.6% [-3.6, -1.6] against LoRA, paired; BBC better, the Python docs a tie, the Bible +2.1% worse),
# then LoRA (a tie with full: -0.4% [-1.0, +0.3]), the first without a teacher; the test split's 256k curves pick
# distillation too. A larger budget takes the 256k recipe.
BUDGET_RECIPES: dict[int, tuple[dict[str, Any], ...]] = {
    4096: (_LORA, _FULL, _kd(3e-4)),
    32768: (_LORA, _FULL, _kd(3e-4)),
    262144: (_kd(3e-4), _LORA, _FULL),
}


def recipe_for_budget(token_budget: int, *, distill: bool = True) -> dict[str, Any]:
    """`FinetuneConfig` fields: the best recipe at the measured budget nearest `token_budget` on
    a log scale (below the smallest, the smallest's; above the largest, the largest's), skipping distillation when
    `distill` is off (no teacher at hand)."""
    if not isinstance(token_budget, int) or isinstance(token_budget, bool) or token_budget < 1:
        raise ValueError(f"token_budget must be a positive number of training tokens, got {token_budget!r}.")
    measured = min(BUDGET_RECIPES, key=lambda b: (abs(math.log(token_budget / b)), b))
    for recipe in BUDGET_RECIPES[measured]:
        if distill or recipe.get("distill") is None:
            return dict(recipe)
    raise AssertionError(f"no recipe without distillation measured at {measured} tokens")  # the table has one
