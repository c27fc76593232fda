"""AMP benchmark on SmolLM2-135M: the paper's Table 1, its relative-attention-error study, and AMP's speed.

Table 1 (Liang et al., arXiv 2410.11261): MLP dense / Wanda / SparseGPT  ×  q,k pruned by SparseGPT / Wanda / AMP,
all at 50%. AMP runs twice: `AMPConfig()` (the library default) and `AMPConfig.paper()` (the paper's literal
setting). Protocol, identical for every cell:
  - stage 1: the attention method prunes `q_proj` and `k_proj` (layer by layer, pruned outputs feed the next layer);
  - stage 2 (MLP rows): the MLP method prunes `gate_proj`, `up_proj`, `down_proj` of the stage-1 model (same way).
  Stage 1 runs once per attention method and is reused by its cells (its q/k weights are cached on disk under
  `--cache-dir`), so a cell's pruning time is stage 1 + stage 2. v/o stay dense (the paper does not say; §C.7.7).
Every method gets the *same* calibration token ids (calibration half of the BBC corpus); perplexity is measured on
the held-out BBC half and, out of domain, on the Python documentation (`python_docs_dir()`, never calibrated on).

Relative attention error `‖f̃ − f‖²/‖f‖²` per layer (the paper's §6 metric) at ρ = 0.3 / 0.5 / 0.7 for both AMPs, Wanda
and SparseGPT on q/k, with the dense model's inputs (AMP's masks do not depend on ρ: one descent per layer).

Speed (`--speed`): seconds per AMP step at the run's calibration size on `--speed-layers` layers, the fast path and
the autograd reference interleaved (medians). Run it, and stage 1 of AMP whose time is AMP's whole-model run time
(`--stage1-only --attn amp`), under the timing lock at normal priority; the quality runs niced.

Outputs are rewritten after every cell (benchmarks/results/attention_smollm2.{json,md}); `--resume` skips what is
done. Smoke run:
    python benchmarks/attention.py --num-samples 2 --seq-len 64 --steps 2 --eval-tokens 512 --error-layers 0 \
        --speed-layers 1 --speed-steps 1 --name smoke --cache-dir /tmp/amp_smoke
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import hashlib
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
from _attention_report import render_markdown as markdown  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from optimum_prune import AMPConfig, AutoPruner, SparseGPTConfig, WandaConfig, __version__  # noqa: E402
from optimum_prune.calibration.sequential import LayerwiseRunner  # noqa: E402
from optimum_prune.calibration.stats import GramStats  # noqa: E402
from optimum_prune.functional.masks import keep_mask  # noqa: E402
from optimum_prune.functional.scores import wanda_scores  # noqa: E402
from optimum_prune.functional.sparsegpt import sparsegpt_prune  # noqa: E402
from optimum_prune.methods.amp.blocked import causal_blocks  # noqa: E402
from optimum_prune.methods.amp.functional import amp_masks, relative_attention_error  # noqa: E402
from optimum_prune.methods.amp.pruner import AMPPruner  # noqa: E402
from optimum_prune.modeling.access import qk_weights as layer_qk  # noqa: E402
from optimum_prune.modeling.architectures import get_layers, get_spec, layer_view, weight_oi  # noqa: E402

RESULTS = harness.RESULTS_DIR
TEXT_KEYS = {"bbc": "bbc", "python_docs": "pydocs", "kjv": "kjv"}  # protocol texts -> this script's result keys
QK = ["q_proj", "k_proj"]


def attn_config(method: str, sparsity: float, steps: int):
    if method == "amp":
        return AMPConfig(sparsity=sparsity, steps=steps)
    if method in ("amp_layer", "amp_model"):  # the default with this refit target
        return AMPConfig(sparsity=sparsity, steps=steps, refit_target=method[4:])
    if method == "amp_paper":
        return AMPConfig.paper(sparsity=sparsity, steps=steps)
    return {"wanda": WandaConfig, "sparsegpt": SparseGPTConfig}[method](sparsity=sparsity, targets=QK)


def mlp_config(method: str, sparsity: float):
    """Stage 2: the MLP by Wanda / SparseGPT, or `wanda_rest`: Wanda on everything AMP does not prune (v/o, MLP);
    `wanda_rest_pass` is the same config run in one layer-wise pass with the attention method (a recipe)."""
    if method in ("wanda_rest", "wanda_rest_pass"):
        return WandaConfig(sparsity=sparsity, targets=["v_proj", "o_proj", "mlp"])
    return {"wanda": WandaConfig, "sparsegpt": SparseGPTConfig}[method](sparsity=sparsity, targets=["mlp"])


_SECTIONS = ("dense", "rows", "stage1", "attention_error", "speed", "speed_other_runs", "protocol", "environment")


def merge_disk(result: dict[str, Any], json_path: Path) -> None:
    """Add what another invocation (e.g. a timed stage 1 under the lock) wrote meanwhile; ours wins on conflicts."""
    if not json_path.exists():
        return
    old = json.loads(json_path.read_text())
    if old["setup"]["calibration"] != result["setup"]["calibration"]:
        raise SystemExit(f"{json_path} was made with other calibration ids; change --name or remove it.")
    for k in _SECTIONS:
        if isinstance(result.get(k), dict) and isinstance(old.get(k), dict) and k in ("rows", "stage1"):
            result[k] = {**old[k], **result[k]}
        elif not result.get(k) and k in old:
            result[k] = old[k]


_CORE = (("sparsegpt", "wanda", "amp", "amp_paper"), ("dense", "wanda", "sparsegpt"))  # Table 1's cells


def _done(result: dict[str, Any]) -> bool:
    """Every cell (and the error study) the run asked for is there: its `grid`, or Table 1's cells."""
    grid = result["setup"].get("grid") or {"attn": _CORE[0], "mlp": _CORE[1], "error_layers": True}
    cells = all(f"{a}|{m}" in result["rows"] for a in grid["attn"] for m in grid["mlp"])
    return cells and ("attention_error" in result or not grid["error_layers"])


def write_outputs(result: dict[str, Any], json_path: Path) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    merge_disk(result, json_path)
    if _done(result):  # whichever invocation (e.g. a later speed probe) writes last
        result["status"] = "complete"
    harness.write_results(json.loads(json.dumps(result, default=str)), json_path, "attention")


def qk_weights(model) -> dict[str, torch.Tensor]:
    spec = get_spec(model)
    return {f"{i}.{p}": weight_oi(layer.get_submodule(p)).detach().clone().contiguous()
            for i, layer in enumerate(get_layers(model, spec)) for p in spec.qkv_paths[:2]}  # fmt: skip


def load_qk(model, weights: dict[str, torch.Tensor]) -> None:
    spec = get_spec(model)
    with torch.no_grad():
        for i, layer in enumerate(get_layers(model, spec)):
            for p in spec.qkv_paths[:2]:
                weight_oi(layer.get_submodule(p)).copy_(weights[f"{i}.{p}"])


def error_study(model, ids, layers: list[int], rhos: list[float], steps: int, sparsity: float, batch_size: int):
    """Per layer (dense inputs): relative attention error of both AMPs (each run at every ρ: the default's ranking
    and refit depend on it), Wanda and SparseGPT on q,k at each ρ."""
    spec = get_spec(model)
    run = LayerwiseRunner(model, spec, ids, batch_size=batch_size)
    configs = {a: attn_config(a, sparsity, steps) for a in ("amp", "amp_paper")}
    out: dict[str, Any] = {}
    for i in range(max(layers) + 1):
        if i in layers:
            view = layer_view(get_layers(model, spec)[i], i, spec, model.config)
            inp = AMPPruner(configs["amp"]).capture(run, view)[0]
            Wq, bq, Wk, bk = layer_qk(view)
            X = torch.cat([x.reshape(-1, x.shape[-1]) for x in inp.xs]).float()
            H = GramStats(X.shape[1])
            H.update(X)
            sumsq = X.pow(2).sum(0)
            rec: dict[str, Any] = {m: {} for m in ("sparsegpt", "wanda", *configs)}
            for r in rhos:
                new = {
                    "wanda": tuple(W * keep_mask(wanda_scores(W, sumsq), r, None, per="row") for W in (Wq, Wk)),
                    "sparsegpt": tuple(sparsegpt_prune(W.float(), H.gram, r)[0] for W in (Wq, Wk)),
                }
                for a, cfg in configs.items():
                    t = time.perf_counter()
                    q2, k2, _ = AMPPruner(dataclasses.replace(cfg, sparsity=r)).prune_qk(inp, Wq, Wk, bq, bk)
                    new[a] = (q2, k2)
                    rec[f"{a}_seconds"] = rec.get(f"{a}_seconds", 0.0) + time.perf_counter() - t
                for m, (q2, k2) in new.items():
                    rec[m][str(r)] = relative_attention_error(inp, Wq, Wk, q2, k2, bq, bk)
            out[str(i)] = rec
            print(f"error study layer {i}: " + ", ".join(f"{m} {v}" for m, v in rec.items()), flush=True)
        run.advance(run.run_layer(i))  # dense outputs feed the next layer
    return out


def flop_floor(inp) -> dict[str, Any]:
    """Matmul FLOPs of one AMP layer-step (q/k projections and their weight gradients; the logits of the causal
    blocks, dq and dk), and the sgemm rate of this process on the projection's shape: the time no implementation
    that does these products beats."""
    tokens, d = sum(x.shape[0] * x.shape[1] for x in inp.xs), inp.xs[0].shape[-1]
    hd = inp.head_dim
    proj = 2 * 2 * tokens * d * (inp.num_heads + inp.num_kv_heads) * hd
    entries = sum(
        x.shape[0] * sum((b.e - b.a) * (b.k1 - b.k0) for b in causal_blocks(inp, x.shape[1]).blocks) for x in inp.xs
    )
    attn = 3 * 2 * hd * entries * inp.num_heads
    a, b = torch.randn(tokens, d), torch.randn(d, inp.num_heads * hd)
    times = []
    for _ in range(7):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    rate = 2 * tokens * d * inp.num_heads * hd / statistics.median(times[2:])
    return {"gflop_projections": proj / 1e9, "gflop_attention": attn / 1e9, "sgemm_gflops": rate / 1e9,
            "floor_seconds_per_step": (proj + attn) / rate}  # fmt: skip


def speed_probe(model, ids, layers: int, steps: int, repeats: int = 3) -> dict[str, Any]:
    """Seconds per AMP step (default config) on the first `layers` layers: fast path and autograd interleaved."""
    spec = get_spec(model)
    run = LayerwiseRunner(model, spec, ids, batch_size=ids.shape[0])
    pruner = AMPPruner(AMPConfig())
    fast, slow, cpu, cpu_slow, load, floor = [], [], [], [], [(harness.loadavg() or [None])[0]], None
    for i in range(layers):
        view = layer_view(get_layers(model, spec)[i], i, spec, model.config)
        inp = pruner.capture(run, view)[0]
        Wq, bq, Wk, bk = layer_qk(view)
        floor = floor or flop_floor(inp)
        amp_masks(inp, Wq, Wk, bq, bk, steps=1, progress=False)  # warm-up
        for _ in range(repeats):
            for fb in (True, False):
                c0 = time.process_time()
                _, _, info = amp_masks(inp, Wq, Wk, bq, bk, steps=steps, progress=False, fused_backward=fb)
                (fast if fb else slow).append(info["seconds"] / steps)
                (cpu if fb else cpu_slow).append((time.process_time() - c0) / steps)
        run.advance(run.run_layer(i))
    load.append((harness.loadavg() or [None])[0])
    sps = statistics.median(fast)
    return {"layers": layers, "steps": steps, "repeats": repeats, "seconds_per_step": sps, "fast": fast,
            "autograd": slow, "autograd_seconds_per_step": statistics.median(slow),
            "autograd_over_fast": statistics.median(slow) / sps, "cpu_seconds_per_step": statistics.median(cpu),
            "autograd_cpu_seconds_per_step": statistics.median(cpu_slow), "threads": torch.get_num_threads(),
            "extrapolated_min": sps * 100 * len(get_layers(model, spec)) / 60, **floor,
            "load": "-".join(f"{x:.1f}" for x in load)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-samples", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=100, help="AMP steps")
    p.add_argument("--sparsity", type=float, default=0.5)
    harness.add_protocol_args(p)
    p.add_argument("--mlp", default="dense,wanda,sparsegpt", help="MLP rows, in run order")
    p.add_argument("--attn", default="wanda,sparsegpt,amp,amp_paper", help="attention methods, in run order")
    p.add_argument("--error-layers", default="0,10,20,29")
    p.add_argument("--rhos", default="0.3,0.5,0.7")
    p.add_argument("--speed", action="store_true", help="run the per-step speed probe (under the timing lock)")
    p.add_argument("--speed-layers", type=int, default=2)
    p.add_argument("--speed-steps", type=int, default=5)
    p.add_argument("--stage1-only", action="store_true", help="only stage 1 of --attn (cached), e.g. timed AMP")
    p.add_argument("--timed", action="store_true", help="mark this run's stage-1 times as taken under the lock")
    p.add_argument("--name", default="attention_smollm2")
    p.add_argument("--output-dir", default=str(RESULTS))
    p.add_argument("--cache-dir", default="/tmp/optimum_prune_attention_cache")
    p.add_argument("--resume", action="store_true")
    harness.add_model_args(p)
    p.add_argument("--output", default=None, help="results JSON path (overrides --output-dir / --name)")
    p.add_argument("--render-only", action="store_true")
    args = p.parse_args(argv)
    args.resume = args.resume or args.speed or args.stage1_only  # partial runs add to the results
    # several invocations may write the same results at once (every write merges what is on disk)
    json_path = Path(args.output) if args.output else Path(args.output_dir) / f"{args.name}.json"
    if args.render_only:
        json_path.with_suffix(".md").write_text(markdown(json.loads(json_path.read_text())))
        return 0
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    model0, tok, model_desc = harness.load_model(args)
    protocol = harness.Protocol.from_args(args)
    ids = protocol.calibration_ids(tok, args.num_samples, args.seq_len)

    def ppl(model) -> dict[str, Any]:
        texts, docs = protocol.evaluate(model, tok)
        result["protocol"] = protocol.record(result.get("protocol"))
        out: dict[str, Any] = {f"ppl_{TEXT_KEYS[t]}": x for t, x in texts.items()}
        out["documents"] = {f"ppl_{TEXT_KEYS[t]}": d for t, d in docs.items()}
        return out

    calibration = {"source": "BBC news, calibration split of the protocol (seed)",
                   "num_samples": args.num_samples, "seq_len": args.seq_len, "seed": args.seed,
                   "ids_sum": int(ids.sum())}  # fmt: skip
    env = harness.environment(argv, "attention.py")
    result: dict[str, Any] = {
        "environment": env,
        "setup": {
            "model": model_desc, "gguf_file": harness.model_source(args)[1], "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "optimum_prune": __version__,
            "python": platform.python_version(), "amp_steps": args.steps, "sparsity": args.sparsity,
            "calibration": calibration,
            "eval": {"tokens": args.eval_tokens, "seq_len": args.eval_seq_len, "split": args.split},
            "protocol": "stage 1: q_proj,k_proj by the attention method; stage 2: gate/up/down by the MLP method",
            "grid": {"attn": [a for a in args.attn.split(",") if a], "mlp": [m for m in args.mlp.split(",") if m],
                     "error_layers": args.error_layers},
            "command": env["command"],
            "load": f"{(harness.loadavg() or [float('nan')])[0]:.1f}",
        },
        "status": "running", "dense": {}, "rows": {}, "stage1": {},
        "amp_configs": {a: attn_config(a, args.sparsity, args.steps).to_dict()
                        for a in ("amp", "amp_layer", "amp_model", "amp_paper")},
    }  # fmt: skip
    if args.resume:
        merge_disk(result, json_path)
    elif json_path.exists():
        json_path.unlink()  # a fresh run
    cache = Path(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    tag = f"{args.num_samples}x{args.seq_len}_{calibration['ids_sum']}_{args.sparsity}_{args.steps}"

    def stage1(a: str) -> dict[str, torch.Tensor]:
        cfg = json.dumps(attn_config(a, args.sparsity, args.steps).to_dict(), sort_keys=True, default=str)
        f = cache / f"{a}_{tag}_{hashlib.sha1(cfg.encode()).hexdigest()[:10]}.safetensors"
        merge_disk(result, json_path)
        if a in result["stage1"] and f.exists():
            return load_file(str(f))
        m = copy.deepcopy(model0)
        c0 = time.process_time()
        rep = AutoPruner(m, tok).prune(attn_config(a, args.sparsity, args.steps), calibration=ids, batch_size=8)
        rec = {"time_s": rep.timings["total_s"], "cpu_s": time.process_time() - c0, "measured": rep.measured,
               "load": (harness.loadavg() or [None])[0], "timed": args.timed, "steps": args.steps}  # fmt: skip
        if a.startswith("amp"):
            rec["amp_layers"] = {str(k): v for k, v in rep.info.get("layers", {}).items()}
        w = qk_weights(m)
        save_file(w, str(f))
        result["stage1"][a] = rec
        write_outputs(result, json_path)
        print(f"stage 1 {a}: {rec['time_s']:.1f}s", flush=True)
        del m
        return w

    attn = [a for a in args.attn.split(",") if a]
    if args.stage1_only:
        for a in attn:
            stage1(a)
        return 0
    if args.speed:
        with harness.timing_lock():
            result["speed"] = speed_probe(model0, ids, args.speed_layers, args.speed_steps)
        write_outputs(result, json_path)
        print(f"speed: {result['speed']}", flush=True)
        return 0
    if not result["dense"]:
        result["dense"] = ppl(model0)
        print(f"dense {result['dense']}", flush=True)
        write_outputs(result, json_path)

    def one_pass(a: str, mlp: str):
        """The model pruned by the recipe [attention method on q/k, `mlp`] in one layer-wise pass (cached), and the
        recipe's time."""
        recipe = [attn_config(a, args.sparsity, args.steps), mlp_config(mlp, args.sparsity)]
        cfg = json.dumps([c.to_dict() for c in recipe], sort_keys=True, default=str)
        f = cache / f"{a}_{mlp}_{tag}_{hashlib.sha1(cfg.encode()).hexdigest()[:10]}.safetensors"
        m = copy.deepcopy(model0)
        if f.exists():
            with safe_open(str(f), "pt") as fh:
                info = json.loads(fh.metadata()["info"])
            m.load_state_dict({**m.state_dict(), **load_file(str(f))})
            return m, info
        rep = AutoPruner(m, tok).prune(recipe, calibration=ids, batch_size=8)
        layers = rep.sections[0]["layers"] if a.startswith("amp") else {}
        info = {"time_s": rep.timings["total_s"], "amp_layers": {str(k): v for k, v in layers.items()}}
        save_file({k: v.contiguous() for k, v in m.state_dict().items() if k.endswith("proj.weight")}, str(f),
                  metadata={"info": json.dumps(info, default=str)})  # fmt: skip
        return m, info

    def row(a: str, mlp: str) -> None:
        key = f"{a}|{mlp}"
        if key in result["rows"]:
            return
        extra = {}
        if mlp.endswith("_pass"):
            m, extra = one_pass(a, mlp)
            t = extra.pop("time_s")
            extra = {k: v for k, v in extra.items() if v}
        else:
            m = copy.deepcopy(model0)
            load_qk(m, stage1(a))
            t = result["stage1"][a]["time_s"]
        if mlp != "dense" and not mlp.endswith("_pass"):
            rep = AutoPruner(m, tok).prune(mlp_config(mlp, args.sparsity), calibration=ids, batch_size=8)
            t += rep.timings["total_s"]
        zeros = sum(float((q == 0).sum()) for q in m.parameters()) / sum(q.numel() for q in m.parameters())
        result["rows"][key] = {
            **ppl(m),
            "time_s": t,
            "whole_model_sparsity": zeros,
            "load": (harness.loadavg() or [None])[0],
            **extra,
        }
        print(f"{key}: ", {k: v for k, v in result["rows"][key].items() if k != "amp_layers"}, flush=True)
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
        result["attention_error"] = {
            "rhos": rhos,
            "layers": error_study(model0, ids, layers, rhos, args.steps, args.sparsity, 8),
        }
        write_outputs(result, json_path)
    for mlp in mlps:
        if mlp != "dense":
            for a in attn:
                row(a, mlp)
    result["status"] = "complete" if _done(result) else "partial"
    result["total_wall_s"] = time.perf_counter() - t0
    write_outputs(result, json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
