"""The serving shapes in llama.cpp: every model of a `benchmarks/serving.py` results file (its DeciLM folders) run
in llama.cpp (through llama-cpp-python, the `llamacpp` extra) against the dense model, and llama.cpp's own cost
table checked against them.

Per model, two things:

- **Conversion check**: its folder through llama.cpp's own `convert_hf_to_gguf.py` (`--outtype`; `export_gguf` for a
  folder in optimum-prune's own per-layer format, which that converter does not read), and llama.cpp's
  perplexity on the first `--check-tokens` tokens of each text's stream (windows of `--window`) beside
  transformers' on the very same token ids: every variant (KV merges, removed sublayers) as llama.cpp reads it.
- **Speed**: one step at each workload of the file, in llama.cpp, interleaved with the dense model (medians
  of `--rounds` after `--warmup`, per-round ratios with their interquartile range), timed as the cost model times a
  step (`evaluation.cost_model.step_seconds` with `export.LlamaCppRuntime`: the model written by `export_gguf`,
  whose tensors equal the converter's, each of the batch's sequences in its own KV stream as llama-server's slots;
  `prefill:B:C` evaluates B prompts of C tokens from an empty cache, `decode:B:C` one token of every sequence at
  position C, each timing the mean of `--decode-tokens` successive steps).

The llama.cpp cost table of each workload (`--tables DIR`, measured here where missing: `measure_cost_table` with
that runtime, `--table-layers` layers per timing model) predicts every model's step time; the table reports the
error against the measured time, over every model and over those whose shapes the table's variants express (the
assemblies and NP's servable widths; NP's per-layer and uniform shapes prune query heads, which no variant does).
Tables and speed rows timed by another runtime setting (`LlamaCppRuntime.label`) are timed again.

    OMP_NUM_THREADS=1 python benchmarks/serving_llamacpp.py --serving benchmarks/results/serving_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("TQDM_DISABLE", "1")

import harness  # noqa: E402
import torch  # noqa: E402
from harness import REPO_ROOT  # noqa: E402
from serving import _label, _shape  # noqa: E402

from optimum_prune import export_gguf, load_pruned_model  # noqa: E402
from optimum_prune.evaluation import perplexity  # noqa: E402
from optimum_prune.evaluation.cost_model import (  # noqa: E402
    NO_OP,
    CostTable,
    Workload,
    fit_cost_table,
    measure_assemblies,
    measure_cost_table,
    mlp_variants,
    random_assemblies,
    step_seconds,
)
from optimum_prune.modeling.architectures import get_spec  # noqa: E402
from optimum_prune.modeling.shapes import layer_table  # noqa: E402

logger = logging.getLogger("serving_llamacpp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--serving", default=str(harness.RESULTS_DIR / "serving_smollm2.json"),
                   help="a benchmarks/serving.py results file (its models' folders must exist)")  # fmt: skip
    p.add_argument("--models", nargs="*", default=None, help="names in that file (default: every model)")
    p.add_argument("--outtype", default="f16", choices=["f32", "f16", "bf16", "q8_0"], help="GGUF weight type")
    p.add_argument("--check-tokens", type=int, default=2048, help="tokens per text of the perplexity check")
    p.add_argument("--window", type=int, default=512, help="the perplexity check's window length")
    p.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds per pair")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="llama.cpp and torch threads")
    p.add_argument("--decode-tokens", type=int, default=8, help="decode steps per timing (their mean)")
    p.add_argument("--workloads", nargs="*", default=None, help="workloads of the file to time (default: all)")
    p.add_argument("--tables", default="/tmp/serving_tables_llamacpp", help="llama.cpp cost tables (reused)")
    p.add_argument("--table-layers", type=int, default=24, help="layers per timing model of a table measured here")
    p.add_argument("--fit", type=int, default=0, metavar="N",
                   help="also refit each table to N random full-depth assemblies timed in llama.cpp (fit_cost_table)")  # fmt: skip
    p.add_argument("--skip-timing", action="store_true", help="the conversion checks only (time in a later run)")
    p.add_argument("--workdir", default="/tmp/serving_llamacpp", help="converted files (kept: a rerun resumes)")
    p.add_argument("--output", default=str(harness.RESULTS_DIR / "serving_llamacpp_smollm2.json"))
    harness.add_tree_args(p)
    return p.parse_args(argv)


def convert(folder: Path, path: Path, outtype: str) -> str:
    """`folder` through llama.cpp's converter (its GPT-2 BPE vocabulary step where its DeciLM class stops on the
    tokenizer, as in `deploy.py`); returns which vocabulary step wrote it."""
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from llamacpp_converter import convert as run_converter

    tmp = path.with_suffix(".partial")
    try:
        run_converter(folder, tmp, outtype)
        vocab = "its own"
    except RuntimeError as e:
        if "Cannot find Llama BPE tokenizer" not in str(e):
            raise
        run_converter(folder, tmp, outtype, gpt2_vocab=True)
        vocab = "its GPT-2 BPE step"
    tmp.rename(path)
    return vocab


def _write_gguf(folder: Path, model, tokenizer, path: Path, outtype: str) -> str:
    """The GGUF file of a saved model: llama.cpp's own converter where it reads the folder (the DeciLM format, a plain
    Llama), else `export_gguf` (optimum-prune's own per-layer format, e.g. NP's per-layer shapes with pruned query
    heads, which llama.cpp's `deci` graph runs but its converter cannot read)."""
    model_type = json.loads((folder / "config.json").read_text())["model_type"]
    if model_type.startswith("optimum_pruned"):
        export_gguf(model, path, outtype, tokenizer=tokenizer)
        return "export_gguf (optimum-prune's per-layer format: llama.cpp's converter does not read it)"
    return f"llama.cpp's convert_hf_to_gguf.py ({convert(folder, path, outtype)} vocabulary step)"


def _predict(record: dict[str, Any], table: CostTable, rows, dense_rows, prefix: str = "") -> None:
    """The table's step times of the model and the dense model beside their measured ones in `record` (keys with
    `prefix`: `"fit_"` for the fitted table)."""
    record[prefix + "predicted_s"], record[prefix + "predicted_dense_s"] = (
        table.predict(rows),
        table.predict(dense_rows),
    )
    record[prefix + "prediction_error"] = record[prefix + "predicted_s"] / record["model_s"] - 1
    record[prefix + "dense_prediction_error"] = record[prefix + "predicted_dense_s"] / record["dense_s"] - 1


def main(argv: list[str] | None = None) -> dict:
    import _llamacpp  # the `llamacpp` extra; its absence raises an ImportError naming it
    import llama_cpp

    from optimum_prune.export import LlamaCppRuntime

    args = parse_args(argv)
    harness.setup_logging()
    torch.set_num_threads(args.threads)
    harness.require_clean_tree(args)
    serving = json.loads(Path(args.serving).read_text())
    sargs = argparse.Namespace(**{**serving["args"], "allow_dirty": True})
    dense, tok, model_desc = harness.load_model(sargs)
    proto = harness.Protocol.from_args(sargs)
    texts = proto.eval_texts
    out = Path(args.output)
    res = json.loads(out.read_text()) if out.is_file() else {}
    if res and res.get("serving_file_commit") != serving["versions"]["git_commit"]:
        res = {}  # another serving run's models: start again
    res.update(harness.environment(argv, "serving_llamacpp.py"), args=vars(args), model=model_desc)
    res["versions"]["llama_cpp"] = llama_cpp.__version__
    res["serving_file"] = Path(args.serving).name
    res["serving_file_commit"] = serving["versions"]["git_commit"]
    res["protocol"] = serving["protocol"]
    res.setdefault("models", {})
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    workloads = [w for w in serving["speed"] if args.workloads is None or w in args.workloads]
    res["workloads"], res["not_timed"] = workloads, [w for w in serving["speed"] if w not in workloads]
    runtime = LlamaCppRuntime(tok, outtype=args.outtype, threads=args.threads, decode_tokens=args.decode_tokens)
    if res.get("runtime") != runtime.label:  # timed another way: time again (the conversion checks stay)
        for entry in res["models"].values():
            entry.pop("speed", None)
        res.pop("tables", None)
        res.pop("tables_fitted", None)
    res["runtime"] = runtime.label

    def write() -> None:
        harness.write_results(res, out, "serving_llamacpp")

    tables, tables_fit = {}, {}
    Path(args.tables).mkdir(parents=True, exist_ok=True)
    for w in [] if args.skip_timing else workloads:
        path = Path(args.tables) / f"cost_table_{w.replace(':', '_')}.json"
        fitted = path.with_name(path.stem + f"_fit{args.fit}.json")
        if path.is_file() and CostTable.load(path).info.get("runtime") != runtime.label:
            path.unlink()  # timed another way
            fitted.unlink(missing_ok=True)
        if not path.is_file():
            logger.info("measuring llama.cpp's cost table of %s", w)
            with harness.timing_lock():
                measure_cost_table(dense.config, Workload.parse(w), layers=args.table_layers, rounds=args.rounds,
                                   warmup=args.warmup, runtime=runtime).save(path)  # fmt: skip
        tables[w] = CostTable.load(path)
        if args.fit and not fitted.is_file():  # refitted to whole random assemblies timed in llama.cpp
            logger.info("fitting it to %d random assemblies", args.fit)
            rows = random_assemblies(dense.config, args.fit)
            with harness.timing_lock():
                measured = measure_assemblies(dense.config, rows, Workload.parse(w), rounds=args.rounds,
                                              warmup=args.warmup, runtime=runtime)  # fmt: skip
            fit_cost_table(tables[w], rows, measured).save(fitted)
        if args.fit:
            tables_fit[w] = CostTable.load(fitted)
    if tables:
        res["tables"] = {w: t.to_dict() for w, t in tables.items()}
    if tables_fit:
        res["tables_fitted"] = {w: t.to_dict() for w, t in tables_fit.items()}
    dense_rows = layer_table(dense, get_spec(dense))
    folder = work / "dense_hf"  # the dense reference: its own folder (Llama in llama.cpp)
    if not (folder / "config.json").is_file():
        dense.save_pretrained(folder)
        tok.save_pretrained(folder)
    names = args.models or [n for n in serving["models"] if n != "dense"]
    for name, entry in res["models"].items():  # the current tables' predictions (a table measured again re-predicts)
        for w, record in entry.get("speed", {}).items():
            for table, prefix in ((tables.get(w), ""), (tables_fit.get(w), "fit_")):
                if table is not None:
                    _predict(record, table, serving["models"][name]["layers"], dense_rows, prefix)
    for name in ["dense", *names]:
        entry = res["models"].setdefault(name, {})
        entry["serving"] = _serving_record(serving, name, workloads)
        src = folder if name == "dense" else Path(serving["models"][name]["folder"])
        model = dense if name == "dense" else load_pruned_model(src, dtype=torch.float32).eval()
        if "ppl" not in entry:
            path = work / f"{name.replace('@', '_').replace(':', '-')}.{args.outtype}.gguf"
            if not path.is_file():
                entry["written_by"] = _write_gguf(src, model, tok, path, args.outtype)
            entry["mb"] = path.stat().st_size / 1e6
            llm = _llamacpp.load(path, n_ctx=args.window, n_threads=args.threads, logits_all=True)
            entry["ppl"] = {}
            for t in texts:
                ids = tok("\n\n".join(proto.texts(t)))["input_ids"][: args.check_tokens]
                entry["ppl"][t] = {"llama_cpp": _llamacpp.perplexity(llm, ids, args.window),
                                   "transformers": perplexity(model, tok, proto.texts(t), seq_len=args.window,
                                                              max_tokens=args.check_tokens)}  # fmt: skip
            del llm
            logger.info("%s: %s", name, entry["ppl"])
            write()
        speed = entry.setdefault("speed", {})
        rows = layer_table(model, get_spec(model))
        entry["in_table_variants"] = _in_table_variants(rows, dense.config)
        for w in [] if args.skip_timing else workloads:
            if w in speed or name == "dense":
                continue
            with harness.timing_lock():
                got = step_seconds({"dense": dense, name: model}, Workload.parse(w), rounds=args.rounds,
                                   warmup=args.warmup, runtime=runtime)  # fmt: skip
            d, m = got["dense"], got[name]
            speed[w] = {"dense_s": d["median_s"], "model_s": m["median_s"], "speedup": d["median_s"] / m["median_s"],
                        **harness.round_ratios(d["samples_s"], m["samples_s"], "speedup"),
                        "load_average": (harness.loadavg() or [None])[0]}  # fmt: skip
            _predict(speed[w], tables[w], rows, dense_rows)
            if w in tables_fit:
                _predict(speed[w], tables_fit[w], rows, dense_rows, "fit_")
            logger.info("%s at %s: %.3fx (predicted step %+.1f%%)", name, w, speed[w]["speedup"],
                        100 * speed[w]["prediction_error"])  # fmt: skip
            write()
        del model
    write()
    return res


# ----------------------------------------------------------------------------------------------------- markdown
def markdown(res: dict[str, Any]) -> str:
    texts = list(next(iter(res["models"].values())).get("ppl", {})) if res["models"] else []
    a = res["args"]
    lines = [
        f"# The serving shapes in llama.cpp — {res['model']}",
        "",
        f"Generated by `benchmarks/serving_llamacpp.py` ({res['date']}, {res['host']['cpu']}, "
        f"{res['host']['cpu_count']} CPUs; llama-cpp-python {res['versions'].get('llama_cpp')}, {a['threads']} "
        f"thread(s), commit {str(res['versions']['git_commit'])[:7]}).",
        "",
        harness.protocol_line({"protocol": res["protocol"]}),
        f"- The models of `{res['serving_file']}` (its run at commit {str(res['serving_file_commit'])[:7]}: their "
        "perplexities with intervals, transformers' speed and its cost table are there), each run in llama.cpp "
        f"({a['outtype']}) interleaved with the dense model, one step per round (medians of {a['rounds']} rounds after "
        f"{a['warmup']} warm-up; speedup = dense / model with the IQR of the per-round ratios, a tie where it holds "
        + (
            "1), each sequence of a batch in its own KV stream (llama-server's slots with an explicit --parallel). "
            "Prefill: the prompts' evaluation from an empty cache; decode: one token of every sequence at the "
            f"context's position, each timing the mean of {a.get('decode_tokens', 1)} successive steps. Runtime: "
            f"{res['runtime']}."
            if "runtime" in res  # (files timed before the runtime was recorded: one sequence, one step per timing)
            else "1). Prefill: the prompt's evaluation from an empty cache; decode: one token at the context's "
            "position, one step per timing (one sequence through llama-cpp-python's `Llama`, the runtime before a KV "
            "stream per sequence)."
        ),
        "- Predicted: llama.cpp's own cost table of the workload (`measure_cost_table` with `LlamaCppRuntime`, "
        f"{res['tables'][next(iter(res['tables']))]['info']['layers'] if res.get('tables') else '?'} layers per "
        "timing model); error = predicted / measured step time − 1. Dense reference: the dense model (Llama in "
        "llama.cpp). Not timed here: " + (", ".join(res.get("not_timed", [])) or "none") + ".",
        f"- Conversion check: each folder through llama.cpp's own `convert_hf_to_gguf.py` (NP's per-layer shapes, in "
        "optimum-prune's own format, through `export_gguf`), llama.cpp's perplexity "
        f"against transformers' (fp32) on the same first {a['check_tokens']} tokens of each text, windows of "
        f"{a['window']}.",
        "",
    ]
    for w in res.get("workloads", []):
        fit = w in res.get("tables_fitted", {})
        lines += [f"## {w}", "", "| model | shapes | llama.cpp speedup | predicted (llama.cpp table) | step error | "
                  + ("fitted table: predicted | step error | " if fit else "")
                  + "transformers speedup | predicted (transformers table) |",
                  "|---|---|---|---|---:|" + ("---|---:|" if fit else "") + "---|---|"]  # fmt: skip
        rows = [e for e in res["models"].values() if w in e.get("speed", {})]
        errors, inside = [], []
        for e in sorted(rows, key=lambda e: e["speed"][w]["speedup"]):
            s, sv = e["speed"][w], e["serving"]
            errors.append(s["prediction_error"])
            if e.get("in_table_variants"):
                inside.append(s["prediction_error"])
            cells = [f"{harness.round_median(s, 'speedup'):.2f}x{harness.spread_note(s, 'speedup')}",
                     f"{s['predicted_dense_s'] / s['predicted_s']:.2f}x", f"{s['prediction_error']:+.1%}",
                     *([f"{s['fit_predicted_dense_s'] / s['fit_predicted_s']:.2f}x", f"{s['fit_prediction_error']:+.1%}"]
                       if fit and "fit_predicted_s" in s else ["–", "–"] if fit else []),
                     *(f"{v:.2f}x" if v is not None else "–" for v in (sv["transformers"].get(w),
                                                                       sv["predicted"].get(w)))]  # fmt: skip
            lines.append(f"| {sv['label']} | {sv['shape']} | " + " | ".join(cells) + " |")
        if errors:
            dense = [e["speed"][w]["dense_prediction_error"] for e in rows]
            lines += ["", f"Step-time prediction error: largest {max(errors, key=abs):+.1%}, mean |error| "
                      f"{sum(abs(x) for x in errors) / len(errors):.1%} over {len(errors)} models; the dense model "
                      f"(timed in each pair) {min(dense):+.1%} to {max(dense):+.1%}."]  # fmt: skip
            if inside:
                lines += [f"Over the {len(inside)} models whose shapes the table's variants express (the assemblies "
                          f"and NP's servable widths): largest {max(inside, key=abs):+.1%}, mean |error| "
                          f"{sum(map(abs, inside)) / len(inside):.1%}."]  # fmt: skip
        if errors and fit and any("fit_prediction_error" in e["speed"][w] for e in rows):
            fits = [e["speed"][w].get("fit_prediction_error") for e in rows]
            fits = [x for x in fits if x is not None]
            lines += [f"The fitted table ({res['tables_fitted'][w]['info']['fit']['assemblies']} random assemblies): "
                      f"largest {max(fits, key=abs):+.1%}, mean |error| {sum(map(abs, fits)) / len(fits):.1%}."]  # fmt: skip
        lines.append("")
    lines += ["## Conversion check (perplexity, llama.cpp / transformers)", "",
              "| model | GGUF by | file MB | " + " | ".join(harness.text_label(t) for t in texts)
              + " | largest relative gap |", "|---|---|---:|" + "---|" * len(texts) + "---:|"]  # fmt: skip
    for e in res["models"].values():
        if "ppl" in e:
            gap = max(abs(p["llama_cpp"] / p["transformers"] - 1) for p in e["ppl"].values())
            cells = [f"{p['llama_cpp']:.3f} / {p['transformers']:.3f}" for p in e["ppl"].values()]
            by = "export_gguf" if e.get("written_by", "").startswith("export_gguf") else "llama.cpp's converter"
            lines.append(
                f"| {e['serving']['label']} | {by} | {e['mb']:.0f} | " + " | ".join(cells) + f" | {gap:.2%} |"
            )
    lines.append("")
    return "\n".join(lines)


def _in_table_variants(rows: list[dict[str, Any]], config) -> bool:
    """Whether every layer is a variant of the cost tables: all query heads or none, an MLP width in the format's
    steps (`cost_model.mlp_variants`)."""
    widths = {0, *(m for m in mlp_variants(config) if m != NO_OP)}
    return all(r["num_attention_heads"] in (0, config.num_attention_heads) and r["intermediate_size"] in widths
               for r in rows)  # fmt: skip


def _serving_record(serving: dict[str, Any], name: str, workloads: list[str]) -> dict[str, Any]:
    """What the serving file says of a model: its label and shapes, transformers' speedup and that table's
    prediction."""
    if name == "dense":
        return {"label": "dense", "shape": "dense", "transformers": {}, "predicted": {}}
    entry, dense = serving["models"][name], serving["models"]["dense"]
    predicted = {}
    for w in workloads:
        if w in serving.get("tables", {}):
            table = CostTable.from_dict(serving["tables"][w])
            predicted[w] = table.predict(dense["layers"]) / table.predict(entry["layers"])
    return {
        "label": _label(name, entry),
        "shape": _shape(entry),
        "predicted": predicted,
        "transformers": {w: serving["speed"].get(w, {}).get(name, {}).get("speedup") for w in workloads},
    }


if __name__ == "__main__":
    main()
