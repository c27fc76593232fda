"""Why FISTAPruner can lose to SparseGPT out of domain at 2:4, and which setting fixes it (SmolLM2-135M).

Layer-wise diagnostic, cheap enough to compare many settings on the same data: for a few decoder layers, the
dense-input Grams `X Xᵀ / p` of q_proj, gate_proj and down_proj are captured on three token sets of 32 x 512 (or
`--num-samples` x 512 for calibration):

- **calibration**: the calibration half of the BBC articles (`split_documents(docs, 0.5, seed=0)`, the token ids of
  `benchmarks/unstructured.py`);
- **held-out BBC**: windows of the other half (seed 1);
- **OOD**: windows of the Python 3.11 documentation sources (never calibrated on).

Each projection is then pruned from the calibration Gram by Wanda, SparseGPT and `fista_prune` in several settings
(dense inputs, `X* = X`), and every result's reconstruction error `||(W* − W) X||_F` is measured on all three sets,
relative to SparseGPT's on the same set (< 1: better than SparseGPT). Overfitting shows as a ratio that is small on
the calibration tokens and large on the others.

    TQDM_DISABLE=1 python benchmarks/fista_generalization.py [--layers 2,20] [--patterns 2:4] [--num-samples 32]

Writes `results/fista_generalization_<N>x512.json` and `.md`, rewritten after every projection (`--resume` skips the
ones done).
"""

from __future__ import annotations

import argparse
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
from fista_calibration_size import PROJECTIONS, capture_grams  # noqa: E402

from optimum_prune import __version__  # noqa: E402
from optimum_prune.functional.masks import keep_mask  # noqa: E402
from optimum_prune.functional.scores import wanda_scores  # noqa: E402
from optimum_prune.functional.sparsegpt import sparsegpt_prune  # noqa: E402
from optimum_prune.methods.fista.functional import fista_prune, reconstruction_error  # noqa: E402

SETS = ("calibration", "held-out BBC", "OOD")  # of the results written before the protocol
# token sets of a run under the protocol: name -> corpus of its evaluation documents (None: the calibration windows)
PROTOCOL_SETS = {"calibration": None, "held-out BBC": "bbc", "OOD": "python_docs", "OOD prose": "kjv"}
SHORT = {"calibration": "cal", "held-out BBC": "BBC", "OOD": "OOD", "OOD prose": "KJV"}
# name -> fista_prune keyword arguments (the paper's setting is {})
VARIANTS = {
    "paper": {},
    "eps=1e-2": {"eps": 1e-2},
    "ridge=0.01": {"ridge": 0.01},
    "ridge=0.1": {"ridge": 0.1},
    "ridge=0.1+eps=1e-2": {"ridge": 0.1, "eps": 1e-2},
}


def prune_all(W: torch.Tensor, G: torch.Tensor, pattern: str, variants: dict[str, dict]) -> dict[str, Any]:
    nm = None if pattern == "unstructured" else pattern
    sparsity = 0.5 if nm is None else None
    W0 = W * keep_mask(wanda_scores(W, G.diagonal().clamp_min(0)), 0.5, nm, per="row")
    out = {"Wanda": {"W": W0, "seconds": 0.0}}
    t = time.perf_counter()
    out["SparseGPT"] = {"W": sparsegpt_prune(W, G, sparsity, nm)[0], "seconds": time.perf_counter() - t}
    for name, kwargs in variants.items():
        t = time.perf_counter()
        W_best, info = fista_prune(W, G, G, G, W0, sparsity, nm, **kwargs)
        out[f"FISTA {name}"] = {"W": W_best, "seconds": time.perf_counter() - t, "outer": info["outer_iterations"]}
    return out


def markdown(result: dict[str, Any]) -> str:
    s = result["settings"]
    sets = tuple(s.get("sets", SETS))
    short = " / ".join(SHORT[x] for x in sets)
    lines = [
        f"# FISTA generalization, layer-wise (SmolLM2-135M, calibration {s['num_samples']} x 512 BBC tokens)",
        "",
        "Reconstruction error `||(W* − W) X||_F` of each pruned projection on three token sets, relative to "
        "SparseGPT's on the same set (< 1: better than SparseGPT): the calibration tokens, held-out BBC (32 x 512) and "
        "OOD: the Python docs (32 x 512, never calibrated on). Dense inputs (`X* = X`); Wanda is FISTA's warm start. "
        "Last rows: geometric mean over the projections.",
        "",
    ]
    if result.get("protocol"):
        lines[-1:-1] = [
            harness.protocol_line(result) + f" Token sets: {', '.join(sets)} ('OOD prose': the KJV Bible).",
            "",
        ]
    for pattern in s["patterns"]:
        rows = {k: v for k, v in result["runs"].items() if v["pattern"] == pattern}
        if not rows:
            continue
        methods = list(next(iter(rows.values()))["errors"])
        lines += [f"## {pattern}", "", "| method | " + " | ".join(f"{k.split('|')[0]}: {short}" for k in rows)
                  + f" | geo-mean {short} | time (s) |", "|---|" + "---|" * (len(rows) + 2)]  # fmt: skip
        for m in methods:
            cells, logs = [], {x: [] for x in sets}
            for r in rows.values():
                rel = [r["errors"][m][x] / r["errors"]["SparseGPT"][x] for x in sets]
                for x, v in zip(sets, rel):
                    logs[x].append(v)
                cells.append(" / ".join(f"{v:.3f}" for v in rel))
            geo = " / ".join(f"{statistics.geometric_mean(logs[x]):.3f}" for x in sets)
            secs = sum(r["seconds"].get(m, 0.0) for r in rows.values())
            lines.append(f"| {m} | " + " | ".join(cells) + f" | **{geo}** | {secs:.0f} |")
        lines.append("")
    lines += [f"Machine: {result['machine']}; load average {result['load_average']}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", default="2,20")
    parser.add_argument("--patterns", default="2:4")
    parser.add_argument("--num-samples", type=int, default=32, help="calibration windows of 512 tokens")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma list of names in VARIANTS")
    parser.add_argument("--seq-len", type=int, default=512, help="window length of every token set (default: 512)")
    parser.add_argument("--eval-samples", type=int, default=32, help="windows of each held-out set (default: 32)")
    harness.add_split_args(parser, split="selection", what="held-out sets (the study chooses FISTA's settings)")
    parser.add_argument("--resume", action="store_true")
    harness.add_model_args(parser)
    parser.add_argument(
        "--output", type=Path, default=None, help="results JSON (default: results/fista_generalization_<N>x512)"
    )
    args = parser.parse_args(argv)
    variants = {k: VARIANTS[k] for k in args.variants.split(",")}
    json_path = args.output or harness.RESULTS_DIR / f"fista_generalization_{args.num_samples}x{args.seq_len}.json"
    harness.require_clean_tree(args)
    protocol = harness.Protocol(split=args.split, seed=args.seed, eval_texts=())
    model, tokenizer, model_desc = harness.load_model(args)
    result: dict[str, Any] = {
        "settings": {"layers": [int(x) for x in args.layers.split(",")], "patterns": args.patterns.split(","),
                     "num_samples": args.num_samples, "variants": variants, "threads": torch.get_num_threads(),
                     "sets": list(PROTOCOL_SETS), "model": model_desc, "seq_len": args.seq_len},
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, optimum_prune {__version__}",
        "load_average": round(os.getloadavg()[0], 1),
        "runs": {},
    }  # fmt: skip
    if args.resume and json_path.exists():
        result["runs"] = json.loads(json_path.read_text())["runs"]
    sets = result["settings"]["sets"]
    for layer in result["settings"]["layers"]:
        grams = {
            name: capture_grams(model, tokenizer, layer, protocol.documents("bbc", "calibration"), args.num_samples,
                                args.seq_len, seed=0)
            if corpus is None
            else capture_grams(model, tokenizer, layer, protocol.documents(corpus), args.eval_samples, args.seq_len,
                               seed=1)
            for name, corpus in PROTOCOL_SETS.items()
        }  # fmt: skip
        block = model.model.layers[layer]
        for proj, path in PROJECTIONS.items():
            W = block.get_submodule(path).weight.detach().float()  # (out, in)
            for pattern in result["settings"]["patterns"]:
                key = f"{proj} L{layer}|{pattern}"
                if key in result["runs"]:
                    continue
                pruned = prune_all(W, grams["calibration"][proj], pattern, variants)
                errors = {m: {x: reconstruction_error(r["W"], W, *(grams[x][proj],) * 3) for x in sets}
                          for m, r in pruned.items()}  # fmt: skip
                result["runs"][key] = {
                    "pattern": pattern, "errors": errors,
                    "seconds": {m: r["seconds"] for m, r in pruned.items()},
                    "outer_steps": {m: r["outer"] for m, r in pruned.items() if "outer" in r},
                }  # fmt: skip
                print(key, {m: round(e["OOD"] / errors["SparseGPT"]["OOD"], 3) for m, e in errors.items()}, flush=True)
                result["protocol"] = protocol.record(result.get("protocol"))
                harness.write_results({**harness.environment(argv, "fista_generalization.py"), **result}, json_path,
                                      "fista_generalization")  # fmt: skip
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
