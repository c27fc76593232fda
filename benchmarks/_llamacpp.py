"""llama.cpp measurements shared by the deployment benchmarks (through `llama-cpp-python`, the `llamacpp` extra).

- `perplexity`: the protocol of `optimum_prune.evaluation.perplexity` (one token stream, non-overlapping windows,
  every next-token prediction of a window scored, NLL accumulated in float64) on token ids given by the caller, so
  llama.cpp and transformers score exactly the same tokens.
- `tokenization_agreement`: llama.cpp's own tokenizer (from the GGUF file) against the Hugging Face tokenizer.
- `compare_speed`: prefill and decode tokens/s of several GGUF files, interleaved round by round (warm-up, medians).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import numpy as np

try:
    import llama_cpp
except ImportError as e:  # pragma: no cover - depends on the optional build
    raise ImportError(
        "These benchmarks run llama.cpp through llama-cpp-python: install the `llamacpp` extra with the AVX2 build "
        "flags given in pyproject.toml (pip install --no-cache-dir 'llama-cpp-python==0.3.36')."
    ) from e

__all__ = ["load", "perplexity", "tokenization_agreement", "compare_speed", "TOKENIZER_PROBES"]

# Unicode, code, runs of whitespace and special tokens: llama.cpp must split these exactly as transformers does.
TOKENIZER_PROBES = [
    "Hello world! The BBC's 3,141 reporters filed 42 stories in 2024.",
    "naïve café, Zürich — “quotes” ‘single’ … 日本語のテキスト, 中文, русский, 🚀🦙 emoji 😶‍🌫️",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\n\n\tif x  >=  10:\n\t\tpass",
    "   leading spaces and trailing   \n\n\n  \r\n mixed\t\t tabs   ",
    "I've been told he'll say 'RE you sure?' — we'VE a'lL",
    "3 33 333 3333 33333 3.3 3..3 ------======= ......!!!!!!??????",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|><|endoftext|>",
]


def load(path: str, *, n_ctx: int = 1024, n_threads: int = 2, logits_all: bool = False) -> llama_cpp.Llama:
    return llama_cpp.Llama(
        model_path=str(path),
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_ubatch=n_ctx,
        n_threads=n_threads,
        n_threads_batch=n_threads,
        logits_all=logits_all,
        verbose=False,
    )


def perplexity(llm: llama_cpp.Llama, ids: list[int], seq_len: int) -> float:
    """PPL of the GGUF model on `ids`, in windows of `seq_len` (`llm` loaded with `logits_all=True`)."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - seq_len + 1, seq_len):
        window = ids[start : start + seq_len]
        llm.reset()
        llm.eval(window)
        logits = np.asarray(llm.scores[: seq_len - 1], dtype=np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        nll -= float(logp[np.arange(seq_len - 1), window[1:]].sum())
        count += seq_len - 1
    return math.exp(nll / count)


def tokenization_agreement(llm: llama_cpp.Llama, tokenizer: Any, texts: list[str]) -> dict[str, Any]:
    """How many texts llama.cpp tokenizes exactly as `tokenizer` (special tokens parsed, the tokenizer's BOS rule)."""
    mismatches = []
    for text in texts:
        hf = tokenizer(text)["input_ids"]
        add_bos = bool(hf) and tokenizer.bos_token_id is not None and hf[0] == tokenizer.bos_token_id
        ours = llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)
        if list(ours) != list(hf):
            mismatches.append({"text": text[:80], "hf": hf[:40], "llama_cpp": list(ours)[:40]})
    return {"texts": len(texts), "identical": len(texts) - len(mismatches), "mismatches": mismatches}


def _one_run(llm: llama_cpp.Llama, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    t1 = time.perf_counter()
    for _ in range(new_tokens):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        llm.eval([token])
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def compare_speed(
    paths: dict[str, str], prompt: list[int], *, new_tokens: int = 32, warmup: int = 1, repeats: int = 5, n_threads=2
) -> dict[str, Any]:
    """Prefill and greedy-decode speed of GGUF files, interleaved; ratios against the first entry, from the medians
    (`*_speedup`) and from the fastest runs (`*_speedup_best`)."""
    models = {name: load(p, n_ctx=len(prompt) + new_tokens + 8, n_threads=n_threads) for name, p in paths.items()}
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
    names = list(models)
    for _ in range(warmup):
        for name in names:
            _one_run(models[name], prompt, new_tokens)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            samples[name].append(_one_run(models[name], prompt, new_tokens))
    out: dict[str, Any] = {"settings": {"prompt_len": len(prompt), "new_tokens": new_tokens, "repeats": repeats}}
    for name, runs in samples.items():
        prefill = statistics.median(s[0] for s in runs)
        decode = statistics.median(s[1] for s in runs)
        out[name] = {
            "prefill_s": prefill,
            "decode_s": decode,
            "prefill_tok_s": len(prompt) / prefill,
            "decode_tok_s": new_tokens / decode,
            # on a shared machine the fastest run is the least disturbed one
            "prefill_best_s": min(s[0] for s in runs),
            "decode_best_s": min(s[1] for s in runs),
            "samples": runs,
        }
    ref = out[names[0]]
    for name in names:
        for kind in ("prefill", "decode"):
            out[name][f"{kind}_speedup"] = ref[f"{kind}_s"] / out[name][f"{kind}_s"]
            out[name][f"{kind}_speedup_best"] = ref[f"{kind}_best_s"] / out[name][f"{kind}_best_s"]
    del models
    return out
