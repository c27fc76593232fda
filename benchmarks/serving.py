"""Quality against measured speed: the shapes `ServingConfig` chooses for a workload's speed target, beside NP's
servable default, NP's per-layer shapes and uniform shapes at several ratios, on SmolLM2-135M (transformers, static
KV cache, fp32, one thread).

Per workload of `--workloads`: its cost table (`--tables DIR`, the files `optimum-prune cost-model -o DIR` writes;
measured here, one thread, where missing) and `ServingConfig(speedup=s, workload=w, cost_table=...)` for each `s` of
`--targets W=S1,S2`. Baselines: `NumericalConfig(pruning_ratio=r, allocation=a)` for every `r` of `--ratios` and `a` of
`--allocations`. Every model is pruned on the same calibration windows, saved (`--workdir`, so that a rerun resumes),
scored on the protocol's split of the three texts (document bootstrap 95% intervals), and timed at every workload
against the dense model, each pair interleaved (medians of `--rounds`; the speedup is dense / pruned), beside the
step time its workload's cost table predicts.

    OMP_NUM_THREADS=1 python benchmarks/serving.py --tables /tmp/tables --split test
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TQDM_DISABLE", "1")

import harness  # noqa: E402
import torch  # noqa: E402
from _intervals import geomean, geomean_delta_cell, ppl_cell  # noqa: E402

from optimum_prune import NumericalConfig, ServingConfig, load_pruned_model, prune_, save_pruned_model  # noqa: E402
from optimum_prune.evaluation.cost_model import CostTable, Workload, measure_cost_table, step_seconds  # noqa: E402
from optimum_prune.methods.numerical.serving_config import CANDIDATES  # noqa: E402
from optimum_prune.modeling.architectures import get_spec  # noqa: E402
from optimum_prune.modeling.shapes import layer_table  # noqa: E402

logger = logging.getLogger("serving")
RESULTS = harness.RESULTS_DIR
WORKLOADS = ("prefill:1:512", "decode:1:2048", "decode:16:2048")
TARGETS = ("prefill:1:512=1.2,1.4", "decode:1:2048=1.2,1.4", "decode:16:2048=1.3,1.6")
LABELS = {"servable": "NP servable (today's default)", "global": "NP per-layer", "uniform": "uniform"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), help="phase:batch:context each")
    p.add_argument("--targets", nargs="*", default=list(TARGETS), metavar="W=S1,S2",
                   help="ServingConfig speedups per workload")  # fmt: skip
    p.add_argument("--ratios", nargs="*", type=float, default=[0.2, 0.35, 0.5], help="baseline pruning ratios")
    p.add_argument("--allocations", nargs="*", default=["servable", "global", "uniform"], choices=sorted(LABELS))
    p.add_argument("--reader", default="all", choices=["all", "vllm", "llama.cpp"], help="ServingConfig.reader")
    p.add_argument("--error-scales", nargs="+", default=[None], choices=[None, "end_to_end", "residual", "absolute"],
                   help="ServingConfig.error_scale values (default: its default; several: one model each)")  # fmt: skip
    p.add_argument("--mlp-widths", nargs="+", default=[None], choices=[None, "knapsack", "ranked"],
                   help="ServingConfig.mlp_widths values (default: its default; each given: one model each)")  # fmt: skip
    p.add_argument(
        "--joint-probe-rounds",
        type=int,
        default=None,
        help="ServingConfig.joint_probe_rounds (default: its default; given: the names end in @jointN)",
    )
    p.add_argument("--candidates", nargs="*", default=None, choices=list(CANDIDATES),
                   help="ServingConfig.candidates (default: its default; given: the names end in @cand-<names>)")  # fmt: skip
    p.add_argument("--compensation-inputs", default=None, choices=["sequential", "dense"],
                   help="ServingConfig.compensation_inputs (default: its default; given: the names end in @refit-<it>)")  # fmt: skip
    p.add_argument("--num-samples", type=int, default=16, help="calibration windows (every model)")
    p.add_argument("--seq-len", type=int, default=512, help="their length in tokens")
    p.add_argument("--tables", default="/tmp/serving_tables", help="cost tables cost_table_<phase>_<b>_<ctx>.json")
    p.add_argument("--table-layers", type=int, default=24, help="layers per timing model of a table measured here")
    p.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds per pair")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--skip-timing", action="store_true", help="prune and score only (time in a later run)")
    p.add_argument("--keep-pruned", action="store_true",
                   help="keep the models a run of other library code pruned (each records its commit)")  # fmt: skip
    p.add_argument("--workdir", default="/tmp/serving_models", help="pruned models saved here (resume)")
    harness.add_protocol_args(p)
    harness.add_model_args(p)
    p.set_defaults(threads=1)
    p.add_argument("--output", default=str(RESULTS / "serving_smollm2.json"))
    return p.parse_args(argv)


def library_tree() -> str | None:
    """The git tree hash of `optimum_prune/` at HEAD (a rerun resumes the models pruned by the same code)."""
    return harness._git("rev-parse", "HEAD:optimum_prune")


def table_for(args, config, workload: Workload) -> tuple[CostTable, str]:
    path = Path(args.tables) / f"cost_table_{workload.phase}_{workload.batch}_{workload.context}.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        logger.info("measuring the cost table of %s (%d layers per timing model)", workload.name, args.table_layers)
        measure_cost_table(config, workload, layers=args.table_layers, rounds=args.rounds).save(path)
    return CostTable.load(path), str(path)


def configs(args, tables: dict[str, tuple[CostTable, str]]) -> dict[str, tuple[str, Any]]:
    """`{name: (kind, config)}` of every model."""
    out: dict[str, tuple[str, Any]] = {}
    for spec in args.targets:
        w, speedups = spec.split("=", 1)
        if w not in tables:
            continue
        for s in (float(x) for x in speedups.split(",")):
            for scale, widths in itertools.product(args.error_scales, args.mlp_widths):
                kw = {} if scale is None else {"error_scale": scale}
                kw.update({} if widths is None else {"mlp_widths": widths})
                name = f"serving@{w}@{s:g}" + (f"@{scale}" if len(args.error_scales) > 1 else "")
                name += "" if widths is None else f"@{widths}"
                if args.joint_probe_rounds is not None:
                    kw["joint_probe_rounds"] = args.joint_probe_rounds
                    name += f"@joint{args.joint_probe_rounds}"
                if args.compensation_inputs is not None:
                    kw["compensation_inputs"] = args.compensation_inputs
                    name += f"@refit-{args.compensation_inputs}"
                if args.candidates is not None:
                    kw["candidates"] = tuple(args.candidates)
                    name += "@cand-" + "+".join(args.candidates)
                out[name] = ("serving", ServingConfig(speedup=s, workload=w, cost_table=tables[w][1],
                                                      reader=args.reader, **kw))  # fmt: skip
    for a in args.allocations:
        for r in args.ratios:
            out[f"np_{a}@{r:g}"] = (a, NumericalConfig(pruning_ratio=r, allocation=a))
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    harness.setup_logging()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    harness.require_clean_tree(args)
    dense, tokenizer, model_desc = harness.load_model(args)
    proto = harness.Protocol.from_args(args)
    out = Path(args.output)
    res = json.loads(out.read_text()) if out.is_file() else {}
    env = harness.environment(argv, "serving.py")
    library = library_tree()
    for name, entry in list(res.get("models", {}).items()):  # resumed where the library's code is the same
        entry.setdefault("library_tree", res.get("library_tree"))
        if entry["library_tree"] != library and not args.keep_pruned:
            del res["models"][name]
            for by_model in res.get("speed", {}).values():
                by_model.pop(name, None)
    res["library_tree"] = library
    res.update(env, model=model_desc, args=vars(args), torch_threads=torch.get_num_threads())
    res.setdefault("models", {})
    res.setdefault("speed", {})
    workloads = [Workload.parse(w) for w in args.workloads]
    tables = {w.name: table_for(args, dense.config, w) for w in workloads}
    res["tables"] = {name: t.to_dict() for name, (t, _) in tables.items()}
    dense_rows = layer_table(dense, get_spec(dense))
    if "dense" not in res["models"]:
        ppl, docs = proto.evaluate(dense, tokenizer)
        res["models"]["dense"] = {"kind": "dense", "ppl": ppl, "docs": docs, "layers": dense_rows}
    ids = proto.calibration_ids(tokenizer, args.num_samples, args.seq_len)
    work = Path(args.workdir)
    todo = configs(args, tables)
    for name, (kind, cfg) in todo.items():
        folder = work / name.replace("@", "_").replace(":", "-")
        if name in res["models"] and (folder / "config.json").is_file():
            continue
        model = copy.deepcopy(dense)
        t0 = time.perf_counter()
        report = prune_(model, cfg, ids)
        seconds = time.perf_counter() - t0
        save_pruned_model(model, folder, tokenizer, format="deci" if kind in ("serving", "servable") else "auto",
                          overwrite=True)  # fmt: skip
        ppl, docs = proto.evaluate(model, tokenizer)
        res["models"][name] = {
            "kind": kind, "config": cfg.to_dict(), "ppl": ppl, "docs": docs, "layers": report.layers,
            "measured_ratio": report.measured, "prune_s": seconds, "assembly": report.info.get("assembly"),
            "joint_probes": report.info.get("joint_probes"), "candidates": report.info.get("candidates"),
            "folder": str(folder), "commit": env["versions"]["git_commit"], "library_tree": library,
        }  # fmt: skip
        logger.info("%s: %s (%.0f s)", name, {k: round(v, 2) for k, v in ppl.items()}, seconds)
        res["protocol"] = proto.record(res.get("protocol"))
        harness.write_results(res, out, "serving")
        del model
    if not args.skip_timing:
        for w in workloads:
            done = res["speed"].setdefault(w.name, {})
            for name, entry in res["models"].items():
                if name == "dense" or name in done:
                    continue
                model = load_pruned_model(entry["folder"], dtype=torch.float32)
                got = step_seconds({"dense": dense, name: model}, w, rounds=args.rounds, warmup=args.warmup)
                done[name] = {"dense_s": got["dense"]["median_s"], "model_s": got[name]["median_s"],
                              "speedup": got["dense"]["median_s"] / got[name]["median_s"],
                              "load_average": (harness.loadavg() or [None])[0]}  # fmt: skip
                logger.info("%s at %s: %.3fx", name, w.name, done[name]["speedup"])
                harness.write_results({**res, "protocol": proto.record(res.get("protocol"))}, out, "serving")
                del model
    res["protocol"] = proto.record(res.get("protocol"))
    harness.write_results(res, out, "serving")
    return res


# ----------------------------------------------------------------------------------------------------- markdown
def _label(name: str, entry: dict[str, Any]) -> str:
    if entry["kind"] == "serving":
        cfg = entry["config"]
        ranked = ", ranked widths" if cfg.get("mlp_widths") == "ranked" else ""
        joint = f", joint probes ×{cfg['joint_probe_rounds']}" if cfg.get("joint_probe_rounds") else ""
        cand = f", measured against {' + '.join(cfg['candidates'])}" if cfg.get("candidates") else ""
        default = "dense" if cfg.get("config_version", 0) >= 4 else "sequential"  # (the default from version 4)
        inputs = cfg.get("compensation_inputs", default)
        refit = "" if inputs == default else f", {'dense-input' if inputs == 'dense' else 'sequential'} refit"
        return (f"serving, {cfg['speedup']:g}x at {cfg['workload']}, {cfg['error_scale']}{ranked}{joint}{cand}"
                f"{refit}")  # fmt: skip
    ratio = name.split("@", 1)[1]
    return f"{LABELS.get(entry['kind'], entry['kind'])} {float(ratio):.0%}"


def _shape(entry: dict[str, Any]) -> str:
    layers = entry.get("layers") or []
    no_attn = sum(1 for r in layers if r["num_attention_heads"] == 0)
    kv = sorted({r["num_key_value_heads"] for r in layers if r["num_attention_heads"]})
    widths = [r["intermediate_size"] for r in layers]
    mean_w = sum(widths) / max(len(widths), 1)
    return f"{no_attn} no-attn, KV {'/'.join(map(str, kv))}, MLP mean {mean_w:.0f}"


def markdown(res: dict[str, Any]) -> str:
    texts = res["protocol"]["eval_texts"]
    models, speed = res["models"], res.get("speed", {})
    dense = models["dense"]
    lines = [
        f"# Quality against measured speed: serving shapes vs NP's shapes — {res['model']}",
        "",
        f"Generated by `benchmarks/serving.py` ({res['date']}, {res['host']['cpu']}, {res['host']['cpu_count']} CPUs; "
        f"torch {res['versions']['torch']}, {res['torch_threads']} thread(s), commit "
        f"{str(res['versions']['git_commit'])[:7]}).",
        "",
        harness.protocol_line(res),
        "- Models pruned at commit(s) "
        + ", ".join(sorted({str(e.get("commit") or "?")[:7] for n, e in models.items() if n != "dense"}))
        + "; timed at the commit above.",
        f"- Calibration: {res['args']['num_samples']} × {res['args']['seq_len']} BBC windows, the same for every "
        "model. Speed: one prefill of the context or one decode step with the context cached (transformers, static "
        "cache, fp32), each model timed interleaved with the dense model; speedup = dense / pruned (medians of "
        f"{res['args']['rounds']} rounds). Predicted: the workload's cost table.",
    ]
    earlier = sorted({str(v["timed_with"])[:7] for by in speed.values() for v in by.values() if v.get("timed_with")})
    if earlier:
        lines.append(f"- Speed rows of models refitted again on the same shapes (the layer tables identical) keep the "
                     f"timing of those shapes at commit(s) {', '.join(earlier)}; `speed_loaded` in the JSON holds their "
                     "re-timing on a loaded machine.")  # fmt: skip
    lines.append("")
    for w, by_model in speed.items():
        table = CostTable.from_dict(res["tables"][w]) if w in res.get("tables", {}) else None
        dense_pred = table.predict(dense["layers"]) if table else None
        rows = sorted(by_model.items(), key=lambda kv: kv[1]["speedup"])
        lines += [f"## {w}", "", "| model | shapes | speedup measured | predicted | "
                  + " | ".join(harness.text_label(t) for t in texts)
                  + " | Δ geometric mean vs dense | Δ vs NP servable nearest in speed |",
                  "|---|---|---|---|" + "---|" * len(texts) + "---|---|"]  # fmt: skip
        servable = [(n, v["speedup"]) for n, v in rows if models[n]["kind"] == "servable"]
        for name, s in rows:
            e = models[name]
            pred = f"{dense_pred / table.predict(e['layers']):.2f}x" if table else "–"
            cells = [ppl_cell(e["ppl"].get(t), (e.get("docs") or {}).get(t)) for t in texts]
            near = min(servable, key=lambda ns: abs(ns[1] - s["speedup"]), default=None)
            vs = (
                "–"
                if near is None or near[0] == name
                else (f"{geomean_delta_cell(e, models[near[0]], texts)} (vs {_label(near[0], models[near[0]])})")
            )
            lines.append(f"| {_label(name, e)} | {_shape(e)} | {s['speedup']:.2f}x | {pred} | " + " | ".join(cells)
                         + f" | {geomean_delta_cell(e, dense, texts)} | {vs} |")  # fmt: skip
        lines.append("")
    lines += ["## Every model", "", "| model | shapes | " + " | ".join(harness.text_label(t) for t in texts)
              + " | Δ geometric mean vs dense |", "|---|---|" + "---|" * len(texts) + "---|"]  # fmt: skip
    for name, e in models.items():
        cells = [ppl_cell(e["ppl"].get(t), (e.get("docs") or {}).get(t)) for t in texts]
        label = "dense" if name == "dense" else _label(name, e)
        delta = "–" if name == "dense" else geomean_delta_cell(e, dense, texts)
        lines.append(f"| {label} | {_shape(e)} | " + " | ".join(cells) + f" | {delta} |")
    lines.append("")
    lines += _widths_lines(models, texts)
    unused = [n for n in models if n != "dense" and not any(n in v for v in speed.values())]
    if unused:
        lines += [f"Not timed yet: {', '.join(unused)}.", ""]
    return "\n".join(lines)


def _widths_lines(models: dict[str, Any], texts: list[str]) -> list[str]:
    """Each `--mlp-widths ranked` model against the knapsack's at the same target, and each `--joint-probe-rounds`
    model against the same config without them (paired document bootstrap), with the screens' criterion: the mean
    over the targets of the log of the geometric mean of the texts' perplexities."""
    lines = _pairs_lines(models, texts, "@knapsack", "@ranked", "MLP widths: NP's ranking against the per-layer "
                         "knapsack", ("knapsack", "ranked"))  # fmt: skip
    for suffix in sorted({"@" + n.rsplit("@", 1)[1] for n in models if "@joint" in n}):
        rounds = suffix.removeprefix("@joint")
        lines += _pairs_lines(models, texts, "", suffix, f"Joint probes ({rounds} rounds) against the first solve",
                              ("first solve", f"joint ×{rounds}"), _ROUNDS)  # fmt: skip
    for suffix in sorted({"@" + n.rsplit("@", 1)[1] for n in models if "@refit-" in n}):
        lines += _pairs_lines(models, texts, "", suffix, f"Refit on the {suffix.removeprefix('@refit-')} network's "
                              "inputs against the default", ("default refit", suffix.removeprefix("@refit-")))  # fmt: skip
    for suffix in sorted({"@" + n.rsplit("@", 1)[1] for n in models if "@cand-" in n}):
        names = suffix.removeprefix("@cand-").replace("+", " + ")
        lines += _pairs_lines(models, texts, "", suffix, f"Measured candidates ({names}) against the solve alone",
                              ("solve", "measured"), _CANDIDATES)  # fmt: skip
    return lines


def _rounds_cell(entry: dict[str, Any]) -> str:
    """The joint-probe rounds of a model: attention sublayers removed and measured / predicted KL of their removal
    per round, and the round kept (empty for a model without them)."""
    record = entry.get("joint_probes")
    if not record:
        return ""
    rounds = ", ".join(f"{r['no_attention']} ({r['measured_removal_kl']:.3f} / {r['predicted_removal_kl']:.3f})"
                       for r in record["rounds"])  # fmt: skip
    return f" {rounds} | {record['chosen']} |"


def _candidates_cell(entry: dict[str, Any]) -> str:
    """The measured candidates of a model: each one's KL divergence on the probe sequences, and the one kept."""
    record = entry.get("candidates")
    if not record:
        return " | |"
    kl = ", ".join(f"{name} {value:.4f}" for name, value in record["probe_kl"].items())
    return f" {kl} | {record['chosen']} |"


# the extra columns of a pairs table: (header cells, alignment cells, the cells of a row's model)
_ROUNDS = (" attention removed per round (measured / predicted KL) | kept |", "---|---:|", _rounds_cell)
_CANDIDATES = (" probe KL per candidate | kept |", "---|---|", _candidates_cell)


def _pairs_lines(models: dict[str, Any], texts: list[str], base: str, other: str, title: str, labels,
                 extra: tuple | None = None) -> list[str]:  # fmt: skip
    """The table of each model named `X{other}` against `X{base}` at the same target (see `_widths_lines`), with the
    columns of `extra` (`_ROUNDS`, `_CANDIDATES`) if given."""
    stem = other if base else ""
    pairs = [(n.removesuffix(other) + base, n) for n in models if n.endswith(other)]
    pairs = [(k, r) for k, r in pairs if k in models and k != r and not (stem and k.endswith(stem))]
    if not pairs:
        return []
    head, align, cell = extra or ("", "", lambda entry: "")
    lines = [f"## {title}", "", f"| target | {labels[0]} | {labels[1]} | Δ geometric mean, {labels[1]} vs "
             f"{labels[0]} |" + head, "|---|---:|---:|---|" + align]  # fmt: skip
    means: dict[str, list[float]] = {labels[0]: [], labels[1]: []}
    for k, r in pairs:
        means[labels[0]].append(geomean(models[k]["ppl"], texts))
        means[labels[1]].append(geomean(models[r]["ppl"], texts))
        _, w, s, *_ = k.split("@")
        lines.append(f"| {s}x at {w} | {means[labels[0]][-1]:.2f} | {means[labels[1]][-1]:.2f} | "
                     f"{geomean_delta_cell(models[r], models[k], texts)} |" + cell(models[r]))  # fmt: skip
    crit = {key: sum(map(math.log, v)) / len(v) for key, v in means.items()}
    n = len(pairs)
    lines += ["", f"Mean over the {n} target{'s' * (n > 1)} of the log geometric mean (lower is better): "
              + ", ".join(f"{key} {value:.3f}" for key, value in crit.items()) + ".", ""]  # fmt: skip
    return lines


if __name__ == "__main__":
    main()
