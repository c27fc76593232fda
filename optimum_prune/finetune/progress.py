"""Trainer callbacks of a run sized in tokens: progress with throughput and ETA in the log, and evaluations at
training-token checkpoints (a recovery curve from one run)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import TrainerCallback

__all__ = ["TokenProgress", "TokenCheckpoints"]

logger = logging.getLogger(__name__)


class TokenProgress(TrainerCallback):
    """Logs the tokens trained, the throughput and the time left at every Trainer log step."""

    def __init__(self, tokens_per_step: int) -> None:
        self.tokens_per_step = tokens_per_step
        self._t0: float | None = None
        self._step0 = self._logged = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self._t0, self._step0 = time.perf_counter(), state.global_step  # a resumed run starts at its checkpoint

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._t0 is None or state.global_step <= self._step0 or state.global_step == self._logged:
            return
        self._logged = state.global_step
        elapsed = time.perf_counter() - self._t0
        per_step = elapsed / (state.global_step - self._step0)
        left = (state.max_steps - state.global_step) * per_step
        logger.info(
            "%d / %d training tokens (step %d / %d), %.0f tokens/s, %.0f s left",
            state.global_step * self.tokens_per_step, state.max_steps * self.tokens_per_step, state.global_step,
            state.max_steps, self.tokens_per_step / per_step, left,
        )  # fmt: skip


class TokenCheckpoints(TrainerCallback):
    """Runs `evaluate(model)` when the run passes each of `at_tokens` training tokens (and at its end), recording
    `{"tokens", "step", "elapsed_s", **evaluate(model)}` in `self.points`.

    The model is put in eval mode and back for each call; the time spent evaluating is not counted in `elapsed_s`
    (training time only) but in `eval_s`, which the fine-tuning engine takes out of the run's `train_runtime_s`.

    Args:
        at_tokens (`Sequence[int]`): training-token counts (the first step at or past each one is evaluated).
        tokens_per_step (`int`): training tokens per optimizer step.
        evaluate (`Callable[[nn.Module], dict]`): what to measure (e.g. held-out perplexity); it must not train.
        at_end (`bool`, defaults to `True`): also evaluate after the last step (unless a checkpoint fell on it).
    """

    def __init__(
        self, at_tokens: Sequence[int], tokens_per_step: int, evaluate: Callable[[Any], dict], *, at_end: bool = True
    ) -> None:
        self.at_tokens = sorted({int(t) for t in at_tokens})
        self.tokens_per_step, self.evaluate, self.at_end = tokens_per_step, evaluate, at_end
        self.points: list[dict[str, Any]] = []
        self._train_s, self._last, self.eval_s = 0.0, None, 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self._last = time.perf_counter()

    def _record(self, state, model) -> None:
        now = time.perf_counter()
        self._train_s += now - (self._last or now)
        tokens = state.global_step * self.tokens_per_step
        was_training = model.training
        model.eval()
        with torch.no_grad():
            result = self.evaluate(model)
        model.train(was_training)
        self.eval_s += time.perf_counter() - now
        self.points.append({"tokens": tokens, "step": state.global_step, "elapsed_s": self._train_s, **result})
        logger.info(
            "after %d training tokens: %s", tokens, {k: v for k, v in result.items() if not isinstance(v, dict)}
        )
        self._last = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        tokens = state.global_step * self.tokens_per_step
        done = {p["step"] for p in self.points}
        due = [t for t in self.at_tokens if t <= tokens and t > (state.global_step - 1) * self.tokens_per_step]
        if due and state.global_step not in done:
            self._record(state, model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if self.at_end and state.global_step not in {p["step"] for p in self.points}:
            self._record(state, model)
