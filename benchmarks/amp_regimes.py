"""Is there a regime where AMP's masks carry information? On a few SmolLM2-135M layers (dense inputs,
calibration windows of the selection split), q/k pruned at ρ = 0.5, scored by the relative attention error
‖f̃ − f‖²/‖f‖² of the layer against Wanda, SparseGPT and magnitude on the same layer:

  1. the scales: mean curvature per mask entry `tr(H)/N` and the largest `L` (H: Gauss-Newton matrix of the attention
     error at M = 1), hence where the paper's λ = 0.05 sits and how many heavy-ball steps the equilibrium needs;
  2. the paper's descent (λ = 0.05, η = 0.005, 100 steps), ranked by mask value and by |M∘W|;
  3. the equilibrium of the quadratic model at λ = λ̂·tr(H)/N (CG, plain and preconditioned by diag(H) + λ), for λ̂
     over three decades, ranked by the mask, |M∘W| (per matrix / per row) and |M∘W|·‖X_j‖ (per row): the error after
     binarisation, the soft masks' error and their spread-to-shrink ratio std(M) / (1 − mean(M));
  4. the refit of the kept masks (`refit_kept`, 200 heavy-ball steps at 1.5/L) from Wanda's support and from the
     library default's support, against SparseGPT (which compensates the q/k outputs, not the attention).

Writes results/amp_regimes_smollm2.{json,md} after every layer; `--resume` skips finished layers.
    python benchmarks/amp_regimes.py            # ~10 min on two idle cores
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")

import harness  # noqa: E402
import torch  # noqa: E402

from optimum_prune.calibration.sequential import LayerwiseRunner  # noqa: E402
from optimum_prune.calibration.stats import GramStats  # noqa: E402
from optimum_prune.functional.masks import keep_mask  # noqa: E402
from optimum_prune.functional.scores import wanda_scores  # noqa: E402
from optimum_prune.functional.sparsegpt import sparsegpt_prune  # noqa: E402
from optimum_prune.methods.amp.config import AMPConfig  # noqa: E402
from optimum_prune.methods.amp.equilibrium import (  # noqa: E402
    MaskObjective,
    curvature_scales,
    equilibrium_masks,
    input_norms,
    refit_kept,
)
from optimum_prune.methods.amp.functional import DataTerm, amp_masks, binarize, relative_attention_error  # noqa: E402
from optimum_prune.methods.amp.pruner import AMPPruner  # noqa: E402
from optimum_prune.modeling.access import qk_weights  # noqa: E402
from optimum_prune.modeling.architectures import get_layers, get_spec, layer_view  # noqa: E402

RANKINGS = {  # name -> (binarize score, per)
    "mask": ("mask", "matrix"),
    "|M∘W|": ("masked_weight", "matrix"),
    "|M∘W| row": ("masked_weight", "row"),
    "|M∘W|·‖X‖ row": ("masked_weight_input", "row"),
}
LAMBDA_REL = (0.001, 0.01, 0.1, 1.0)
SOLVERS = {"cg": 0, "pcg8": 8, "pcg32": 32}  # name -> Hutchinson probes of the preconditioner (0: plain CG)


def _rank(inp, Wq, Wk, bq, bk, M, norm, rho) -> dict:
    out = {"soft": relative_attention_error(inp, Wq, Wk, Wq * M[0].to(Wq.dtype), Wk * M[1].to(Wk.dtype), bq, bk)}
    mean, std = float(torch.cat([m.reshape(-1) for m in M]).mean()), float(torch.cat([m.reshape(-1) for m in M]).std())
    out["mean"], out["spread_to_shrink"] = mean, std / max(abs(1 - mean), 1e-12)
    for name, (score, per) in RANKINGS.items():
        new = [W * binarize(m, W, rho, score=score, per=per, input_norm=norm).to(W.dtype) for m, W in zip(M, (Wq, Wk))]
        out[name] = relative_attention_error(inp, Wq, Wk, *new, bq, bk)
    return out


def study_layer(inp, Wq, Wk, bq, bk, rho: float, cg_steps: int, refit_steps: int) -> dict:
    Wq, Wk = Wq.float(), Wk.float()
    X = torch.cat([x.reshape(-1, x.shape[-1]) for x in inp.xs]).float()
    H = GramStats(X.shape[1])
    H.update(X)
    sumsq = X.pow(2).sum(0)
    norm = input_norms(inp)
    base = {
        "wanda": [W * keep_mask(wanda_scores(W, sumsq), rho, None, per="row") for W in (Wq, Wk)],
        "sparsegpt": [sparsegpt_prune(W, H.gram, rho)[0] for W in (Wq, Wk)],
        "magnitude": [W * keep_mask(W.abs(), rho, None, per="matrix") for W in (Wq, Wk)],
    }
    rec: dict = {"baselines": {m: relative_attention_error(inp, Wq, Wk, *w, bq, bk) for m, w in base.items()}}
    obj = MaskObjective(DataTerm(inp, Wq, Wk, bq, bk, 256.0, True, True, False), Wq, Wk)
    t = time.perf_counter()
    mean, top, diag32 = curvature_scales(obj, probes=32, power_steps=8)
    diag8 = curvature_scales(obj, probes=8, power_steps=0, seed=1)[2]
    eta, beta = 1.5 / top, 0.9
    rec["scales"] = {
        "curvature_mean": mean, "curvature_max": top, "ratio": top / mean, "paper_lambda_rel": 0.05 / mean,
        "seconds": time.perf_counter() - t,
        # heavy-ball steps T with ηλT/(1 − β) = c at the largest stable-with-margin step η = 1.5/L, for λ = 0.01·tr/N
        "heavy_ball_steps": {str(c): math.ceil(c * (1 - beta) / (eta * 0.01 * mean)) for c in (1, 3, 10)},
    }  # fmt: skip
    Mq, Mk, info = amp_masks(inp, Wq, Wk, bq, bk, lambda_=0.05, lr=0.005, steps=100, progress=False)
    rec["paper_descent"] = _rank(inp, Wq, Wk, bq, bk, [Mq, Mk], norm, rho)
    rec["cg"] = {}
    for solver, probes in SOLVERS.items():
        diag = {0: None, 8: diag8, 32: diag32}[probes]
        for lr in LAMBDA_REL:
            t = time.perf_counter()
            M, cg = equilibrium_masks(obj, lr * mean, cg_steps, diag, progress=False)
            r = _rank(inp, Wq, Wk, bq, bk, M, norm, rho)
            r.update(residual=cg["residuals"][-1], seconds=time.perf_counter() - t)
            rec["cg"][f"{solver}|{lr}"] = r
            print(f"  {solver} λ̂={lr}: " + ", ".join(f"{k} {v:.4g}" for k, v in r.items()), flush=True)
    d = AMPConfig()
    default_M, _ = equilibrium_masks(obj, d.lambda_rel * mean, d.cg_steps, diag8 if d.precondition else None, False)
    supports = {
        "wanda": [(w != 0) for w in base["wanda"]],
        "amp_default": [binarize(m, W, rho, score=d.score, per=d.per, input_norm=norm) for m, W in zip(default_M, (Wq, Wk))],
    }  # fmt: skip
    rec["refit"] = {}
    for name, keep in supports.items():
        t = time.perf_counter()
        R, info = refit_kept(obj, keep, eta, refit_steps, beta, progress=False)
        err = relative_attention_error(inp, Wq, Wk, (Wq * R[0]).float(), (Wk * R[1]).float(), bq, bk)
        rec["refit"][name] = {"before": relative_attention_error(inp, Wq, Wk, *[W * k for W, k in zip((Wq, Wk), keep)], bq, bk),
                              "after": err, "seconds": time.perf_counter() - t}  # fmt: skip
    return rec


def markdown(result: dict) -> str:
    s = result["setup"]
    lines = [
        "# AMP: in which regime do the masks carry information? (SmolLM2-135M, q/k at ρ = 0.5)",
        "",
        f"`python benchmarks/amp_regimes.py` — {s['num_samples']} x {s['seq_len']} calibration tokens, dense inputs "
        "per layer. Columns: the error after binarising by each ranking (ρ = 0.5; mask value per matrix, abs(M∘W) "
        "per matrix / per row, abs(M∘W)·‖X_j‖ per row). Relative attention error ‖f̃ − f‖²/‖f‖² over every sequence and head (lower is better). λ̂: λ as "
        f"a multiple of the mean curvature tr(H)/N; CG {s['cg_steps']} iterations (pcgK: preconditioned by "
        f"diag(H) + λ, K Hutchinson probes); refit {s['refit_steps']} heavy-ball steps at 1.5/L.",
        "",
    ]
    if result.get("protocol"):
        lines += [harness.protocol_line(result), ""]
    lines += ["## Summary", "",
              "| layer | Wanda | SparseGPT | best binarised AMP (masks, ranking) | AMP default, binarised | AMP default + refit |",
              "|---:|---:|---:|---|---:|---:|"]  # fmt: skip
    for layer, rec in result["layers"].items():
        b = rec["baselines"]
        cands = [
            (r[n], f"{k.split('|')[0]}, λ̂ = {k.split('|')[1]}, {n.replace('|M∘W|', 'abs(M∘W)')}")
            for k, r in rec["cg"].items()
            for n in RANKINGS
        ]
        best = min(cands)
        d = rec["refit"]["amp_default"]
        lines.append(f"| {layer} | {b['wanda']:.4f} | {b['sparsegpt']:.4f} | {best[0]:.4f} ({best[1]}) | "
                     f"{d['before']:.4f} | **{d['after']:.4f}** |")  # fmt: skip
    lines.append("")
    for layer, rec in result["layers"].items():
        b, sc = rec["baselines"], rec["scales"]
        lines += [
            f"## Layer {layer}",
            "",
            f"Baselines: Wanda {b['wanda']:.4f}, SparseGPT {b['sparsegpt']:.4f}, magnitude {b['magnitude']:.4f}. "
            f"Curvature: mean {sc['curvature_mean']:.3g}, max {sc['curvature_max']:.3g} (ratio {sc['ratio']:.3g}); "
            f"the paper's λ = 0.05 is λ̂ = {sc['paper_lambda_rel']:.3g}. Heavy ball to ηλT/(1−β) = 1 / 3 / 10 at "
            f"λ̂ = 0.01 and η = 1.5/L: " + " / ".join(f"{v:,}" for v in sc["heavy_ball_steps"].values()) + " steps.",
            "",
            "| masks | "
            + " | ".join(n.replace("|M∘W|", "abs(M∘W)") for n in RANKINGS)
            + " | soft | mean M | spread/shrink |",
            "|---|" + "---:|" * (len(RANKINGS) + 3),
        ]
        rows = {"paper descent (λ = 0.05, 100 steps)": rec["paper_descent"]}
        rows.update({f"{k.split('|')[0]}, λ̂ = {k.split('|')[1]}": v for k, v in rec["cg"].items()})
        for label, r in rows.items():
            lines.append(f"| {label} | " + " | ".join(f"{r[n]:.4f}" for n in RANKINGS)
                         + f" | {r['soft']:.3g} | {r['mean']:.3f} | {r['spread_to_shrink']:.3g} |")  # fmt: skip
        lines += ["", "Refit of the kept masks: " + "; ".join(
            f"{k} support {v['before']:.4f} → **{v['after']:.4f}** ({v['seconds']:.0f} s)" for k, v in rec["refit"].items())
            + f" (SparseGPT {b['sparsegpt']:.4f}).", ""]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default="2,15,29")
    p.add_argument("--num-samples", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--rho", type=float, default=0.5)
    p.add_argument("--cg-steps", type=int, default=30)
    p.add_argument("--refit-steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0, help="seed of the document split and calibration windows")
    harness.add_model_args(p)
    p.add_argument("--output", type=Path, default=harness.RESULTS_DIR / "amp_regimes_smollm2.json")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--render-only", action="store_true")
    harness.add_tree_args(p)
    args = p.parse_args(argv)
    out = args.output.with_suffix(".json")
    if args.render_only:
        out.with_suffix(".md").write_text(markdown(json.loads(out.read_text())))
        return 0
    env = harness.environment(argv, "amp_regimes.py")
    setup = {"num_samples": args.num_samples, "seq_len": args.seq_len, "rho": args.rho, "cg_steps": args.cg_steps,
             "refit_steps": args.refit_steps, "torch": torch.__version__, "command": env["command"]}  # fmt: skip
    result = json.loads(out.read_text()) if args.resume and out.exists() else {"setup": setup, "layers": {}}
    result.update({k: v for k, v in env.items() if k != "command"})
    model, tok, result["setup"]["model"] = harness.load_model(args)
    # an error study on the calibration windows themselves: only the selection split's calibration documents
    harness.require_clean_tree(args)
    protocol = harness.Protocol(split="selection", seed=args.seed, eval_texts=())
    ids = protocol.calibration_ids(tok, args.num_samples, args.seq_len)
    result["protocol"] = protocol.record(result.get("protocol"))
    spec = get_spec(model)
    run = LayerwiseRunner(model, spec, ids, batch_size=8)
    layers = [int(x) for x in args.layers.split(",")]
    capture = AMPPruner(AMPConfig()).capture
    for i in range(max(layers) + 1):
        if i in layers and str(i) not in result["layers"]:
            view = layer_view(get_layers(model, spec)[i], i, spec, model.config)
            print(f"layer {i}", flush=True)
            Wq, bq, Wk, bk = qk_weights(view)
            rec = study_layer(capture(run, view)[0], Wq, Wk, bq, bk, args.rho, args.cg_steps, args.refit_steps)
            result["layers"][str(i)] = rec
            harness.write_results(result, out, "amp_regimes")
        run.advance(run.run_layer(i))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
