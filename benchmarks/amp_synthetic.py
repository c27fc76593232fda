"""AMP's synthetic experiment (Liang et al., arXiv 2410.11261, §6.1 / Figure 2), under every reading the
paper admits, side by side with Wanda and SparseGPT on the same W and X.

Data (paper): d = 64, W_Q, W_K = the rank-4 truncated SVD of N(0,1) d×d matrices, W = W_Q W_Kᵀ, k Gaussian X
(n × d), causal softmax of X W Xᵀ with no 1/√d; ρ = 0.5, λ_ctrl = 0.04, η = 0.1/λ_ctrl, 100 steps, momentum 0.9.
What the paper leaves open, and the readings measured here:
  - the scale of X (`--scales`): `1/sqrt(d)` (logits O(1)), `d^-1/4` (X W Xᵀ/√d, a transformer's scaling), `1` (raw
    N(0,1): the softmax is nearly one-hot, every method's error is large);
  - the loss normalisation (`READINGS`): Algorithm 1 literally, `M ← M − (η/k)(Σ_j W∘X_jᵀp_jX_j + λM)`; the data
    term averaged over samples with λM unscaled (the default `regularizer="unscaled"`); "λ_ctrl = λ/n" read as the loss divided by n
    (`η/n`, `nλ`); Definition 3.2's λ = n·λ_ctrl with Algorithm 1's scaling;
  - the baselines: the paper prunes W_Q and W_K *separately* with Wanda / SparseGPT (its Figure 1), so their fused
    W = W̃_Q W̃_Kᵀ is not 50% sparse, while AMP's fused mask zeroes 50% of W; we also prune W itself with them
    (same sparsity as AMP) and run AMP's separate-mask form (the one real models need) on W_Q and W_K;
  - the binarisation: by mask value (paper) or by |M∘W|.
Metric: Σ_j‖f̃_j − f_j‖² / Σ_j‖f_j‖², mean over `--seeds`. Output: results/amp_synthetic.{json,md}.
    python benchmarks/amp_synthetic.py            # ~2-4 min on one core
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import harness
import torch

from optimum_prune.functional.masks import keep_mask
from optimum_prune.functional.scores import wanda_scores
from optimum_prune.functional.sparsegpt import sparsegpt_prune
from optimum_prune.methods.amp.functional import AttentionInputs, amp_masks, fused_amp_masks, softmax_causal

D = torch.float64
# name -> (lr, lambda_, regularizer) as functions of (η, λ_ctrl, n): every reading is an `amp_masks` setting
READINGS = {
    "Algorithm 1 literally: (η/k)(Σ_j ∇_j + λM)": lambda eta, lam, n: (eta, lam, "divided_by_k"),
    "averaged data term: mean_j ∇_j + λM": lambda eta, lam, n: (eta, lam, "unscaled"),
    "loss / n: mean_j ∇_j / n + λM": lambda eta, lam, n: (eta / n, n * lam, "unscaled"),
    "Def. 3.2 λ = n·λ_ctrl, Algorithm 1": lambda eta, lam, n: (eta, n * lam, "divided_by_k"),
}
SCALES = {"1/sqrt(d)": -0.5, "d^-1/4": -0.25, "1": 0.0}


def synthetic(d: int, n: int, k: int, seed: int, x_scale: float):
    """The paper's synthetic data (§6.1); returns W_Q, W_K (paper layout d × d, right-multiplied) and the k samples (k, n, d)."""
    g = torch.Generator().manual_seed(seed)

    def rank4():
        U, S, Vh = torch.linalg.svd(torch.randn(d, d, generator=g, dtype=D))
        return U[:, :4] @ torch.diag(S[:4]) @ Vh[:4]

    WQ, WK = rank4(), rank4()
    return WQ, WK, torch.randn(k, n, d, generator=g, dtype=D) * x_scale


def rel_error(W: torch.Tensor, W_new: torch.Tensor, X: torch.Tensor) -> float:
    f = softmax_causal(X @ W @ X.transpose(-1, -2))
    return float((softmax_causal(X @ W_new @ X.transpose(-1, -2)) - f).pow(2).sum() / f.pow(2).sum())


def linear_baselines(Wlin: torch.Tensor, X: torch.Tensor, rho: float) -> dict[str, torch.Tensor]:
    """Wanda and SparseGPT on the linear layer `x ↦ x Wlin` (PyTorch weight `Wlinᵀ`), inputs X."""
    Xf = X.reshape(-1, X.shape[-1])
    W = Wlin.T.contiguous()
    return {
        "wanda": (W * keep_mask(wanda_scores(W, Xf.pow(2).sum(0)), rho, None, per="row")).T,
        "sparsegpt": sparsegpt_prune(W, Xf.T @ Xf / Xf.shape[0], rho)[0].T,
    }


def ranked(M: torch.Tensor, W: torch.Tensor, rho: float, score: str) -> torch.Tensor:
    return W * keep_mask(M if score == "mask" else (M * W).abs(), rho, None, per="matrix")


def separate_masks(WQ, WK, X, lr, lam, reg, steps, momentum):
    """AMP's separate-mask form on W_Q, W_K: one unscaled head, no RoPE (the library's `amp_masks`)."""
    d = WQ.shape[0]
    inp = AttentionInputs(xs=[X], rope=[None], num_heads=1, num_kv_heads=1, head_dim=d, scaling=1.0)
    Mq, Mk, _ = amp_masks(inp, WQ.T, WK.T, lambda_=lam, lr=lr, steps=steps, momentum=momentum, regularizer=reg,
                          progress=False)  # fmt: skip
    return Mq.T, Mk.T


def run_cell(WQ, WK, X, reading, args) -> dict[str, float]:
    W = WQ @ WK.T
    lr, lam, reg = READINGS[reading](args.eta_times_lambda / args.lam, args.lam, X.shape[1])
    out = {}
    try:
        M = fused_amp_masks(W, list(X), lambda_=lam, lr=lr, steps=args.steps, momentum=args.momentum, regularizer=reg)
        for s in ("mask", "masked_weight"):
            out[f"amp_fused_{s}"] = rel_error(W, ranked(M, W, args.rho, s), X)
    except FloatingPointError:
        out["amp_fused_mask"] = out["amp_fused_masked_weight"] = float("nan")
    try:
        Mq, Mk = separate_masks(WQ, WK, X, lr, lam, reg, args.steps, args.momentum)
        for s in ("mask", "masked_weight"):
            out[f"amp_separate_{s}"] = rel_error(W, ranked(Mq, WQ, args.rho, s) @ ranked(Mk, WK, args.rho, s).T, X)
    except FloatingPointError:
        out["amp_separate_mask"] = out["amp_separate_masked_weight"] = float("nan")
    return out


def markdown(result: dict) -> str:
    s = result["setup"]
    lines = [
        "# AMP synthetic experiment (paper §6.1, Figure 2 at n = 128, ρ = 0.5)",
        "",
        f"d = {s['d']}, n = {s['n']}, k = {s['k']}, ρ = {s['rho']}, λ_ctrl = {s['lam']}, η = {s['eta']}, "
        f"{s['steps']} steps, momentum {s['momentum']}; relative attention error ‖f̃ − f‖²/‖f‖², mean of seeds "
        f"{s['seeds']}. `python benchmarks/amp_synthetic.py`. Baselines: *W_Q, W_K* = pruned separately (the "
        "paper's protocol; the product is not 50% sparse), *W* = W itself pruned as a linear layer (50% of W, "
        "like AMP's fused mask).",
        "",
    ]
    for scale, rec in result["scales"].items():
        b = rec["baselines"]
        lines += [
            f"## X scaled by {scale}",
            "",
            f"Wanda: {b['wanda_separate']:.4f} (W_Q, W_K) / {b['wanda_fused']:.4f} (W); SparseGPT: "
            f"{b['sparsegpt_separate']:.4f} (W_Q, W_K) / {b['sparsegpt_fused']:.4f} (W).",
            "",
            "| reading | AMP fused W, by mask (paper) | AMP fused W, by abs(M∘W) | AMP on W_Q, W_K, by mask | "
            "AMP on W_Q, W_K, by abs(M∘W) |",
            "|---|---:|---:|---:|---:|",
        ]
        for reading, r in rec["amp"].items():
            cells = [r[f"amp_{f}_{s}"] for f in ("fused", "separate") for s in ("mask", "masked_weight")]
            lines.append(f"| {reading} | " + " | ".join(f"{c:.4f}" for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--n", type=int, default=128)
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--rho", type=float, default=0.5)
    p.add_argument("--lam", type=float, default=0.04, help="λ_ctrl")
    p.add_argument("--eta-times-lambda", type=float, default=0.1, help="η = this / λ_ctrl (paper: 0.1)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--scales", default=",".join(SCALES))
    p.add_argument("--output", type=Path, default=harness.RESULTS_DIR / "amp_synthetic.json", help="results JSON")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    result = {
        "setup": {"d": args.d, "n": args.n, "k": args.k, "rho": args.rho, "lam": args.lam,
                  "eta": args.eta_times_lambda / args.lam, "steps": args.steps, "momentum": args.momentum,
                  "seeds": seeds, "torch": torch.__version__},
        "scales": {},
    }  # fmt: skip
    for scale in args.scales.split(","):
        per_seed = []
        for seed in seeds:
            WQ, WK, X = synthetic(args.d, args.n, args.k, seed, args.d ** SCALES[scale])
            W = WQ @ WK.T
            rec = {}
            for name, Wn in linear_baselines(W, X, args.rho).items():
                rec[f"{name}_fused"] = rel_error(W, Wn, X)
            q, k = linear_baselines(WQ, X, args.rho), linear_baselines(WK, X, args.rho)
            for name in q:
                rec[f"{name}_separate"] = rel_error(W, q[name] @ k[name].T, X)
            rec["amp"] = {r: run_cell(WQ, WK, X, r, args) for r in READINGS}
            per_seed.append(rec)
            print(f"scale {scale} seed {seed}: {rec}", flush=True)
        mean = statistics.fmean
        result["scales"][scale] = {
            "baselines": {key: mean(r[key] for r in per_seed) for key in per_seed[0] if key != "amp"},
            "amp": {rd: {c: mean(r["amp"][rd][c] for r in per_seed) for c in per_seed[0]["amp"][rd]} for rd in READINGS},
            "per_seed": per_seed,
        }  # fmt: skip
    env = harness.environment(argv, "amp_synthetic.py")
    result["setup"]["command"] = env["command"]
    result["setup"]["load"] = f"{(env['host']['loadavg_at_start'] or [float('nan')])[0]:.1f}"
    harness.write_results({**env, **result}, args.output, "amp_synthetic")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
