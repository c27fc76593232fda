"""Reusing structured calibration passes across ratios and variants (`prune_(..., stats_cache=cache)`).

A structured method's calibration pass (scores, statistics, OWL outliers) depends on the method's configuration
without the fields read only afterwards, on the calibration token ids and on the blocks' weights. Sweeps over
`pruning_ratio`, `allocation` or `round_to` of one method on one model can therefore pay for one pass: given a
`CalibrationStatsCache`, the structured methods store each pass under that key and hand later prunes a deep copy.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..modeling.architectures import LayerView

__all__ = ["CalibrationStatsCache", "calibration_digest", "tensor_digest"]


def tensor_digest(h: Any, t: torch.Tensor) -> None:
    """Feed `t` (dtype, shape and bytes) into the hash `h`."""
    t = t.detach()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.cpu().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def calibration_digest(ids: Any) -> str | None:
    """sha256 of calibration inputs (`None` unless a tensor)."""
    if not isinstance(ids, torch.Tensor):
        return None
    h = hashlib.sha256()
    tensor_digest(h, ids)
    return h.hexdigest()


class CalibrationStatsCache:
    """The results of structured calibration passes (scores, statistics, OWL outliers), keyed by what they depend
    on: the method and its configuration without the fields read only afterwards (`pruning_ratio`, `round_to`,
    `owl_lambda`, and `allocation` except whether it is `"owl"`), the calibration token ids and the blocks' weights.

    Pass one to `prune_(..., stats_cache=cache)` (or `AutoPruner.prune`); a structured prune (NP, FLAP, magnitude)
    whose key is already in the cache skips its calibration pass and uses a deep copy of the stored result, which is
    what the pass would compute again: sweeps over ratios and allocations of one method on one model pay for one pass.
    Runs inside a checkpointed, low-memory or distributed session never use it (they already save what they need).

    Example:
        ```python
        cache = CalibrationStatsCache()
        for ratio in (0.1, 0.2, 0.3):
            model = copy.deepcopy(dense)
            prune_(model, NumericalConfig(pruning_ratio=ratio), calibration=ids, stats_cache=cache)
        ```
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple] = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    @staticmethod
    def key(pruner: Any, calibration_digest: str | None, views: list[LayerView]) -> str | None:
        """The cache key of `pruner`'s calibration pass over the blocks `views` on the calibration data whose digest
        is `calibration_digest`, or `None` when it cannot be identified (no digest)."""
        cfg = pruner.config.calibration_key()
        calib = calibration_digest if pruner.requires_calibration else "data-free"
        if calib is None:
            return None
        h = hashlib.sha256()
        for view in views:
            for name, p in view.layer.named_parameters():
                if p.device.type == "meta":
                    return None
                h.update(name.encode())
                tensor_digest(h, p)
        blob = {"class": type(pruner).__qualname__, "config": cfg, "calibration": calib, "weights": h.hexdigest()}
        return json.dumps(blob, sort_keys=True, default=str)

    def get(self, key: str) -> tuple | None:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        return copy.deepcopy(entry)

    def put(self, key: str, value: tuple) -> None:
        self._entries[key] = copy.deepcopy(value)
