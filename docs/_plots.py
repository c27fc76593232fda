"""Plots of the Results pages, drawn from the results JSON when the site is built (used by `docs/hooks.py`).

`<!-- plot: NAME -->` on a page becomes an inline SVG figure made by `PLOTS[NAME]` from the files under
`benchmarks/results/`; a plot never holds a number that is not in a results file. Where a run stored a bootstrap
interval (`ppl_ci` beside a perplexity, `[low, high]`), the plot draws it as an error bar.
"""

from __future__ import annotations

import io
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullFormatter  # noqa: E402

RESULTS_DIR = Path("benchmarks") / "results"
TEXTS = (("bbc", "BBC news (calibration domain)"), ("python_docs", "Python docs"), ("kjv", "KJV Bible"))
STYLE = {
    "numerical": ("Numerical Pruning", "C0", "o"),
    "numerical_global": ("NP, per-layer allocation", "C9", "D"),
    "flap": ("FLAP", "C1", "s"),
    "spp": ("SPP", "C2", "^"),
    "magnitude": ("Magnitude", "C7", "x"),
}

plt.rcParams.update({"svg.hashsalt": "optimum-prune", "svg.fonttype": "none", "font.size": 9})


class PlotError(ValueError):
    """A plot's results file is missing or lacks the fields the plot reads."""


def _load(root: Path, name: str) -> dict:
    path = root / RESULTS_DIR / f"{name}.json"
    if not path.exists():
        raise PlotError(f"plot: no results file {path}.")
    return json.loads(path.read_text(encoding="utf-8"))


def _svg(fig, caption: str) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    svg = buf.getvalue()
    svg = svg[svg.index("<svg") :]  # drop the XML prolog and doctype: the figure is inline HTML
    return f'<figure class="op-plot">\n{svg}\n<figcaption>{caption}</figcaption>\n</figure>\n'


def _log_axis(ax) -> None:
    """A log-scale y axis labelled with plain numbers (10, 30, 100), not powers of ten."""
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _err(values: list[float], cis: list[list[float] | None]) -> list[list[float]] | None:
    if not any(cis):
        return None
    lo = [v - c[0] if c else 0.0 for v, c in zip(values, cis)]
    hi = [c[1] - v if c else 0.0 for v, c in zip(values, cis)]
    return [lo, hi]


def structured_quality(root: Path) -> str:
    """Perplexity against the pruning ratio, one panel per text: each structured method at its defaults, NP also with
    the per-layer allocation (`structured_smollm2_servable.json`, test split), the dense model as a dashed line."""
    res = _load(root, "structured_smollm2_servable")
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.1), sharex=True)
    for ax, (text, title) in zip(axes, TEXTS):
        for method in ("numerical", "numerical_global", "flap"):
            runs = sorted((r for r in res["runs"] if r["method"] == method), key=lambda r: r["ratio"])
            if not runs:
                continue
            xs = [r["ratio"] for r in runs]
            ys = [r["ppl_texts"][text] for r in runs]
            cis = [r.get("ppl_ci", {}).get(text) for r in runs]
            label, color, marker = STYLE[method]
            ax.errorbar(xs, ys, yerr=_err(ys, cis), label=label, color=color, marker=marker, capsize=2)
        ax.axhline(res["dense"]["ppl_texts"][text], color="k", ls="--", lw=0.8, label="dense")
        _log_axis(ax)
        ax.set_title(title)
        ax.set_xlabel("pruning ratio")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("perplexity (log scale)")
    axes[0].legend(frameon=False)
    return _svg(
        fig,
        "Perplexity of SmolLM2-135M pruned by Numerical Pruning (its default allocation here: servable) and FLAP at "
        "their defaults, and by NP with the per-layer allocation, on the test documents of three texts "
        "(<code>structured_smollm2_servable</code>).",
    )


def structured_speed(root: Path) -> str:
    """Prefill and decode speedup against the pruning ratio (median of interleaved rounds, IQR as bars) beside the
    parameter ratio dense / pruned, the ideal of a compute-bound forward (`structured_smollm2_servable.json`)."""
    res = _load(root, "structured_smollm2_servable")
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.1), sharey=True)
    for ax, kind in zip(axes, ("prefill", "decode")):
        ideal = {}
        for method in ("numerical", "numerical_global", "flap"):
            runs = sorted(
                (r for r in res["runs"] if r["method"] == method and r.get("speed")), key=lambda r: r["ratio"]
            )
            if not runs:
                continue
            xs = [r["ratio"] for r in runs]
            spread = [r["speed"].get(f"{kind}_speedup_spread") for r in runs]
            ys = [s["median"] if s else r["speed"][f"{kind}_speedup"] for r, s in zip(runs, spread)]
            cis = [[s["q1"], s["q3"]] if s else None for s in spread]
            label, color, marker = STYLE[method]
            ax.errorbar(xs, ys, yerr=_err(ys, cis), label=label, color=color, marker=marker, capsize=2)
            for r in runs:
                ideal.setdefault(r["ratio"], r["params_before"] / r["params"])
        if ideal:
            xs = sorted(ideal)
            ax.plot(xs, [ideal[x] for x in xs], color="k", ls=":", label="parameter ratio")
        ax.axhline(1.0, color="k", lw=0.6)
        ax.set_title(f"{kind} (batch 1)")
        ax.set_xlabel("pruning ratio")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("speedup over dense")
    axes[0].legend(frameon=False)
    return _svg(
        fig,
        "Speed of the pruned SmolLM2-135M over the dense model in transformers, float32 on a 2-core CPU: median of "
        "interleaved rounds (bars: interquartile range; prefill 256 tokens, decode 16 tokens), beside the ratio of "
        "parameters (<code>structured_smollm2_servable</code>).",
    )


def gpu_speed(root: Path) -> str:
    """Speedup over dense of each allocation at Llama-3.1-8B shapes on a GPU, CUDA graphs, as a share of its ideal
    (FLOP ratio for prefill, bytes ratio for decode; `structured_gpu_large_H200.json`)."""
    res = _load(root, "structured_gpu_large_H200")
    groups = [g for g in res["groups"] if g["shape"] == "llama-3.1-8b" and "widths rounded" not in g["title"]]
    if not groups:
        raise PlotError("plot: structured_gpu_large_H200.json has no llama-3.1-8b allocation group.")
    fig, axes = plt.subplots(1, len(groups), figsize=(5.4 * len(groups), 3.2), sharey=True, squeeze=False)
    for ax, group in zip(axes[0], groups):
        scenarios = [sc for sc in group["scenarios"] if sc.get("mode") == "graph" and "models" in sc]
        labels = [m for m in group["models"] if m != "dense"]
        width = 0.8 / max(len(labels), 1)
        for k, label in enumerate(labels):
            cells = [sc["models"].get(label, {}) for sc in scenarios]
            ys = [c["speedup_spread"]["median"] if c.get("speedup_spread") else float("nan") for c in cells]
            ideal = [c.get("ideal", float("nan")) for c in cells]
            xs = [j + k * width for j in range(len(scenarios))]
            ax.bar(xs, ys, width, label=label.rsplit(" ", 1)[0], color=f"C{k}")
            ax.scatter(xs, ideal, marker="_", s=120, color="k", zorder=3, label="ideal" if k == 0 else None)
        names = [
            f"prefill\n{sc['tokens']}×{sc['batch']}" if sc["kind"] == "prefill" else f"decode\nbatch {sc['batch']}"
            for sc in scenarios
        ]
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(scenarios))], names, fontsize=7)
        ax.axhline(1.0, color="k", lw=0.6)
        ax.set_title(group["title"].split(" (")[0])
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].set_ylabel("speedup over dense")
    axes[0][0].legend(frameon=False, fontsize=7)
    return _svg(
        fig,
        f"Speedup over dense of random-weight models in Llama-3.1-8B's shapes on an {res['device']}, bf16, replayed "
        "CUDA graphs: median of interleaved rounds; black ticks: the ideal (FLOP ratio for prefill, bytes ratio for a "
        "decode step). NP: NP's per-layer shapes; servable: every attention head kept, MLP widths in blocks of 256 "
        "(<code>structured_gpu_large_H200</code>).",
    )


def unstructured_quality(root: Path) -> str:
    """Perplexity of each unstructured / N:M method at 50% and 2:4, per text (`unstructured_smollm2_protocol.json`)."""
    res = _load(root, "unstructured_smollm2_protocol")
    runs = [r for r in res["runs"] if r.get("ppl_texts")]
    patterns = ("unstructured", "2:4")
    methods = list(dict.fromkeys(r["key"].split("|")[0] for r in runs))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2), sharey=False)
    width = 0.8 / max(len(methods), 1)
    for ax, pattern in zip(axes, patterns):
        for k, name in enumerate(methods):
            row = next((r for r in runs if r["pattern"] == pattern and r["key"].split("|")[0] == name), None)
            if row is None:
                continue
            ys = [row["ppl_texts"][t] for t, _ in TEXTS]
            cis = [row.get("ppl_ci", {}).get(t) for t, _ in TEXTS]
            xs = [j + k * width for j in range(len(TEXTS))]
            ax.bar(xs, ys, width, yerr=_err(ys, cis), label=name, capsize=2)
        dense = res["dense_ppl_texts"]
        for j, (t, _) in enumerate(TEXTS):
            ax.hlines(dense[t], j - width / 2, j + 0.8 - width / 2, colors="k", linestyles="--", lw=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(TEXTS))], [t for _, t in TEXTS], fontsize=8)
        _log_axis(ax)
        ax.set_title("50% unstructured" if pattern == "unstructured" else "2:4")
        ax.grid(alpha=0.3, axis="y", which="both")
    axes[0].set_ylabel("perplexity (log scale)")
    axes[1].legend(frameon=False, fontsize=7, ncol=2)
    return _svg(
        fig,
        "Perplexity of SmolLM2-135M at 50% unstructured and 2:4 sparsity, test split, each method at its defaults "
        "(dashed: dense; <code>unstructured_smollm2_protocol</code>).",
    )


def vision_accuracy(root: Path) -> str:
    """DINOv2-S/14 top-1 on CIFAR-10 test images against the ratio, before and after fine-tuning."""
    res = _load(root, "vision_dinov2s_cifar10_protocol")
    runs = res["runs"]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.1), sharey=True)
    for ax, key, title in zip(axes, ("accuracy_before_ft", "accuracy_after_ft"), ("before fine-tuning", "after")):
        for method in ("numerical", "flap", "spp", "magnitude"):
            pts = sorted((r["ratio"], r[key]) for r in runs.values() if r.get("method") == method and key in r)
            if pts:
                label, color, marker = STYLE[method]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, color=color, marker=marker)
        ax.axhline(runs["dense"]["accuracy"], color="k", ls="--", lw=0.8, label="dense")
        ax.set_title(title)
        ax.set_xlabel("pruning ratio")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("top-1 accuracy")
    axes[0].legend(frameon=False)
    return _svg(
        fig,
        "DINOv2-S/14 with a linear probe on CIFAR-10 (1,000 test images), pruned at 20% and 40%, before and after "
        "a short fine-tuning (<code>vision_dinov2s_cifar10_protocol</code>).",
    )


def recovery_curves(root: Path) -> str:
    """Perplexity against training tokens per text, one line per recovery recipe and pruned model (checkpoints of one
    run each), the pruned model as a dotted line and dense as a dashed one (`recovery_curves_smollm2_test.json`)."""
    res = _load(root, "recovery_curves_smollm2_test")
    rows = res["rows"]
    fig, axes = plt.subplots(1, len(TEXTS), figsize=(10, 3.2))
    colors = {"lora": "C0", "full": "C1", "kd": "C2"}
    styles = ["-", "--", ":", "-."]
    for ax, (text, title) in zip(axes, TEXTS):
        for row, ls in zip(rows.values(), styles):
            if text not in row.get("pruned", {}).get("ppl", {}):
                continue
            ax.axhline(row["pruned"]["ppl"][text], color="0.6", ls=":", lw=0.8)
            for run in row.get("runs", {}).values():
                pts = [(p["tokens"], p["ppl"][text]) for p in run["points"]]
                # trained on several texts' calibration splits (the others: BBC's alone)
                mixed = len(run.get("train_texts", {"bbc": None})) > 1
                ax.plot([t for t, _ in pts], [v for _, v in pts], ls=ls, marker="s" if mixed else "o", ms=3,
                        color="C3" if mixed else colors.get(run.get("recipe"), "C7"),
                        label=f"{row['name']}, {run['label']}")  # fmt: skip
        ax.axhline(res["dense"]["ppl"][text], color="k", ls="--", lw=0.8, label="dense")
        ax.set_xscale("log", base=2)
        _log_axis(ax)
        ax.set_title(title)
        ax.set_xlabel("training tokens")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("perplexity (test split)")
    axes[-1].legend(frameon=False, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    return _svg(
        fig,
        "Recovery of SmolLM2-135M after pruning, perplexity on the test split against training tokens (checkpoints of "
        "one run per recipe; grey dotted: each pruned model before recovery; <code>recovery_curves_smollm2_test"
        "</code>).",
    )


def serving_speed(root: Path) -> str:
    """Geometric-mean perplexity of the three test texts against the measured speedup over dense, one panel per
    workload: `ServingConfig`'s assemblies (each at its speed target for one workload) beside NP's shapes at
    several ratios (`serving_smollm2.json`)."""
    res = _load(root, "serving_smollm2")
    models, speed = res["models"], res.get("speed", {})
    workloads = [w for w in res["args"]["workloads"] if speed.get(w)]
    if not workloads:
        raise PlotError("plot serving_speed: serving_smollm2.json has no timed models.")
    kinds = {"serving": ("ServingConfig", "C3", "*"), "servable": ("NP servable (default)", "C0", "o"),
             "global": ("NP per-layer", "C9", "D"), "uniform": ("uniform", "C7", "x")}  # fmt: skip
    fig, axes = plt.subplots(1, len(workloads), figsize=(3.4 * len(workloads), 3.2), sharey=True)
    axes = list(axes) if len(workloads) > 1 else [axes]
    dense = models["dense"]["ppl"]
    for ax, w in zip(axes, workloads):
        for kind, (label, color, marker) in kinds.items():
            pts = sorted(
                (speed[w][n]["speedup"], _geomean(m["ppl"]), (m.get("config") or {}).get("workload") == w)
                for n, m in models.items()
                if m.get("kind") == kind and n in speed[w]
            )
            if kind == "serving":  # filled: targeted at this panel's workload; hollow: at another one
                for own, tag in ((True, f"{label} for this workload"), (False, f"{label} for another workload")):
                    sel = [p for p in pts if p[2] is own]
                    ax.plot([p[0] for p in sel], [p[1] for p in sel], ls="", marker=marker, ms=8, color=color,
                            mfc=color if own else "none", label=tag)  # fmt: skip
            elif pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, marker=marker, label=label)
        ax.plot([1.0], [_geomean(dense)], "k+", ms=9, label="dense")
        ax.set_title(w)
        ax.set_xlabel("measured speedup over dense")
        ax.grid(alpha=0.3)
        _log_axis(ax)
    axes[0].set_ylabel("geometric mean perplexity (3 texts)")
    axes[0].legend(frameon=False, fontsize=7)
    return _svg(
        fig,
        "SmolLM2-135M, transformers with a static cache, fp32, one thread: quality against the speed measured at each "
        "workload (interleaved medians). Filled stars: ServingConfig's assemblies for that workload's speed targets; "
        "hollow: those targeted at another workload, timed here too (<code>serving_smollm2</code>).",
    )


def _geomean(ppl: dict[str, float]) -> float:
    return statistics.geometric_mean(ppl.values())


PLOTS: dict[str, Callable[[Path], str]] = {
    "structured_quality": structured_quality,
    "structured_speed": structured_speed,
    "unstructured_quality": unstructured_quality,
    "vision_accuracy": vision_accuracy,
    "gpu_speed": gpu_speed,
    "recovery_curves": recovery_curves,
    "serving_speed": serving_speed,
}


def plot(root: Path, name: str) -> str:
    if name not in PLOTS:
        raise PlotError(f"Unknown plot {name!r}; known: {', '.join(PLOTS)} (docs/_plots.py PLOTS).")
    return PLOTS[name](root)
