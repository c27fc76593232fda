"""Numerical Pruning allocation study: many NP variants against FLAP from ONE calibration pass per model (CPU).

The statistics every variant needs (the Gram and the mean of the o_proj / down_proj inputs for NP, their per-channel
mean / variance for FLAP, the mean squared norm of each layer's residual input) are collected once, in one dense
pass over the calibration ids (BBC news, the same ids for every method). Every variant then runs the library's own
pruner (`NumericalPruner` / `FLAPPruner`: scoring, allocation, compensation) on those statistics and the plan is
applied to a copy of the dense model, so a variant costs its solves plus the evaluation, not a calibration pass.

Perplexity is measured on held-out BBC articles (disjoint from the calibration documents) and, out of domain, on the
Python 3.11 documentation sources (`python_docs_dir()`; never used for calibration), with the same token windows
for every model.

Variants (`--variants`): see `VARIANTS`. `*_pools` variants allocate attention and MLP separately (each loses the
ratio of its own parameters); `np_loss_rel` divides each unit's loss by the layer's residual energy.

Usage (from the repository root)::

    python benchmarks/np_allocation.py --model smollm2 --ratios 0.2 0.5 --eval-tokens 8192   # screening
    python benchmarks/np_allocation.py --model gemma3 --variants flap np --ratios 0.1 0.2 0.3 0.4 0.5 \\
        --long-eval-seq-len 2048 --output benchmarks/results/np_allocation_gemma3.json

Writes `<output>.json` after every variant (every number, settings, versions) and `<output>.md` (tables).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("TQDM_DISABLE", "1")

import harness  # noqa: E402
import torch  # noqa: E402
from _np_stats import collect  # noqa: E402
from _np_variants import prune_variant  # noqa: E402
from harness import REPO_ROOT  # noqa: E402

from optimum_prune import FLAPConfig, NumericalConfig  # noqa: E402
from optimum_prune.modeling.architectures import get_layers, get_spec  # noqa: E402
from optimum_prune.modeling.shapes import attention_mlp_params  # noqa: E402

logger = logging.getLogger("benchmarks.np_allocation")
# evaluation texts of the protocol -> the keys this script's results use
TEXT_KEYS = {"bbc": "bbc", "python_docs": "pydocs", "kjv": "kjv"}

# name -> (config class, config kwargs, options of this script, label). Every NP setting is spelled out, so a name
# means the same thing whatever the library's defaults are. Options: "pools" (attention and MLP allocated
# separately, each losing the ratio of its own parameters), "budgets_from" (another variant's per-layer removed
# fractions, e.g. FLAP's: a diagnostic that separates the layer budgets from the choice within a layer),
# "centred_scores" (numerical scores on the input covariance: the objective with an intercept), "scores_from"
# ("flap": FLAP's scores with NP's compensation, a diagnostic).
_NP = NumericalConfig
_STD = {"ranking": "cost_weighted", "standardize_per_layer": True, "compensation_damping": 0.1, "scores": "numerical"}
_UNIT = {**_STD, "head_score": "unit"}
_OWL = {"allocation": "owl", "owl_threshold": 5.0, "owl_lambda": 0.08}
_LOSS = {**_UNIT, "ranking": "loss"}
_BIAS = {"compensation_bias": True}
VARIANTS: dict[str, tuple[type, dict[str, Any], dict[str, Any], str]] = {
    "flap": (FLAPConfig, {}, {}, "FLAP"),
    # FLAP with its bias compensation forced on: its default everywhere before the default left it off on
    # architectures whose graphs (llama.cpp's Gemma-3, Qwen3) have no output bias; the Gemma-3 runs of 26 Nov used it
    "flap_bias": (FLAPConfig, {"bias_compensation": True}, {}, "FLAP, bias compensation"),
    "np_paper": (
        _NP,
        {
            "standardize_per_layer": False,
            "head_score": "channel_mean",
            "compensation_damping": 0.01,
            "scores": "numerical",
        },
        {},
        "NP, paper setting",
    ),
    "np_prev": (_NP, {**_STD, "head_score": "channel_mean"}, {}, "NP, previous default (std, channel-mean heads)"),
    "np_unit": (_NP, _UNIT, {}, "NP, std, unit head scores"),
    "np_unit_bias": (_NP, {**_UNIT, **_BIAS}, {}, "NP, unit, bias refit"),
    "np_unit_cbias": (_NP, {**_UNIT, **_BIAS}, {"centred_scores": True}, "NP, unit, centred scores, bias refit"),
    "np_unit_seq": (_NP, {**_UNIT, "compensation_inputs": "sequential"}, {}, "NP, unit, sequential refit"),
    "np_unit_pools": (_NP, _UNIT, {"pools": True}, "NP, unit, separate attention / MLP pools"),
    "np_unit_flapbudget": (_NP, _UNIT, {"budgets_from": "flap"}, "NP, unit, FLAP's layer budgets (diagnostic)"),
    "np_unit_d1": (_NP, {**_UNIT, "compensation_damping": 1.0}, {}, "NP, unit, damping 1"),
    "np_unit_d0.01": (_NP, {**_UNIT, "compensation_damping": 0.01}, {}, "NP, unit, damping 0.01 (the paper's)"),
    "np_unit_nostd": (_NP, {**_UNIT, "standardize_per_layer": False}, {}, "NP, unit, raw scores (not standardised)"),
    "np_unit_d10": (_NP, {**_UNIT, "compensation_damping": 10.0}, {}, "NP, unit, damping 10"),
    "np_unit_norefit": (_NP, {**_UNIT, "compensate": False}, {}, "NP, unit, no refit (mask only)"),
    "np_unit_owl": (_NP, {**_UNIT, **_OWL}, {}, "NP, unit, OWL budgets (M 5, λ 0.08)"),
    "np_unit_owl15": (_NP, {**_UNIT, **_OWL, "owl_lambda": 0.15}, {}, "NP, unit, OWL budgets (M 5, λ 0.15)"),
    "np_unit_owl_bias": (_NP, {**_UNIT, **_OWL, **_BIAS}, {}, "NP, unit, OWL, bias refit"),
    "np_unit_owl_d1": (_NP, {**_UNIT, **_OWL, "compensation_damping": 1.0}, {}, "NP, unit, OWL, damping 1"),
    "np_unit_cbias_owl": (
        _NP,
        {**_UNIT, **_OWL, **_BIAS},
        {"centred_scores": True},
        "NP, unit, centred scores, bias refit, OWL",
    ),
    "np_loss": (_NP, {"ranking": "loss", "standardize_per_layer": False}, {}, "NP, loss ranking (L* / param)"),
    "np_loss_std": (_NP, _LOSS, {}, "NP, loss ranking, std"),
    "np_loss_std_bias": (_NP, {**_LOSS, **_BIAS}, {}, "NP, loss ranking, std, bias refit"),
    "np_loss_std_bias_d1": (
        _NP,
        {**_LOSS, **_BIAS, "compensation_damping": 1.0},
        {},
        "NP, loss, std, bias, damping 1",
    ),
    "np_loss_std_bias_d10": (
        _NP,
        {**_LOSS, **_BIAS, "compensation_damping": 10.0},
        {},
        "NP, loss, std, bias, damping 10",
    ),
    "np_unit_owl_bias_d1": (
        _NP,
        {**_UNIT, **_OWL, **_BIAS, "compensation_damping": 1.0},
        {},
        "NP, unit, OWL, bias, d 1",
    ),
    "np_flapscores_bias": (_NP, {**_UNIT, **_BIAS}, {"scores_from": "flap"}, "FLAP's scores, NP's bias refit"),
    "np_flapscores_bias_d1": (
        _NP,
        {**_UNIT, **_BIAS, "compensation_damping": 1.0},
        {"scores_from": "flap"},
        "FLAP's scores, NP's bias refit, damping 1",
    ),
    "np_dloss_std_bias": (
        _NP,
        {**_LOSS, **_BIAS, "score_correlations": False},
        {},
        "NP, loss ranking without correlations, std, bias refit",
    ),
    "np_dunit_bias": (_NP, {**_UNIT, **_BIAS, "score_correlations": False}, {}, "NP, unit, no correlations, bias"),
    "np_fluct_bias": (
        _NP,
        {**_UNIT, **_BIAS, "scores": "fluctuation", "compensation_strength": 1.0},
        {},
        "NP, FLAP's metric, bias refit",
    ),
    "np_fluct_bias_d1": (
        _NP,
        {**_UNIT, **_BIAS, "scores": "fluctuation", "compensation_damping": 1.0, "compensation_strength": 1.0},
        {},
        "NP, FLAP's metric, bias refit, damping 1",
    ),
    **{
        f"np_fluct_bias_s{s}": (
            _NP,
            {**_UNIT, **_BIAS, "scores": "fluctuation", "compensation_strength": s},
            {},
            f"NP, FLAP's metric, bias refit at strength {s}" + (" (FLAP's compensation)" if s == 0 else ""),
        )
        for s in (0.0, 0.25, 0.5, 0.75)
    },
    # the light-ratio screen: FLAP's metric (w = 0) ... the numerical scores (w = 1), the refit at s = 0.5 + 0.5·w,
    # with a bias (architectures whose export has a slot for it) or without
    "np_fluct_s0.5": (
        _NP,
        {**_UNIT, "scores": "fluctuation", "compensation_bias": False, "compensation_strength": 0.5},
        {},
        "NP, FLAP's metric, refit without a bias at strength 0.5",
    ),
    "np_fluct_s1": (
        _NP,
        {**_UNIT, "scores": "fluctuation", "compensation_bias": False, "compensation_strength": 1.0},
        {},
        "NP, FLAP's metric, full refit without a bias",
    ),
    "np_mix0.5_bias_s0.75": (
        _NP,
        {**_UNIT, **_BIAS, "compensation_strength": 0.75},
        {"mix": 0.5},
        "NP, scores ½ FLAP's metric + ½ numerical, bias refit at strength 0.75",
    ),
    "np_mix0.5_s0.75": (
        _NP,
        {**_UNIT, "compensation_bias": False, "compensation_strength": 0.75},
        {"mix": 0.5},
        "NP, scores ½ FLAP's metric + ½ numerical, refit without a bias at strength 0.75",
    ),
    "np_unit_cbias_flapbudget": (
        _NP,
        {**_UNIT, **_BIAS},
        {"centred_scores": True, "budgets_from": "flap"},
        "NP, unit, centred scores, bias refit, FLAP's layer budgets (diagnostic)",
    ),
    "np_unit_norefit_flapbudget": (
        _NP,
        {**_UNIT, "compensate": False},
        {"budgets_from": "flap"},
        "NP, unit, no refit, FLAP's layer budgets (diagnostic)",
    ),
    "np_loss_std_owl": (_NP, {**_LOSS, **_OWL}, {}, "NP, loss ranking, std, OWL"),
    "np_loss_std_bias_owl": (_NP, {**_LOSS, **_OWL, **_BIAS}, {}, "NP, loss ranking, std, bias refit, OWL"),
}
# Where the per-layer gain lives (library defaults of each method; the split variants give attention and the MLP the
# budget split of the global allocation at that ratio, each part per layer or uniform) and the shapes the DeciLM
# format can hold (attention kept whole, MLP widths in blocks of 256, no bias).
_NOBIAS = {NumericalConfig: {"compensation_bias": False}, FLAPConfig: {"bias_compensation": False}}
for _m, _cls, _name in (("np", NumericalConfig, "NP"), ("flap", FLAPConfig, "FLAP")):
    VARIANTS.update(
        {
            f"{_m}_default": (_cls, {}, {}, f"{_name} per-layer (allocation='global'): attention and MLP"),
            f"{_m}_uniform": (_cls, {"allocation": "uniform"}, {}, f"{_name}, allocation='uniform'"),
            f"{_m}_servable": (_cls, {"allocation": "servable"}, {}, f"{_name}, allocation='servable'"),
            f"{_m}_split_pu": (
                _cls,
                {},
                {"split": ("per-layer", "uniform")},
                f"{_name}: per-layer attention, uniform MLP",
            ),
            f"{_m}_split_up": (
                _cls,
                {},
                {"split": ("uniform", "per-layer")},
                f"{_name}: uniform attention, per-layer MLP",
            ),
            f"{_m}_split_uu": (
                _cls,
                {},
                {"split": ("uniform", "uniform")},
                f"{_name}: uniform attention and MLP (global split)",
            ),
            f"{_m}_nobias": (_cls, _NOBIAS[_cls], {}, f"{_name}, no bias: per-layer attention and MLP"),
            f"{_m}_nobias_mlp": (
                _cls,
                {**_NOBIAS[_cls], "prune_attention": False},
                {},
                f"{_name}, no bias: attention kept, per-layer MLP",
            ),
            f"{_m}_nobias_mlp256": (
                _cls,
                {**_NOBIAS[_cls], "prune_attention": False},
                {"mlp_blocks": 256},
                f"{_name}, no bias: attention kept, per-layer MLP in blocks of 256",
            ),
        }
    )
VARIANTS.update(
    {
        "np_servable_s1": (
            _NP,
            {"allocation": "servable", "compensation_strength": 1.0},
            {},
            "NP, allocation='servable', full refit",
        ),
        "np_servable_s0.5": (
            _NP,
            {"allocation": "servable", "compensation_strength": 0.5},
            {},
            "NP, allocation='servable', refit at strength 0.5",
        ),
        "np_servable_num": (
            _NP,
            {"allocation": "servable", "scores": "numerical", "standardize_per_layer": True},
            {},
            "NP, allocation='servable', numerical scores (standardised)",
        ),
        "np_servable_fluct": (
            _NP,
            {"allocation": "servable", "scores": "fluctuation", "standardize_per_layer": True},
            {},
            "NP, allocation='servable', FLAP's metric",
        ),
        # the pre-protocol settings of the numerical rule, re-screened under the servable allocation
        "np_servable_num_nostd": (
            _NP,
            {"allocation": "servable", "scores": "numerical", "standardize_per_layer": False},
            {},
            "NP, allocation='servable', numerical scores, raw (not standardised)",
        ),
        "np_servable_num_d1": (
            _NP,
            {
                "allocation": "servable",
                "scores": "numerical",
                "standardize_per_layer": True,
                "compensation_damping": 1.0,
            },
            {},
            "NP, allocation='servable', numerical scores, damping 1",
        ),
        "np_servable_num_d0.01": (
            _NP,
            {
                "allocation": "servable",
                "scores": "numerical",
                "standardize_per_layer": True,
                "compensation_damping": 0.01,
            },
            {},
            "NP, allocation='servable', numerical scores, damping 0.01 (the paper's)",
        ),
    }
)
for _m, _cls, _name in (("np", NumericalConfig, "NP"), ("flap", FLAPConfig, "FLAP")):
    for _k in (1, 2, 4, 8):
        VARIANTS[f"{_m}_nobias_noop{_k}"] = (
            _cls,
            _NOBIAS[_cls],
            {"noop_attention": _k},
            f"{_name}, no bias: attention removed in the {_k} layers it changes least, MLP in blocks of 256",
        )
SCREEN = ["flap", "np_prev", "np_unit", "np_unit_bias", "np_unit_pools", "np_unit_owl", "np_unit_flapbudget"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    harness.add_model_args(p)
    p.add_argument("--variants", nargs="+", default=SCREEN, choices=sorted(VARIANTS), metavar="VARIANT")
    p.add_argument("--ratios", nargs="+", type=float, default=[0.2, 0.5])
    p.add_argument("--num-samples", type=int, default=32, help="calibration windows (default: 32)")
    p.add_argument("--seq-len", type=int, default=512, help="calibration window length (default: 512)")
    harness.add_protocol_args(p, split="selection")
    p.add_argument("--long-eval-seq-len", type=int, default=0, help="also evaluate with this window (0 = skip)")
    p.add_argument(
        "--limit",
        nargs="*",
        default=[],
        metavar="VARIANT=R1,R2",
        help="run VARIANT only at these ratios (e.g. np_loss=0.2,0.5 to screen it beside a full grid)",
    )
    p.add_argument("--round-to", type=int, default=1, help="StructuredPruningConfig.round_to for every method")
    p.add_argument("--baseline", default="flap", choices=sorted(VARIANTS), help="the Δ columns' reference (FLAP)")
    p.add_argument("--output", type=Path, default=None, help="JSON path (default: results/np_allocation_<model>.json)")
    p.add_argument("--note", default="")
    p.add_argument("--collect-only", action="store_true", help="only collect (and cache) the statistics")
    p.add_argument(
        "--stats-cache",
        type=Path,
        default=Path("/tmp/optimum_prune_np_stats"),
        help="folder of the cached dense statistics (one file per model and calibration ids)",
    )
    args = p.parse_args(argv)
    try:
        args.limit = {v: [float(r) for r in rs.split(",")] for v, rs in (x.split("=") for x in args.limit)}
    except ValueError:
        p.error("--limit takes VARIANT=R1,R2 ...")
    if args.output is None:
        name = args.model if args.model in harness.MODELS else Path(args.model).name
        args.output = REPO_ROOT / "benchmarks" / "results" / f"np_allocation_{name}.json"
    return args


# --------------------------------------------------------------------------------------------------------- output
def _label(res: dict[str, Any], variant: str) -> str:
    """A variant's label: recorded in the results file (since the harness), else the script's current one."""
    recorded = res.get("labels", {}).get(variant)
    return recorded or (VARIANTS[variant][3] if variant in VARIANTS else variant)


def markdown(res: dict[str, Any]) -> str:
    s = res["settings"]
    texts = [("bbc", "held-out BBC"), ("pydocs", "Python docs (out of domain)")]
    if "kjv" in s.get("eval_texts", []):
        texts.append(("kjv", "KJV Bible (out of domain)"))
    seqs = [("", s["eval_seq_len"])] + ([("_long", s["long_eval_seq_len"])] if s["long_eval_seq_len"] else [])
    lines = [
        f"# Numerical Pruning allocation study: {s['model_label']}",
        "",
        f"Generated by `benchmarks/np_allocation.py` on {res['date']} (optimum_prune @ {res['git']}; "
        f"torch {res['torch']}, {s['threads']} threads).",
        "",
        f"- Command: `{s['command']}`",
        f"- Calibration: {s['num_samples']} × {s['seq_len']} BBC token ids (seed {s['seed']}, sha256 "
        f"{s['calibration_ids_sha256'][:12]}), statistics collected once ({res['collect_s']:.0f} s) and shared by "
        f"every variant; `round_to={s['round_to']}` for every method.",
        f"- Perplexity: first {s['eval_tokens']} tokens of each text ("
        + ", ".join(label for _, label in texts)
        + f"), windows of {', '.join(str(q) for _, q in seqs)} tokens; only BBC is the calibration domain.",
        "- Dense: "
        + ", ".join(
            f"{label} {res['dense'].get(t + k, float('nan')):.2f} @{q}" for t, label in texts for k, q in seqs
        ),
    ]
    documents = any(r.get("documents") for r in res["runs"])
    if not documents:  # the interval tables name their baseline in each Δ column
        lines.append("- Δ vs FLAP: relative perplexity change against FLAP at the same ratio (negative = NP better).")
    if res.get("protocol"):
        lines.append(harness.protocol_line(res))
    if s.get("note"):
        lines.append(f"- Note: {s['note']}")
    head = str(res.get("versions", {}).get("git_commit"))[:10]
    commits = {id(r): str(r["commit"])[:10] if r.get("commit") else "not recorded" for r in res["runs"]}
    other = [r for r in res["runs"] if commits[id(r)] != head]
    if other and any(r.get("commit") for r in res["runs"]):  # a resumed file: the runs kept from an earlier run
        lines.append("- Runs kept from an earlier run (commit): " + ", ".join(
            f"{r['variant']} @ {r['ratio']:g} ({commits[id(r)]})" for r in other) + ".")  # fmt: skip
    runs = res["runs"]
    ratios = sorted({r["ratio"] for r in runs})
    variants = [v for v in s["variants"] if any(r["variant"] == v for r in runs)]
    if documents:
        return "\n".join(lines + _interval_tables(res, texts, seqs, ratios, variants)) + "\n"
    for t, label in texts:
        for k, q in seqs:
            lines += ["", f"## {label}, seq {q}", "", "| variant | " + " | ".join(f"{r:g}" for r in ratios) + " |",
                      "|---|" + "---:|" * len(ratios)]  # fmt: skip
            for v in variants:
                cells = []
                for ratio in ratios:
                    run = next((r for r in runs if r["variant"] == v and r["ratio"] == ratio), None)
                    flap = next((r for r in runs if r["variant"] == "flap" and r["ratio"] == ratio), None)
                    x = None if run is None else run.get(t + k)
                    if x is None:
                        cells.append("–")
                        continue
                    cell = f"{x:.2f}"
                    if v != "flap" and flap is not None and flap.get(t + k):
                        cell += f" ({100 * (x / flap[t + k] - 1):+.1f}%)"
                    cells.append(cell)
                lines.append(f"| {_label(res, v)} | " + " | ".join(cells) + " |")
    lines += ["", "## Measured ratio and decide time (s) per run", ""]
    for r in runs:
        lines.append(f"- {r['variant']} @ {r['ratio']:g}: measured {r['measured']:.3f}, {r['prune_s']:.1f} s")
    return "\n".join(lines) + "\n"


def _interval_tables(res, texts, seqs, ratios, variants) -> list[str]:
    """Per window length: every run's perplexity on each text with its bootstrap 95% interval, and its Δ against the
    baseline variant at the same ratio (FLAP unless `--baseline`) with the paired interval and the verdict; then the
    selection criterion (benchmarks/README.md) per run (results that store per-document sums)."""
    runs = {(r["variant"], r["ratio"]): r for r in res["runs"]}
    dense_docs = res.get("dense_documents", {})
    baseline = res["settings"].get("baseline", "flap")
    lines = []
    for k, q in seqs:
        keys = [(t + k, label) for t, label in texts]
        rows = [{"group": "0", "label": "dense", "ppl": res["dense"], "docs": dense_docs, "ref": None}]
        for ratio in ratios:
            base = runs.get((baseline, ratio))
            for v in variants:
                run = runs.get((v, ratio))
                if run is not None:
                    ref = None if v == baseline or base is None else {"ppl": base, "docs": base.get("documents")}
                    rows.append({"group": f"{ratio:g}", "label": _label(res, v), "ppl": run,
                                 "docs": run.get("documents"), "ref": ref})  # fmt: skip
        lines += ["", f"## Perplexity, windows of {q}", ""]
        lines += harness.interval_table(rows, keys, baseline=_label(res, baseline))
        if len(keys) == 3:
            selection = res["settings"].get("split") == "selection"  # a test-split mean is not for choosing
            title = "Selection criterion" if selection else "Geometric mean"
            lines += ["", f"### {title}, windows of {q}: geometric mean of the three perplexities", ""]
            lines += ["| ratio | variant | geometric mean | Δ vs " + _label(res, baseline) + " [95%], verdict |",
                      "|---:|---|---:|---|"]  # fmt: skip
            for row in rows[1:]:
                gm = harness.geomean(row["ppl"], [key for key, _ in keys])
                delta = (
                    "" if row["ref"] is None else harness.geomean_delta_cell(row, row["ref"], [key for key, _ in keys])
                )
                lines.append(f"| {row['group']} | {row['label']} | {gm:.2f} | {delta} |")
    lines += ["", "## Measured ratio and decide time (s) per run", ""]
    lines += [
        f"- {r['variant']} @ {r['ratio']:g}: measured {r['measured']:.3f}, {r['prune_s']:.1f} s" for r in res["runs"]
    ]
    return lines


def write(res: dict[str, Any], out: Path) -> None:
    harness.write_results(res, out, "np_allocation")


# ----------------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    harness.setup_logging()
    torch.manual_seed(args.seed)
    dense, tokenizer, label = harness.load_model(args)
    spec = get_spec(dense)

    protocol = harness.Protocol.from_args(args)
    calib_ids = protocol.calibration_ids(tokenizer, args.num_samples, args.seq_len)
    seqs = {"": args.eval_seq_len, **({"_long": args.long_eval_seq_len} if args.long_eval_seq_len else {})}

    def perplexities(model: torch.nn.Module) -> tuple[dict[str, float], dict[str, Any]]:
        out, documents = {}, {}
        for suffix, q in seqs.items():
            ppl, docs = protocol.evaluate(model, tokenizer, seq_len=q)
            for t, x in ppl.items():
                out[TEXT_KEYS[t] + suffix], documents[TEXT_KEYS[t] + suffix] = x, docs[t]
        res["protocol"] = protocol.record(res.get("protocol"))
        return out, documents

    env = harness.environment(argv, "np_allocation.py")
    res: dict[str, Any] = {
        "benchmark": "np_allocation",
        **env,
        "git": str(env["versions"]["git_commit"])[:10]
        + (" + uncommitted library changes" if env["versions"]["library_tree_dirty"] else ""),
        "torch": torch.__version__,
        "settings": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "threads": torch.get_num_threads(),
            "model_label": label,
            "calibration_ids_sha256": hashlib.sha256(calib_ids.numpy().tobytes()).hexdigest(),
            "command": env["command"],
            "eval_texts": [TEXT_KEYS[t] for t in args.eval_texts],
        },
        "labels": {v: VARIANTS[v][3] for v in VARIANTS},
        "dense": {},
        "runs": [],
    }
    if args.output.exists():  # resume: keep the runs of the same settings
        old = json.loads(args.output.read_text())
        if old["settings"]["calibration_ids_sha256"] == res["settings"]["calibration_ids_sha256"] and all(
            old["settings"].get(k) == getattr(args, k)
            for k in ("eval_tokens", "eval_seq_len", "long_eval_seq_len", "round_to", "split")
        ):
            res["runs"], res["dense"], res["collect_s"] = old["runs"], old["dense"], old.get("collect_s", 0.0)
            res["dense_documents"] = old.get("dense_documents", {})
            res["settings"]["variants"] = list(dict.fromkeys(old["settings"]["variants"] + args.variants))
            logger.info("Resuming %s: %d runs kept", args.output, len(res["runs"]))
    sha = res["settings"]["calibration_ids_sha256"]
    model_key = args.model if args.model in harness.MODELS else Path(args.model).name
    stats, seconds = collect(dense, spec, calib_ids, cache=args.stats_cache / f"{model_key}_{sha[:16]}.pt")
    res["collect_s"] = seconds or res.get("collect_s", 0.0)
    logger.info("Statistics collected in %.0f s", res["collect_s"])
    if args.collect_only:
        return res
    if not res["dense"]:
        res["dense"], res["dense_documents"] = perplexities(dense)
        logger.info("dense: %s", {t: round(x, 3) for t, x in res["dense"].items()})

    layers = get_layers(dense, spec)
    attn_total = sum(
        p.numel()
        for layer in layers
        for path in (*spec.qkv_paths, spec.o_path)
        for p in layer.get_submodule(path).parameters(recurse=False)
    )
    totals = (float(attn_total), float(attention_mlp_params(dense, spec) - attn_total))
    before = attention_mlp_params(dense, spec)

    for ratio in args.ratios:
        for name in args.variants:
            if any(r["variant"] == name and r["ratio"] == ratio for r in res["runs"]):
                continue
            if name in args.limit and ratio not in args.limit[name]:
                continue
            model, prune_s, shapes, config, info = prune_variant(
                VARIANTS, dense, spec, name, ratio, args.round_to, stats, calib_ids, totals
            )
            run = {"variant": name, "ratio": ratio, "prune_s": prune_s, "shapes": shapes, "config": config,
                   "measured": 1 - attention_mlp_params(model, spec) / before, "commit": env["versions"]["git_commit"],
                   **info}  # fmt: skip
            ppl, run["documents"] = perplexities(model)
            run.update(ppl)
            res["runs"].append(run)
            logger.info("%s @ %g: %s", name, ratio, {t: round(x, 3) for t, x in ppl.items()})
            write(res, args.output)
            del model
    write(res, args.output)
    return res


if __name__ == "__main__":
    main()
