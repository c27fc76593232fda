"""Is there a λ/η regime where AMP's data term competes with its regulariser on a real model? A grid over the step
size η and the regulariser λ (100 steps, momentum 0.9) on a few SmolLM2-135M layers, scored by the relative attention
error ‖f̃ − f‖²/‖f‖² of q/k pruned at ρ = 0.5 (dense inputs), against Wanda, SparseGPT and magnitude on the same
layer. Rescaling the data term (mean instead of sum over heads or positions, `divided_by_k`) is the same as moving
along this grid: `∇ = g/c + λM` takes the steps of `(η/c, cλ)`.

Per config and layer: the error after binarising by mask value (paper) and by |M∘W| (library default), the error of
the soft masks (before binarisation), the mean/std of the masks, the first and last loss. Results are written after
every config (results/amp_regimes_smollm2.{json,md}); `--resume` skips what is done.
    python benchmarks/amp_regimes.py                    # ~1.5 h on one shared core
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")

import harness  # noqa: E402
import torch  # noqa: E402

from optimum_prune.calibration.sequential import LayerwiseRunner  # noqa: E402
from optimum_prune.calibration.stats import GramStats  # noqa: E402
from optimum_prune.functional.masks import keep_mask  # noqa: E402
from optimum_prune.methods.amp.config import AMPConfig  # noqa: E402
from optimum_prune.methods.amp.functional import amp_masks, binarize, relative_attention_error  # noqa: E402
from optimum_prune.methods.amp.pruner import AMPPruner, _qk  # noqa: E402
from optimum_prune.methods.sparsegpt.functional import sparsegpt_prune  # noqa: E402
from optimum_prune.methods.wanda.functional import wanda_scores  # noqa: E402
from optimum_prune.modeling.architectures import get_layers, get_spec, layer_view  # noqa: E402

# (η, λ, regularizer): the paper's setting, its Algorithm-1 reading, then larger steps and smaller λ
GRID = [(0.005, 0.05, "unscaled"), (0.005, 0.05, "divided_by_k"), (0.05, 0.05, "unscaled"), (0.1, 0.05, "unscaled"),
        (0.5, 0.05, "unscaled"), (5.0, 0.05, "unscaled"), (0.02, 0.2, "unscaled"), (0.05, 0.5, "unscaled"),
        (0.5, 0.5, "unscaled"), (0.2, 0.02, "unscaled"), (0.5, 0.005, "unscaled"), (5.0, 0.005, "unscaled"),
        (20.0, 0.005, "unscaled"), (50.0, 0.005, "unscaled"), (100.0, 0.005, "unscaled"), (50.0, 0.01, "unscaled"),
        (50.0, 0.002, "unscaled"), (50.0, 0.0005, "unscaled"), (200.0, 0.001, "unscaled")]  # fmt: skip


def markdown(result: dict) -> str:
    s = result["setup"]
    lines = [
        "# AMP: λ / η regimes on SmolLM2-135M (relative attention error of q/k at ρ = 0.5)",
        "",
        f"`python benchmarks/amp_regimes.py` — {s['num_samples']} x {s['seq_len']} calibration tokens (BBC), dense "
        f"inputs, {s['steps']} steps, momentum {s['momentum']}. Error ‖f̃ − f‖²/‖f‖² over every sequence and head. "
        "Per layer: baselines, then AMP binarised by mask value / by abs(M∘W), the soft masks' error, mean ± std of "
        "M_Q and M_K, loss first → last.",
        "",
    ]
    if result.get("protocol"):
        lines[-1:-1] = [harness.protocol_line(result)]
    for layer, rec in result["layers"].items():
        b = rec["baselines"]
        lines += [f"## Layer {layer}", "",
                  f"Wanda {b['wanda']:.4f}, SparseGPT {b['sparsegpt']:.4f}, magnitude {b['magnitude']:.4f}.", "",
                  "| η | λ | regulariser | by mask | by abs(M∘W) | soft | M_Q | M_K | loss |",
                  "|---:|---:|---|---:|---:|---:|---|---|---|"]  # fmt: skip
        for r in rec["amp"].values():
            if r.get("diverged"):
                lines.append(f"| {r['lr']} | {r['lambda_']} | {r['regularizer']} | diverged | | | | | |")
                continue
            m = r["masks"]
            lines.append(
                f"| {r['lr']} | {r['lambda_']} | {r['regularizer']} | {r['mask']:.4f} | {r['masked_weight']:.4f} | "
                f"{r['soft']:.3g} | {m[0]:.3f} ± {m[1]:.3f} | {m[2]:.3f} ± {m[3]:.3f} | "
                f"{r['loss'][0]:.4g} → {r['loss'][1]:.4g} |"
            )
        best = min((r for r in rec["amp"].values() if not r.get("diverged")), key=lambda r: r["masked_weight"])
        lines += ["", f"Best AMP here: η = {best['lr']}, λ = {best['lambda_']}: {best['masked_weight']:.4f} "
                  f"(Wanda {b['wanda']:.4f}, SparseGPT {b['sparsegpt']:.4f}).", ""]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default="2,15,29")
    p.add_argument("--num-samples", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--rho", type=float, default=0.5)
    p.add_argument(
        "--grid", type=int, default=len(GRID), help=f"first this many (η, λ) settings (default: {len(GRID)})"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the document split and calibration windows")
    harness.add_model_args(p)
    p.add_argument("--output", type=Path, default=harness.RESULTS_DIR / "amp_regimes_smollm2.json")
    p.add_argument("--resume", action="store_true")
    args = p.parse_args(argv)
    out = args.output.with_suffix(".json")
    env = harness.environment(argv, "amp_regimes.py")
    setup = {"num_samples": args.num_samples, "seq_len": args.seq_len, "steps": args.steps, "momentum": args.momentum,
             "rho": args.rho, "torch": torch.__version__, "command": env["command"]}  # fmt: skip
    result = json.loads(out.read_text()) if args.resume and out.exists() else {"setup": setup, "layers": {}}
    result.update({k: v for k, v in env.items() if k != "command"})
    model, tok, result["setup"]["model"] = harness.load_model(args)
    # an error study on the calibration windows themselves: only the calibration documents are read
    protocol = harness.Protocol(split="selection", seed=args.seed, eval_texts=())
    ids = protocol.calibration_ids(tok, args.num_samples, args.seq_len)
    result["protocol"] = protocol.record()
    spec = get_spec(model)
    run = LayerwiseRunner(model, spec, ids, batch_size=8)
    layers = [int(x) for x in args.layers.split(",")]
    capture = AMPPruner(AMPConfig())._capture
    rho = args.rho
    for i in range(max(layers) + 1):
        if i in layers:
            view = layer_view(get_layers(model, spec)[i], i, spec, model.config)
            inp = capture(run, view)
            Wq, bq, Wk, bk = _qk(view)
            rec = result["layers"].setdefault(str(i), {"amp": {}})
            if "baselines" not in rec:
                X = torch.cat([x.reshape(-1, x.shape[-1]) for x in inp.xs]).float()
                H = GramStats(X.shape[1])
                H.update(X)
                sumsq = X.pow(2).sum(0)
                new = {
                    "wanda": [W * keep_mask(wanda_scores(W, sumsq), rho, None, per="row") for W in (Wq, Wk)],
                    "sparsegpt": [sparsegpt_prune(W, H.gram, rho)[0] for W in (Wq, Wk)],
                    "magnitude": [W * keep_mask(W.abs(), rho, None, per="matrix") for W in (Wq, Wk)],
                }
                rec["baselines"] = {m: relative_attention_error(inp, Wq, Wk, *w, bq, bk) for m, w in new.items()}
            for lr, lam, reg in GRID[: args.grid]:
                key = f"{lr}|{lam}|{reg}"
                if key in rec["amp"]:
                    continue
                r = {"lr": lr, "lambda_": lam, "regularizer": reg}
                try:
                    Mq, Mk, info = amp_masks(inp, Wq, Wk, bq, bk, lambda_=lam, lr=lr, steps=args.steps,
                                             momentum=args.momentum, regularizer=reg, progress=False)  # fmt: skip
                except FloatingPointError:
                    r["diverged"] = True
                else:
                    for s in ("mask", "masked_weight"):
                        W2 = [W * binarize(M, W, rho, score=s) for M, W in ((Mq, Wq), (Mk, Wk))]
                        r[s] = relative_attention_error(inp, Wq, Wk, *W2, bq, bk)
                    r["soft"] = relative_attention_error(inp, Wq, Wk, Wq * Mq.float(), Wk * Mk.float(), bq, bk)
                    r["masks"] = [float(Mq.mean()), float(Mq.std()), float(Mk.mean()), float(Mk.std())]
                    r["loss"] = [info["loss_initial"], info["loss_final"]]
                    r["seconds"] = info["seconds"]
                rec["amp"][key] = r
                print(f"layer {i} {key}: {r}", flush=True)
                harness.write_results(result, out, "amp_regimes")
        run.advance(run.run_layer(i))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
