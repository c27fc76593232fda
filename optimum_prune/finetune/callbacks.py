"""`PruningCallback`: prune inside a `transformers.Trainer` run, one-shot or gradually (Zhu & Gupta's cubic schedule).

Gradual pruning (unstructured / N:M methods) prunes to `cubic_sparsity(step)` every `every` steps between
`start_step` and `end_step`: s_t = s_f · (1 − (1 − (t − t0) / (t1 − t0))³) (Zhu & Gupta 2017, "To prune, or not to
prune", with s_i = 0). Between pruning steps the masks are re-applied after every optimizer step, so pruned weights
stay zero while the rest keep training. An N:M config prunes unstructured on the way and applies its pattern at
`end_step` (its sparsity is fixed by the pattern). Structured methods change parameter shapes, which would
invalidate the optimizer state mid-run: they are refused, with the advice to prune before training.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from torch import nn
from transformers import TrainerCallback

from ..calibration.images import looks_like_images
from ..calibration.inputs import calibration_inputs
from ..config import PruningConfig
from ..methods.registry import get_pruner_class
from ..prune import prune_
from .sparsity import apply_masks_, sparsity_masks

__all__ = ["PruningCallback", "cubic_sparsity"]

logger = logging.getLogger(__name__)


def cubic_sparsity(step: int, start_step: int, end_step: int, final_sparsity: float) -> float:
    """Sparsity of the cubic schedule at `step` (0 before `start_step`, `final_sparsity` from `end_step` on)."""
    if step <= start_step:
        return 0.0 if step < start_step or end_step > start_step else final_sparsity
    if step >= end_step:
        return final_sparsity
    return final_sparsity * (1 - (1 - (step - start_step) / (end_step - start_step)) ** 3)


def _is_structured(config: PruningConfig) -> bool:
    return get_pruner_class(config.method)(config).structured


class PruningCallback(TrainerCallback):
    """Prunes the model during training.

    Example:
    ```python
    cb = PruningCallback(WandaConfig(sparsity=0.5), schedule=(0, 800, 0.5, 100), calibration=ids)
    Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb]).train()
    ```

    Args:
        config (`PruningConfig`): an unstructured / N:M method config (its `sparsity` is the final one, or the one
            of a one-shot prune).
        schedule (`int | tuple[int, int, float, int] | None`, defaults to `None`): `None` or `0` prunes once before
            the first step; an int `k` prunes once after optimizer step `k`; `(start_step, end_step,
            final_sparsity, every)` prunes gradually with the cubic schedule.
        calibration (`CalibrationConfig | torch.LongTensor | None`): calibration data of data-driven methods
            (text is tokenized once, at the start of training).
        tokenizer (`PreTrainedTokenizerBase | None`): tokenizes calibration text.

    Attributes:
        reports (`list[PruningReport]`): one per pruning step.
    """

    def __init__(self, config: PruningConfig, schedule: Any = None, calibration: Any = None, tokenizer: Any = None):
        if not isinstance(config, PruningConfig):
            raise TypeError(f"`config` must be a PruningConfig, got {type(config).__name__}.")
        if _is_structured(config):
            raise ValueError(
                f"PruningCallback cannot run the structured method {config.method!r} inside training: removing "
                "heads / channels changes parameter shapes under the optimizer. Prune before training instead "
                "(`AutoPruner.prune(...)`, then `AutoPruner.finetune(...)` or your own Trainer)."
            )
        self.config, self.calibration, self.tokenizer = config, calibration, tokenizer
        self.steps = self._parse_schedule(schedule)
        self.masks: dict = {}
        self.reports: list = []
        self._ids = None

    def _parse_schedule(self, schedule: Any) -> dict[int, float]:
        """`{step: sparsity}` of every pruning event."""
        final = self.config.sparsity
        if schedule is None or (isinstance(schedule, int) and not isinstance(schedule, bool)):
            step = schedule or 0
            if step < 0:
                raise ValueError(f"A one-shot schedule is a step >= 0, got {schedule}.")
            return {step: final}
        if not (isinstance(schedule, (tuple, list)) and len(schedule) == 4):
            raise ValueError(
                f"`schedule` must be None, a step (int) or (start_step, end_step, final_sparsity, every); got {schedule!r}."
            )
        start, end, s_final, every = schedule
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end, every)):
            raise ValueError(f"start_step, end_step and every must be ints, got {schedule!r}.")
        if not (0 <= start <= end and every >= 1):
            raise ValueError(f"Need 0 <= start_step <= end_step and every >= 1, got {schedule!r}.")
        if not (isinstance(s_final, (int, float)) and 0 < s_final < 1):
            raise ValueError(f"final_sparsity must be in (0, 1), got {s_final!r}.")
        nm = getattr(self.config, "nm", None)
        if nm is not None and abs(s_final - (1 - nm[0] / nm[1])) > 1e-9:
            raise ValueError(
                f"pattern {self.config.pattern!r} fixes the final sparsity at {1 - nm[0] / nm[1]:g}, "
                f"but the schedule asks for {s_final}."
            )
        steps = {t: cubic_sparsity(t, start, end, s_final) for t in range(start, end, every)}
        steps[end] = s_final
        return {t: s for t, s in steps.items() if s > 0}

    def _config_at(self, step: int, sparsity: float) -> PruningConfig:
        nm = getattr(self.config, "nm", None)
        final = step == max(self.steps)
        if nm is not None and not final:  # on the way to N:M: unstructured pruning at the scheduled sparsity
            return dataclasses.replace(self.config, sparsity=sparsity, pattern="unstructured")
        return dataclasses.replace(self.config, sparsity=sparsity if nm is None else self.config.sparsity)

    def _prune(self, model: nn.Module, step: int) -> None:
        if hasattr(model, "peft_config"):
            raise ValueError(
                "PruningCallback prunes a plain model under full fine-tuning; with PEFT, prune the base model before "
                "wrapping it (AutoPruner.prune, then finetune with method='lora')."
            )
        if self._ids is None and self.calibration is not None:
            self._ids = calibration_inputs(model, self.calibration, self.tokenizer)[0]  # prepared once, reused
        cfg = self._config_at(step, self.steps[step])
        report = prune_(model, cfg, self._ids)
        new = sparsity_masks(model)
        self.masks = {k: new[k] & self.masks[k] if k in self.masks else new[k] for k in new}
        apply_masks_(model, self.masks)
        self.reports.append(report)
        logger.info("PruningCallback: step %d, sparsity %.3f (measured %.3f)", step, cfg.sparsity, report.measured)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        text = self.calibration is not None and not hasattr(self.calibration, "shape")
        if text and not looks_like_images(self.calibration) and self.tokenizer is None:
            raise ValueError("PruningCallback: calibration text needs `tokenizer=`.")
        if 0 in self.steps and state.global_step == 0:
            self._prune(model, 0)
        elif self.masks:
            apply_masks_(model, self.masks)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        step = state.global_step
        if step in self.steps and step > 0:
            self._prune(model, step)
        elif self.masks:
            apply_masks_(model, self.masks)
