"""Expert pruning of a mixture-of-experts model: REAP against frequency and random, and channels inside the experts
(with Numerical Pruning's refit) against whole experts at equal expert parameters (CPU).

No trained MoE model is available offline, so the test bed is SmolLM2-135M converted to a Mixtral checkpoint
(`_moe_testbed.py`: each MLP split into 8 experts of 192 co-activated channels, top-4 routing, only the routers
trained on the calibration split, toward balanced routing by default), built once into `--testbed` (reused when it
exists; its dense-vs-MoE perplexity is part of every results file). Every pruned model starts from the test bed and
is scored on the protocol's texts.

Rows (`--rows`, at each `--ratios` r of the expert parameters): `reap`, `ean`, `frequency`, `random` remove the
fraction r of each layer's experts; `channels` keeps every expert and removes the fraction r of each one's channels;
`mixed` removes r/2 of the experts and of the rest the channels that make r in all. The Δ columns compare every row
with REAP at the same r.

    python benchmarks/moe.py --threads 1 --split test --output benchmarks/results/moe_smollm2.json
    python benchmarks/moe.py --threads 1 --split selection --rows reap reap_router ean --ratios 0.25 0.5 \\
        --output benchmarks/results/moe_smollm2_selection.json
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TQDM_DISABLE", "1")

import harness  # noqa: E402
import torch  # noqa: E402
from _moe_testbed import build_testbed  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from optimum_prune import ExpertConfig, export_gguf, prune_  # noqa: E402
from optimum_prune.evaluation import compare_geometric_mean  # noqa: E402

logger = logging.getLogger("benchmarks.moe")
TEXTS = {"bbc": "BBC", "python_docs": "Python docs", "kjv": "KJV Bible"}
# the bed of record routes in balance, as trained MoE models do (benchmarks/notes/moe.md: how it was chosen);
# `--router-band 0 --router-balance 0` builds the unbalanced bed of `moe_smollm2_unbalanced`
ROUTER = {"lr": 3e-3, "batch": 512, "steps": 1500, "mse_steps": 500, "train_tokens": 12288, "profile_tokens": 4096,
          "balance": 0.1, "band": 0.1}  # fmt: skip

# name -> (label, ExpertConfig kwargs at expert-parameter ratio r)
ROWS = {
    "reap": ("REAP, experts", lambda r: {"expert_ratio": r}),
    "reap_router": ("REAP (routing weight as the gate), experts", lambda r: {"expert_ratio": r, "gate": "router"}),
    "ean": ("EAN (‖output‖ alone), experts", lambda r: {"expert_ratio": r, "criterion": "ean"}),
    "frequency": ("frequency, experts", lambda r: {"expert_ratio": r, "criterion": "frequency"}),
    "random": ("random (seed 0), experts", lambda r: {"expert_ratio": r, "criterion": "random"}),
    "channels": ("NP channels + refit, every expert kept", lambda r: {"expert_ratio": 0.0, "channel_ratio": r}),
    "channels_fluct": ("FLAP-metric channels + refit", lambda r: {"expert_ratio": 0.0, "channel_ratio": r,
                                                                    "channel_scores": "fluctuation"}),  # fmt: skip
    "mixed": ("REAP r/2 experts + NP channels + refit", lambda r: {"expert_ratio": r / 2,
                                                                   "channel_ratio": 1 - (1 - r) / (1 - r / 2)}),
}  # fmt: skip
ROUND_TO = 16  # channel widths: 192 → 144 (25%), 96 (50%), 128 (mixed 50%): exact fractions on the test bed


def load_testbed(args, dense, tokenizer, ids) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The test bed from `--testbed` (built there first when missing), and its build record."""
    path = Path(args.testbed)
    if not (path / "config.json").is_file():
        settings = {**ROUTER, "steps": args.router_steps, "mse_steps": args.router_mse_steps, "seed": args.seed,
                    "balance": args.router_balance, "band": args.router_band}  # fmt: skip
        t0 = time.perf_counter()
        work = path.with_name(path.name + ".layers")  # finished layers: a killed build continues from them
        moe, records, gap = build_testbed(dense, ids, args.experts, args.top_k, settings, work)
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        moe.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        record = {"experts": args.experts, "top_k": args.top_k, "router": settings, "layers": records,
                  "all_experts_max_logit_gap": gap, "build_s": time.perf_counter() - t0,
                  "calibration_ids_sum": int(ids.sum())}  # fmt: skip
        (tmp / "testbed.json").write_text(json.dumps(record, indent=1))
        tmp.rename(path)
        shutil.rmtree(work, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, json.loads((path / "testbed.json").read_text())


def llama_cpp_ppl(model, tokenizer, protocol, path: Path) -> dict[str, Any]:
    """The model exported to GGUF (f32) and scored by llama.cpp on the very token ids `protocol.evaluate` scores."""
    import _llamacpp  # the `llamacpp` extra; its absence raises an ImportError naming it

    from optimum_prune.export.gguf import gguf_layout

    export_gguf(model, path, "f32", tokenizer=tokenizer, overwrite=True)
    llm = _llamacpp.load(path, n_ctx=protocol.eval_seq_len, n_threads=1, logits_all=True)
    out = {"arch": gguf_layout(model)["arch"], "bytes": path.stat().st_size}
    for t in protocol.eval_texts:
        ids = tokenizer("\n\n".join(protocol.texts(t)))["input_ids"][: protocol.eval_tokens]
        out[t] = _llamacpp.perplexity(llm, ids, protocol.eval_seq_len)
    path.unlink()
    return out


def expert_params(model) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_model_args(p)
    harness.add_protocol_args(p)
    p.add_argument("--testbed", default=None, help="the test bed's folder (default: ~/.cache/optimum_prune/"
                   "smollm2_moe<experts>x<width>_top<k>[_bal<W>][_band<b>])")  # fmt: skip
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--router-steps", type=int, default=ROUTER["steps"], help="router training toward the best set")
    p.add_argument("--router-mse-steps", type=int, default=ROUTER["mse_steps"], help="then on the routed output")
    p.add_argument("--router-balance", type=float, default=ROUTER["balance"], help="weight of the load-balancing loss")
    p.add_argument("--router-band", type=float, default=ROUTER["band"],
                   help="balanced router targets: every expert the best "
                   "choice of top_k/experts ± this share of the tokens (0: the unconstrained best sets)")  # fmt: skip
    p.add_argument("--num-samples", type=int, default=32, help="calibration windows (router training, pruning)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--rows", nargs="*", default=["reap", "frequency", "random", "channels", "mixed"], choices=ROWS)
    p.add_argument("--ratios", nargs="+", type=float, default=[0.25, 0.5])
    p.add_argument("--round-to", type=int, default=ROUND_TO, help="channel widths: a multiple of this")
    p.add_argument("--gguf", nargs="*", default=[], help="rows (and 'moe') also scored in llama.cpp, exported f32")
    p.add_argument("--gguf-dir", default="/tmp/optimum_prune_moe_gguf")
    p.add_argument("--output", default=str(harness.RESULTS_DIR / "moe_smollm2.json"))
    args = p.parse_args(argv)
    harness.require_clean_tree(args)
    harness.setup_logging()
    dense, tok, desc = harness.load_model(args)
    if args.testbed is None:
        width = dense.config.intermediate_size // args.experts
        bal = f"_bal{args.router_balance:g}" if args.router_balance else ""
        bal += f"_band{args.router_band:g}" if args.router_band else ""
        args.testbed = str(
            Path.home() / ".cache" / "optimum_prune" / f"smollm2_moe{args.experts}x{width}_top{args.top_k}{bal}"
        )
    protocol = harness.Protocol.from_args(args)
    ids = protocol.calibration_ids(tok, args.num_samples, args.seq_len)
    moe, testbed = load_testbed(args, dense, tok, ids)
    result: dict[str, Any] = {"environment": harness.environment(argv, "moe.py"), "model": desc,
                              "settings": vars(args), "testbed": testbed, "rows": []}  # fmt: skip
    out = Path(args.output)

    def evaluate(name: str, label: str, model, ratio: float | None, config: dict | None, seconds: float = 0.0):
        ppl, docs = protocol.evaluate(model, tok)
        row = {"name": name, "label": label, "ratio": ratio, "config": config, "ppl": ppl, "documents": docs,
               "expert_params": expert_params(model), "prune_s": seconds}  # fmt: skip
        if name in args.gguf:
            row["llama_cpp"] = llama_cpp_ppl(model, tok, protocol, Path(args.gguf_dir) / f"{name}_{ratio}.gguf")
        result["rows"].append(row)
        result["protocol"] = protocol.record(result.get("protocol"))
        logger.info("%s @ %s: %s", label, ratio, {k: round(v, 2) for k, v in ppl.items()})
        harness.write_results(result, out, "moe")

    evaluate("dense", f"dense {desc}", dense, None, None)
    evaluate("moe", "test bed (MoE, not pruned)", moe, None, None)
    for ratio in args.ratios:
        for name in args.rows:
            label, kwargs = ROWS[name]
            config = ExpertConfig(round_to=args.round_to, seed=args.seed, **kwargs(ratio))
            model = copy.deepcopy(moe)
            t0 = time.perf_counter()
            prune_(model, config, ids)
            evaluate(name, label, model, ratio, config.to_dict(), time.perf_counter() - t0)
            del model
    return 0


# ---------------------------------------------------------------------------------------------------------- markdown
def _criterion(rows: list[dict], base: dict[float, dict]) -> str:
    """The selection criterion's Δ (geometric mean of the texts' perplexities) of each row against REAP at its ratio."""
    lines = [
        "",
        "Geometric mean of the texts' perplexities (the selection criterion), Δ against REAP at each ratio:",
        "",
    ]
    for r in rows:
        ref = base[r["ratio"]]
        texts = [t for t in TEXTS if t in r["documents"] and t in ref["documents"]]
        c = compare_geometric_mean(
            [(r["documents"][t]["nll"], r["documents"][t]["tokens"]) for t in texts],
            [(ref["documents"][t]["nll"], ref["documents"][t]["tokens"]) for t in texts],
        )
        lines.append(f"- {r['ratio']:g}, {r['label']}: {100 * c.delta:+.1f}% [{100 * c.low:+.1f}, {100 * c.high:+.1f}]"
                     f" {c.verdict}")  # fmt: skip
    return "\n".join(lines)


def _balance_line(tb: dict[str, Any]) -> str | None:
    """How evenly the bed routes, from its build record (beds built before it was recorded have none)."""
    layers = [r for r in tb["layers"] if "max_expert_share" in r]
    if not layers:
        return None
    top = max(layers, key=lambda r: r["max_expert_share"])
    mid = statistics.median(r["max_expert_share"] for r in layers)
    return (f"- Routing on the router's training tokens (an even share: {tb['top_k'] / tb['experts']:g} of the tokens "
            f"per expert): the largest share an expert takes is {top['max_expert_share']:.2f} (layer {top['layer']}), "
            f"the median over layers of each layer's largest share {mid:.2f}, the smallest share in any layer "
            f"{min(r['min_expert_share'] for r in layers):.2f}.")  # fmt: skip


def markdown(res: dict[str, Any]) -> str:
    s, tb, rows = res["settings"], res["testbed"], res["rows"]
    texts = [(t, TEXTS[t]) for t in s["eval_texts"]]
    by_name = {r["name"]: r for r in rows if r["ratio"] is None}
    dense, moe = by_name.get("dense"), by_name.get("moe")
    lines = [
        f"# Expert pruning on a mixture-of-experts test bed built from {res['model']}",
        "",
        f"Generated by `benchmarks/moe.py` on {res['environment']['date']} (optimum_prune @ "
        f"{str(res['environment']['versions']['git_commit'])[:10]}): `{res['environment']['command']}`.",
        "",
        f"- Test bed: {res['model']} with each MLP split into {tb['experts']} experts of co-activated channels, "
        f"top-{tb['top_k']} routing; routers trained on the calibration split ({tb['router']['steps']} steps toward "
        f"the best set of {tb['top_k']} experts, {tb['router']['mse_steps']} on the routed output's error"
        + (f", load-balancing loss at weight {tb['router']['balance']:g}" if tb["router"].get("balance") else "")
        + (
            f", targets balanced to {tb['top_k'] / tb['experts']:g} ± {tb['router']['band']:g} of the tokens per expert"
            if tb["router"].get("band")
            else ""
        )
        + "); with every expert "
        f"chosen the conversion reproduces the dense logits to {tb['all_experts_max_logit_gap']:.1e}.",
        _balance_line(tb),
        f"- Pruning: `ExpertConfig` on {s['num_samples']} × {s['seq_len']} calibration tokens (BBC), channel widths "
        f"rounded to multiples of {s['round_to']}; ratio = fraction of the expert parameters removed.",
        harness.protocol_line(res),
    ]
    if dense and moe:
        lines += ["", "## The test bed", ""]
        lines += harness.interval_table(
            [{"group": "–", "label": "dense", "ppl": dense["ppl"], "docs": dense["documents"], "ref": None},
             {"group": "–", "label": "MoE test bed", "ppl": moe["ppl"], "docs": moe["documents"],
              "ref": {"ppl": dense["ppl"], "docs": dense["documents"]}}],
            texts, group="", baseline="dense")  # fmt: skip
    pruned = [r for r in rows if r["ratio"] is not None]
    base = {r["ratio"]: r for r in pruned if r["name"] == "reap"}
    if pruned:
        total = moe["expert_params"] if moe else None
        lines += ["", "## Pruned (Δ against REAP at the same ratio)", ""]
        table = []
        for r in pruned:
            kept = f", {100 * (1 - r['expert_params'] / total):.1f}% expert params removed" if total else ""
            ref = base.get(r["ratio"])
            table.append({"group": f"{r['ratio']:g}", "label": r["label"] + kept, "ppl": r["ppl"],
                          "docs": r["documents"],
                          "ref": None if ref is None or ref is r else {"ppl": ref["ppl"], "docs": ref["documents"]}})  # fmt: skip
        lines += harness.interval_table(table, texts, group="ratio", baseline="REAP")
        if base:
            lines.append(_criterion([r for r in pruned if r["name"] != "reap" and r["ratio"] in base], base))
    checked = [r for r in rows if r.get("llama_cpp")]
    if checked:
        lines += ["", "## The same models in llama.cpp (GGUF f32, the same tokens)", "",
                  "| ratio | model | llama.cpp arch | " + " | ".join(f"{lab}: transformers / llama.cpp" for _, lab in texts)
                  + " |", "|---:|---|---|" + "---:|" * len(texts)]  # fmt: skip
        for r in checked:
            c = r["llama_cpp"]
            cells = [f"{r['ppl'][t]:.3f} / {c[t]:.3f}" for t, _ in texts]
            ratio = "–" if r["ratio"] is None else f"{r['ratio']:g}"
            lines.append(f"| {ratio} | {r['label']} | `{c['arch']}` | " + " | ".join(cells) + " |")
    return "\n".join(line for line in lines if line is not None) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
