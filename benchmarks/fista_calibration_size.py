"""Why FISTAPruner spends *more* time per layer on a *smaller* calibration set (SmolLM2-135M, BBC news).

For one decoder layer, the dense-input Grams `X Xᵀ / p` of a few projections are captured for calibration sets of
different sizes (windows of the calibration half of the BBC articles, `split_documents(docs, 0.5, seed=0)`), plus one
held-out Gram from 32 × 512 tokens of the other half. `fista_prune` then runs with `FISTAConfig`'s defaults on each
(one thread; the first input group's setting `X* = X`, i.e. no intra-layer correction, for every projection) and the
script records, per projection and calibration size: outer steps, spectral steps, stop reason, λ path, wall time, the
Gram's conditioning, and after every outer step the calibration error and the held-out error of the rounded iterate.

Output: `results/fista_calibration_size.json` and `.md`. A run takes ~10 min on an idle 2-core CPU.
    TQDM_DISABLE=1 python benchmarks/fista_calibration_size.py [--sizes 8x256,32x512] [--layer 0]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TQDM_DISABLE", "1")

import harness  # noqa: E402
import torch  # noqa: E402

import optimum_prune.methods.fista.functional as fista  # noqa: E402
from optimum_prune import CalibrationConfig, __version__  # noqa: E402
from optimum_prune.calibration.data import get_calibration_batches  # noqa: E402
from optimum_prune.functional.masks import keep_mask  # noqa: E402
from optimum_prune.functional.scores import wanda_scores  # noqa: E402
from optimum_prune.methods.fista.solver import spectral_gram  # noqa: E402

PROJECTIONS = {"q_proj": "self_attn.q_proj", "gate_proj": "mlp.gate_proj", "down_proj": "mlp.down_proj"}


def capture_grams(model, tokenizer, layer: int, docs: list[str], num_samples: int, seq_len: int, seed: int):
    """Dense-input Grams (float64 accumulation, normalised by the token count) of the chosen projections."""
    ids = get_calibration_batches(
        CalibrationConfig(dataset=docs, num_samples=num_samples, seq_len=seq_len, seed=seed), tokenizer
    )
    block = model.model.layers[layer]
    mods = {name: block.get_submodule(path) for name, path in PROJECTIONS.items()}
    acc = {name: torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for name, m in mods.items()}

    def hook(name):
        def pre(module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).double()  # (tokens, n)
            acc[name].add_(x.T @ x)

        return pre

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in mods.items()]
    layers = model.model.layers
    model.model.layers = layers[: layer + 1]  # nothing after the layer is needed
    try:
        with torch.no_grad():
            for start in range(0, num_samples, 4):
                model(input_ids=ids[start : start + 4], use_cache=False)
    finally:
        model.model.layers = layers
        for h in handles:
            h.remove()
    return {name: (g / ids.numel()).float() for name, g in acc.items()}


def run_fista(W: torch.Tensor, G: torch.Tensor, held_out: torch.Tensor, eps: float) -> dict[str, Any]:
    """`fista_prune` at the defaults but `eps` (Wanda warm start, 50%), every rounded iterate scored on `held_out`."""
    iterates = []
    W0 = W * keep_mask(wanda_scores(W, G.diagonal().clamp_min(0)), 0.5, None, per="row")
    eig = spectral_gram(G)
    start = time.perf_counter()  # the rounded warm start, then one rounded iterate per outer step
    _, info = fista.fista_prune(W, G, G, G, W0, 0.5, eig=eig, eps=eps, on_iterate=lambda A: iterates.append(A.clone()))
    seconds = time.perf_counter() - start
    held = [fista.reconstruction_error(A, W, held_out, held_out, held_out) for A in iterates]
    best_so_far, best_held = [], []
    for k, (e_cal, e_held) in enumerate(zip([info["error_init"], *info["errors_total"]], held)):
        if k == 0 or e_cal < best_so_far[-1]:
            best_so_far.append(e_cal)
            best_held.append(e_held)
        else:
            best_so_far.append(best_so_far[-1])
            best_held.append(best_held[-1])
    d = eig.d.double()
    return {
        "seconds": seconds,
        "outer_steps": info["outer_iterations"],
        "spectral_steps": sum(info["spectral"]),
        "stop_reason": info["stop_reason"],
        "lambdas": info["lambdas"],
        "L": eig.L,
        "eigenvalues_below_1e-3_L": int((d < 1e-3 * d[-1]).sum()),
        "eigenvalues_below_1e-6_L": int((d < 1e-6 * d[-1]).sum()),
        "calibration_error": best_so_far,  # of the kept solution after each outer step (index 0: warm start)
        "held_out_error": best_held,
    }


def markdown(result: dict[str, Any]) -> str:
    settings = result["settings"]
    ref, default_eps = settings["sizes"][-1], settings["eps"][0]
    lines = [
        f"# FISTA time vs calibration-set size (SmolLM2-135M, layer {settings['layer']}, 50% unstructured)",
        "",
        f"Errors are relative to the rounded Wanda warm start (= 1). Held-out: the same projection's reconstruction "
        f"error on {settings['held_out']} tokens of held-out BBC documents. '@{ref} steps': held-out error after as "
        f"many outer steps as the {ref} run at eps={default_eps:g} took. One thread; {settings['note']}",
        "",
        "| projection | calibration | eps | outer steps (spectral) | stop | time (s) | calib. error | held-out error | "
        f"held-out @{ref} steps | best held-out (at step) | eigenvalues < 1e-3 λ_max |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for proj, runs in result["runs"].items():
        for key, r in runs.items():
            size, eps = key.split(" eps=")
            ref_run = runs.get(f"{ref} eps={default_eps:g}")
            n_ref = ref_run["outer_steps"] if ref_run else len(r["held_out_error"]) - 1
            cal, held = r["calibration_error"], r["held_out_error"]
            best = min(range(len(held)), key=held.__getitem__)
            lines.append(
                f"| {proj} | {size} | {eps} | {r['outer_steps']} ({r['spectral_steps']}) | {r['stop_reason']} | "
                f"{r['seconds']:.1f} | {cal[-1] / cal[0]:.3f} | {held[-1] / held[0]:.3f} | "
                f"{held[min(n_ref, len(held) - 1)] / held[0]:.3f} | {held[best] / held[0]:.3f} ({best}) | "
                f"{r['eigenvalues_below_1e-3_L']} |"
            )
    if result.get("protocol"):
        lines += ["", harness.protocol_line(result) + " Calibration Grams: windows of the calibration split; "
                  "held-out Gram: the evaluation split."]  # fmt: skip
    lines += ["", f"Machine: {result['machine']}; load average at the start {result['load_average']}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="8x256,32x512", help="calibration sets, NUMxLEN, smallest first")
    parser.add_argument("--eps", default="1e-3,1e-2", help="FISTAConfig.eps values, the default first")
    parser.add_argument("--layer", type=int, default=0)
    parser.add_argument("--held-out", default="32x512", help="held-out Gram's windows, NUMxLEN (default: 32x512)")
    harness.add_split_args(parser, split="selection", what="held-out set (the study chooses FISTA's settings)")
    harness.add_model_args(parser)
    parser.set_defaults(threads=1)
    parser.add_argument("--output", type=Path, default=harness.RESULTS_DIR / "fista_calibration_size.json")
    args = parser.parse_args(argv)
    sizes = args.sizes.split(",")
    harness.require_clean_tree(args)
    protocol = harness.Protocol(split=args.split, seed=args.seed, eval_texts=())
    calib_docs, held_docs = protocol.documents("bbc", "calibration"), protocol.documents("bbc")
    model, tokenizer, model_desc = harness.load_model(args)
    hn, hl = (int(x) for x in args.held_out.split("x"))
    held_out = capture_grams(model, tokenizer, args.layer, held_docs, hn, hl, seed=1)
    grams = {}
    for size in sizes:
        n, length = (int(x) for x in size.split("x"))
        grams[size] = capture_grams(model, tokenizer, args.layer, calib_docs, n, length, seed=0)
    block = model.model.layers[args.layer]
    result: dict[str, Any] = {
        "settings": {
            "sizes": sizes,
            "eps": [float(e) for e in args.eps.split(",")],
            "layer": args.layer,
            "held_out": args.held_out.replace("x", " x "),
            "model": model_desc,
            "threads": args.threads,
            "note": "dense inputs (X* = X) for every projection.",
        },
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, optimum_prune {__version__}",
        "load_average": round(os.getloadavg()[0], 1),
        "runs": {},
    }
    for proj, path in PROJECTIONS.items():
        W = block.get_submodule(path).weight.detach().float()  # (out, in)
        result["runs"][proj] = {}
        for size in sizes:
            for eps in result["settings"]["eps"]:
                run = run_fista(W, grams[size][proj], held_out[proj], eps)
                result["runs"][proj][f"{size} eps={eps:g}"] = run
                print(proj, size, eps, {k: v for k, v in run.items() if not isinstance(v, list)}, flush=True)
                # rewritten after every run: an interrupted run leaves partial results
                result["protocol"] = protocol.record(result.get("protocol"))
                harness.write_results({**harness.environment(argv, "fista_calibration_size.py"), **result},
                                      args.output, "fista_calibration_size")  # fmt: skip
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
