"""Timing in llama.cpp (through llama-cpp-python, the `llamacpp` extra): the `runtime=LlamaCppRuntime(tokenizer)` of
`evaluation.cost_model`'s `measure_cost_table`, `step_seconds`, `check_cost_table` and `measure_assemblies`.

Each timed model is written with `export_gguf` (per-layer shapes as llama.cpp's `deci` architecture) to a temporary
file and loaded with one batch of the whole prompt. A prefill step evaluates `context` tokens from an empty cache; a
decode step evaluates one token at position `context` after the cache was filled once (the cache is rewound to
`context` before every step, as llama-cpp-python's own `eval` does when it resumes a sequence). Only the last
position's logits are computed, as in a server. llama-cpp-python's `Llama` runs one sequence, so only batch-1
workloads are timed.

In llama.cpp's `deci` graph a layer without an MLP is skipped whole (its attention too), so the cost table times
attention beside the narrowest MLP and takes that MLP's own cost off, and puts a whole first layer in front of every
timed model, so that each runs in the `deci` graph a pruned model runs in (`needs_mlp_beside_attention`).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .gguf import OUTTYPES, export_gguf

__all__ = ["LlamaCppRuntime", "require_llama_cpp"]


def require_llama_cpp():
    """The `llama_cpp` module, or an ImportError that says how to install it."""
    try:
        import llama_cpp  # noqa: PLC0415  (optional dep: llama-cpp-python, extra [llamacpp])
    except ImportError as e:
        raise ImportError(
            "Timing in llama.cpp needs llama-cpp-python: pip install 'optimum-prune[llamacpp]' (its build flags for "
            "a portable AVX2 build are in pyproject.toml)."
        ) from e
    return llama_cpp


class LlamaCppRuntime:
    """Where `cost_model` times a step: llama.cpp on this CPU, each model written as GGUF with `tokenizer` (the
    model's: the vocabulary sets the output head) at `outtype`, run on `threads` threads (default: torch's)."""

    needs_mlp_beside_attention = True

    def __init__(self, tokenizer: Any, *, outtype: str = "f16", threads: int | None = None) -> None:
        if tokenizer is None:
            raise ValueError("LlamaCppRuntime writes each timed model as GGUF, which needs the model's tokenizer.")
        if outtype not in OUTTYPES:
            raise ValueError(f"outtype must be one of {sorted(OUTTYPES)}, got {outtype!r}.")
        self.llama_cpp = require_llama_cpp()
        self.tokenizer, self.outtype, self.threads = tokenizer, outtype, threads

    @property
    def label(self) -> str:
        return (f"llama.cpp (llama-cpp-python {self.llama_cpp.__version__}), {self.outtype}, "
                f"{self.threads or torch.get_num_threads()} thread(s), one batch per step")  # fmt: skip

    def step(self, model, workload, device: torch.device) -> _Step:
        if device.type != "cpu":
            raise ValueError("LlamaCppRuntime times llama-cpp-python's CPU build: leave device='cpu'.")
        if workload.batch != 1:
            raise ValueError(
                f"llama-cpp-python's Llama runs one sequence: time {workload.name} in transformers, or a batch-1 "
                f"workload ({workload.phase}:1:{workload.context}) in llama.cpp."
            )
        return _Step(self, model, workload)


class _Step:
    """One model at one workload in llama.cpp; `__call__()` times one step in seconds, `close()` frees it."""

    def __init__(self, runtime: LlamaCppRuntime, model, workload, seed: int = 0) -> None:
        self.workload, self.llm = workload, None
        self._dir = Path(tempfile.mkdtemp(prefix="optimum-prune-llamacpp-"))
        try:
            path = export_gguf(model, self._dir / "model.gguf", runtime.outtype, tokenizer=runtime.tokenizer)
            n_ctx = workload.context + 1
            threads = runtime.threads or torch.get_num_threads()
            self.llm = runtime.llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                                               n_threads=threads, n_threads_batch=threads, verbose=False)  # fmt: skip
        except BaseException:
            self.close()
            raise
        gen = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, int(model.config.vocab_size), (workload.context + 1,), generator=gen).tolist()
        self.start = 0 if workload.phase == "prefill" else workload.context
        if workload.phase == "decode":  # the cache filled once; every step rewinds to it
            self.llm.reset()
            self.llm.eval(self.tokens[: workload.context])

    def __call__(self) -> float:
        self.llm.n_tokens = self.start  # `eval` drops the cache from here on
        batch = self.tokens[: self.workload.context] if self.workload.phase == "prefill" else self.tokens[-1:]
        t0 = time.perf_counter()
        self.llm.eval(batch)
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()
            self.llm = None
        shutil.rmtree(self._dir, ignore_errors=True)
