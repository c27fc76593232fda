"""What a user sees of a long low-memory or checkpointed run: one line per block, with time, ETA and memory.

The prune session (`pipeline.session`) reports every visit of a decoder block (`start` when the block becomes
resident, `stop` when it is put back). A pass over the blocks (a method's scoring pass, its pruning pass, the
measurements after it) starts whenever a block at or before the previous one is visited. Each finished visit is
logged at INFO level (the pass, the block, its wall and CPU seconds, the ETA of the pass from the mean time per block
so far, and the process's memory: resident, anonymous, file-backed, peak), and recorded for the report
(`report.info["progress"]`).
"""

from __future__ import annotations

import logging
import time

from ..storage.memory import process_memory

__all__ = ["BlockProgress"]

logger = logging.getLogger(__name__)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class BlockProgress:
    """Times and memory of every block visit of a run (see the module docstring).

    Args:
        num_blocks (`int`): decoder blocks of the model.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.records: list[dict] = []  # one per finished visit
        self._pass, self._last = 0, None
        self._pass_seconds: list[float] = []
        self._started: tuple[int, float, float] | None = None

    def start(self, i: int) -> None:
        if self._last is not None and i <= self._last:
            self._pass += 1
            self._pass_seconds = []
        self._last = i
        self._started = (i, time.perf_counter(), time.process_time())

    def stop(self, i: int) -> None:
        if self._started is None or self._started[0] != i:
            return
        _, t0, c0 = self._started
        self._started = None
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        self._pass_seconds.append(seconds)
        mem = process_memory()
        record = {"pass": self._pass, "block": i, "seconds": round(seconds, 3), "cpu_seconds": round(cpu, 3)}
        record.update({k: mem[k] for k in ("rss", "anon", "file", "peak") if k in mem})
        self.records.append(record)
        left = self.num_blocks - 1 - i
        eta = left * sum(self._pass_seconds) / len(self._pass_seconds)
        memory = (
            f"; memory {mem['rss'] / 1e9:.2f} GB (anonymous {mem['anon'] / 1e9:.2f}, file {mem['file'] / 1e9:.2f}), "
            f"peak {mem['peak'] / 1e9:.2f} GB"
            if mem
            else ""
        )
        logger.info("pass %d, block %d/%d: %s (CPU %s)%s%s", self._pass + 1, i + 1, self.num_blocks,
                    _duration(seconds), _duration(cpu), f", pass done in ~{_duration(eta)}" if left else "",
                    memory)  # fmt: skip

    def summary(self) -> dict:
        """Per pass: blocks visited, seconds, and the largest peak memory seen at the end of a block."""
        passes: dict[int, dict] = {}
        for r in self.records:
            p = passes.setdefault(r["pass"], {"blocks": 0, "seconds": 0.0, "cpu_seconds": 0.0, "peak": 0})
            p["blocks"] += 1
            p["seconds"] = round(p["seconds"] + r["seconds"], 3)
            p["cpu_seconds"] = round(p["cpu_seconds"] + r["cpu_seconds"], 3)
            p["peak"] = max(p["peak"], r.get("peak", 0))
        return {"passes": [passes[k] for k in sorted(passes)], "blocks": self.records}
