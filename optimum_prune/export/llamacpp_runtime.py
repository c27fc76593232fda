"""Timing in llama.cpp (through llama-cpp-python, the `llamacpp` extra): the `runtime=LlamaCppRuntime(tokenizer)` of
`evaluation.cost_model`'s `measure_cost_table`, `step_seconds`, `check_cost_table` and `measure_assemblies`.

Each timed model is written with `export_gguf` (per-layer shapes as llama.cpp's `deci` architecture) to a temporary file
and run through llama.cpp's C API as a server runs it: `batch` sequences, each in its own stream of the KV cache
(`kv_unified=False`, as llama-server's slots run with an explicit `--parallel N`). A prefill step evaluates `batch`
prompts of `context` tokens from an empty cache in one batch (micro-batches of one prompt), computing the last
position's logits of each. A decode step evaluates one token of every sequence at position `context` (logits of all):
the first sequence's cache is filled once (on every core: untimed) and copied into the other streams, and every timing
rewinds all of them to `context`. One timing runs `decode_tokens` successive decode steps (positions `context` onwards)
and returns their mean, so that the timer's and Python's overheads, and the noise of a few-millisecond step, weigh less.

In llama.cpp's `deci` graph a layer without an MLP is skipped whole (its attention too), so the cost table times
attention beside the narrowest MLP and takes that MLP's own cost off, and puts a whole first layer in front of every
timed model, so that each runs in the `deci` graph a pruned model runs in (`needs_mlp_beside_attention`).
"""

from __future__ import annotations

import logging
import os
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
    model's: the vocabulary sets the output head) at `outtype`, run on `threads` threads (default: torch's);
    `decode_tokens` decode steps per timing (their mean)."""

    needs_mlp_beside_attention = True

    def __init__(
        self, tokenizer: Any, *, outtype: str = "f16", threads: int | None = None, decode_tokens: int = 8
    ) -> None:
        if tokenizer is None:
            raise ValueError("LlamaCppRuntime writes each timed model as GGUF, which needs the model's tokenizer.")
        if outtype not in OUTTYPES:
            raise ValueError(f"outtype must be one of {sorted(OUTTYPES)}, got {outtype!r}.")
        if decode_tokens < 1:
            raise ValueError(f"decode_tokens is the number of decode steps per timing (>= 1), got {decode_tokens}.")
        self.llama_cpp = require_llama_cpp()
        self.tokenizer, self.outtype, self.threads, self.decode_tokens = tokenizer, outtype, threads, decode_tokens
        quiet = logging.getLogger("llama-cpp-python")  # llama-cpp-python's log callback prints below its level
        if quiet.level == logging.NOTSET:
            quiet.setLevel(logging.ERROR)

    @property
    def label(self) -> str:
        return (f"llama.cpp (llama-cpp-python {self.llama_cpp.__version__}), {self.outtype}, "
                f"{self.threads or torch.get_num_threads()} thread(s), a KV stream per sequence, "
                f"{self.decode_tokens} decode step(s) per timing")  # fmt: skip

    def check(self, workload) -> None:
        """Refuse a workload llama.cpp cannot run (more sequences than its build takes at once)."""
        max_seq = int(self.llama_cpp.llama_max_parallel_sequences())
        if workload.batch > max_seq:
            raise ValueError(
                f"llama.cpp runs at most {max_seq} sequences at once; {workload.name} has {workload.batch}: time a "
                "smaller batch (or this one in transformers)."
            )

    def step(self, model, workload, device: torch.device) -> _Step:
        if device.type != "cpu":
            raise ValueError("LlamaCppRuntime times llama-cpp-python's CPU build: leave device='cpu'.")
        self.check(workload)
        return _Step(self, model, workload)


class _Step:
    """One model at one workload in llama.cpp; `__call__()` times one step in seconds, `close()` frees it."""

    def __init__(self, runtime: LlamaCppRuntime, model, workload, seed: int = 0) -> None:
        lc, w = runtime.llama_cpp, workload
        self.lc, self.workload, self._model = lc, w, None
        self._ctx = None
        self._batches: list[Any] = []
        self._dir = Path(tempfile.mkdtemp(prefix="optimum-prune-llamacpp-"))
        try:
            path = export_gguf(model, self._dir / "model.gguf", runtime.outtype, tokenizer=runtime.tokenizer)
            lc.llama_backend_init()
            self._model = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
            if not self._model:
                raise RuntimeError(f"llama.cpp could not load the GGUF written for timing ({path}).")
            self.steps = 1 if w.phase == "prefill" else runtime.decode_tokens
            threads = runtime.threads or torch.get_num_threads()
            params = lc.llama_context_default_params()
            params.n_ctx = w.batch * (w.context + (0 if w.phase == "prefill" else self.steps))
            params.n_seq_max, params.kv_unified = w.batch, False
            params.n_batch = w.batch * w.context if w.phase == "prefill" else max(w.context, w.batch)
            params.n_ubatch = max(w.context, w.batch)
            params.n_threads = params.n_threads_batch = threads
            self._ctx = lc.llama_init_from_model(self._model, params)
            if not self._ctx:
                raise RuntimeError(f"llama.cpp could not make a context for {w.name}.")
            self._memory = lc.llama_get_memory(self._ctx)
            gen = torch.Generator().manual_seed(seed)
            prompt = torch.randint(0, int(model.config.vocab_size), (w.batch, w.context), generator=gen).tolist()
            if w.phase == "prefill":
                self.start = 0
                tokens = [(t, p, s, p == w.context - 1) for s in range(w.batch) for p, t in enumerate(prompt[s])]
                self._batches.append(self._batch(tokens))
            else:  # the first sequence's cache filled once, copied into every other stream
                self.start = w.context
                fill = self._batch([(t, p, 0, p == w.context - 1) for p, t in enumerate(prompt[0])])
                lc.llama_set_n_threads(self._ctx, os.cpu_count() or threads, os.cpu_count() or threads)  # (untimed)
                self._decode(fill)
                lc.llama_set_n_threads(self._ctx, threads, threads)
                lc.llama_batch_free(fill)
                for s in range(1, w.batch):
                    lc.llama_memory_seq_cp(self._memory, 0, s, -1, -1)
                nxt = torch.randint(0, int(model.config.vocab_size), (self.steps, w.batch), generator=gen).tolist()
                for j in range(self.steps):
                    self._batches.append(self._batch([(nxt[j][s], w.context + j, s, True) for s in range(w.batch)]))
        except BaseException:
            self.close()
            raise

    def _batch(self, tokens: list[tuple[int, int, int, bool]]):
        """A `llama_batch` of `(token, position, sequence, logits)` rows."""
        batch = self.lc.llama_batch_init(len(tokens), 0, 1)
        batch.n_tokens = len(tokens)
        for i, (token, pos, seq, logits) in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
            batch.seq_id[i][0] = seq
        return batch

    def _decode(self, batch) -> None:
        code = self.lc.llama_decode(self._ctx, batch)
        if code != 0:
            raise RuntimeError(f"llama_decode failed ({code}) at {self.workload.name}.")

    def __call__(self) -> float:
        self.lc.llama_memory_seq_rm(self._memory, -1, self.start, -1)  # every sequence back to `start`
        t0 = time.perf_counter()
        for batch in self._batches:
            self._decode(batch)
        return (time.perf_counter() - t0) / self.steps

    def close(self) -> None:
        for batch in self._batches:
            self.lc.llama_batch_free(batch)
        self._batches = []
        if self._ctx is not None:
            self.lc.llama_free(self._ctx)
            self._ctx = None
        if self._model is not None:
            self.lc.llama_model_free(self._model)
            self._model = None
        shutil.rmtree(self._dir, ignore_errors=True)
