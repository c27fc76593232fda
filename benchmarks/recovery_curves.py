"""Recovery at a token budget: how much of what pruning lost comes back per training token, by LoRA, full fine-tuning
and distillation from the dense model, on SmolLM2-135M (CPU, fp32 unless `--bf16`).

Two modes. `--throughput`: training tokens per second of every recipe in fp32 and bf16 autocast (a few timed steps
after a warm-up, on the dense model), to size the budgets. Otherwise, curves: every model of `--methods` is pruned
once on the calibration windows and scored on the protocol's split of the three texts; then every recipe of
`--recipes` trains it once for the largest of `--budgets` tokens on the calibration split's BBC documents (streamed,
never an evaluation document), the three texts scored at every budget on the way (`FinetuneConfig.eval_at_tokens`'s
checkpoints: the learning-rate schedule spans the whole run, so an early point is that moment of the long run). Each
point reports the perplexities with document-bootstrap intervals and the share of the pruning gap recovered per
text, `(ppl_pruned - ppl_recovered) / (ppl_pruned - ppl_dense)`; a negative share is a text made worse by recovery.
Rows are written after every run, so an interrupted run keeps what finished; a rerun skips the recipes it has, and
processes running different `--methods` into one `--output` merge their rows.

    OMP_NUM_THREADS=1 python benchmarks/recovery_curves.py --throughput
    OMP_NUM_THREADS=1 python benchmarks/recovery_curves.py --split selection --methods np20 --budgets 4096 32768 \\
        --recipes lora full kd --lr lora=3e-4 full=3e-5 kd=3e-5 --output /tmp/rc_sel.json
"""

from __future__ import annotations

import argparse
import copy
import fcntl
import gc
import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TQDM_DISABLE", "1")

import harness  # noqa: E402
import torch  # noqa: E402
from _intervals import delta_cell, ppl_cell  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from optimum_prune import FinetuneConfig, FISTAConfig, FLAPConfig, NumericalConfig, finetune_, prune_  # noqa: E402
from optimum_prune.finetune.progress import TokenCheckpoints  # noqa: E402

logger = logging.getLogger("recovery_curves")
RESULTS = harness.RESULTS_DIR
TEXTS = {"bbc": "BBC", "python_docs": "Python docs", "kjv": "Bible"}

METHODS = {
    "np20": ("NP 20%", lambda a: NumericalConfig(pruning_ratio=0.2)),
    "np50": ("NP 50%", lambda a: NumericalConfig(pruning_ratio=0.5)),
    "flap20": ("FLAP 20%", lambda a: FLAPConfig(pruning_ratio=0.2)),
    "fista24": ("FISTA 2:4", lambda a: FISTAConfig(sparsity=0.5, pattern="2:4", max_outer=a.fista_max_outer)),
}
# recipe -> (label, FinetuneConfig fields, default learning rate); "kd" is full fine-tuning with logit distillation,
# "kdh" adds the hidden-state term at weight `--hidden-weight`
RECIPES = {
    "lora": ("LoRA r=16", {"method": "lora", "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.0}, 3e-4),
    "full": ("full", {"method": "full"}, 3e-5),
    "kd": ("full + KD", {"method": "full", "distill": "kl", "distill_alpha": 0.5}, 3e-5),
    "kdh": ("full + KD + hidden", {"method": "full", "distill": "kl", "distill_alpha": 0.5}, 3e-5),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--throughput", action="store_true", help="measure training tokens/s of every recipe and dtype")
    p.add_argument("--methods", nargs="+", default=["np20", "np50"], choices=list(METHODS))
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--budgets", nargs="+", type=int, default=[4096, 32768, 262144], help="training tokens")
    p.add_argument("--lr", nargs="*", default=[], metavar="RECIPE=LR[,LR...]",
                   help="learning rate(s) per recipe (several: one run each, a screen)")  # fmt: skip
    p.add_argument("--batch-size", type=int, default=2, help="training sequences per step")
    p.add_argument("--seq-len", type=int, default=512, help="training sequence length")
    p.add_argument("--warmup-fraction", type=float, default=0.05, help="linear warm-up, share of the run's steps")
    p.add_argument("--bf16", action="store_true", help="train under bf16 autocast (Trainer bf16=True)")
    p.add_argument("--num-samples", type=int, default=16, help="calibration windows of the pruning")
    p.add_argument("--calib-seq-len", type=int, default=512)
    p.add_argument("--hidden-weight", type=float, default=10.0,
                   help="distill_hidden_weight of the 'kdh' recipe (one weight per process: rerun for a screen)")  # fmt: skip
    p.add_argument("--fista-max-outer", type=int, default=3, help="FISTA outer-step cap")
    p.add_argument("--throughput-steps", type=int, default=4, help="timed steps per recipe (after one warm-up)")
    p.add_argument("--workdir", default="/tmp/recovery_curves", help="pruned models kept here for a rerun")
    p.add_argument("--separate-budgets", action="store_true",
                   help="one run per budget, its schedule that budget's length (the per-budget screen), instead of "
                   "one run to the largest budget with checkpoints")  # fmt: skip
    p.add_argument("--train-texts", nargs="+", default=["bbc"], choices=list(TEXTS),
                   help="training text: the calibration split of these texts (several: an equal share of each)")  # fmt: skip
    harness.add_protocol_args(p)
    harness.add_model_args(p)
    p.set_defaults(threads=1)
    p.add_argument("--output", default=None, help="results JSON (default: by mode and split)")
    args = p.parse_args(argv)
    args.lr = {k: [float(v) for v in vs.split(",")] for k, vs in (x.split("=", 1) for x in args.lr)}
    unknown = set(args.lr) - set(RECIPES)
    if unknown:
        p.error(f"--lr names unknown recipes {sorted(unknown)}; known: {', '.join(RECIPES)}")
    if args.output is None:
        name = "recovery_throughput_smollm2" if args.throughput else f"recovery_curves_smollm2_{args.split}"
        args.output = str(RESULTS / f"{name}.json")
    args.budgets = sorted(set(args.budgets))
    return args


def training_documents(protocol, texts: list[str]) -> tuple[list[str], dict[str, Any]]:
    """The calibration-split documents of `texts`; with several, each text's first documents (the split's seeded
    order) up to the smallest text's characters, so every text gives an equal share of the training tokens."""
    per_text = {t: protocol.documents(t, "calibration") for t in texts}
    cap = min(sum(map(len, docs)) for docs in per_text.values()) if len(texts) > 1 else None
    chosen, record = [], {}
    for t, docs in per_text.items():
        taken, chars = [], 0
        for d in docs:
            if cap is not None and chars >= cap:
                break
            taken.append(d)
            chars += len(d)
        chosen += taken
        record[t] = {"documents": len(taken), "chars": chars, "sha256": harness.documents_hash(taken)}
    return chosen, record


def run_name(args, recipe: str, lr: float, budget: int) -> str:
    texts = "" if args.train_texts == ["bbc"] else " on " + "+".join(args.train_texts)
    return f"{recipe_label(args, recipe, short=True)}@{lr:g}:{budget}{texts}"


def recipe_label(args, recipe: str, short: bool = False) -> str:
    """The recipe's name; the hidden-state recipe names its weight."""
    name = recipe if short else RECIPES[recipe][0]
    return f"{name} x{args.hidden_weight:g}" if recipe == "kdh" else name


def learning_rates(args, recipe: str) -> list[float]:
    return args.lr.get(recipe) or [RECIPES[recipe][2]]


def finetune_config(args, recipe: str, budget: int, lr: float | None = None) -> FinetuneConfig:
    _, fields, _ = RECIPES[recipe]
    steps = -(-budget // (args.batch_size * args.seq_len))
    # on a CPU the Trainer runs bf16 autocast only with use_cpu
    training_args = {"bf16": True, "use_cpu": not torch.cuda.is_available()} if args.bf16 else {}
    if recipe == "kdh":
        fields = {**fields, "distill_hidden_weight": args.hidden_weight}
    return FinetuneConfig(
        **fields, learning_rate=lr or learning_rates(args, recipe)[0], token_budget=budget, batch_size=args.batch_size,
        seq_len=args.seq_len, warmup_steps=max(1, round(args.warmup_fraction * steps)), eval_fraction=0.01,
        eval_max_tokens=2 * args.seq_len, streaming=True, training_args=training_args,
    )  # fmt: skip


class _StepTimes(TrainerCallback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._t = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._t)


def throughput(args, dense, tokenizer, train_docs, result: dict) -> None:
    """Tokens/s of every recipe, fp32 and bf16 autocast: the median of `--throughput-steps` steps after one."""
    steps = args.throughput_steps + 1
    for recipe in args.recipes:
        for bf16 in (False, True):
            key = f"{recipe}{'_bf16' if bf16 else ''}"
            model = copy.deepcopy(dense)
            run_args = argparse.Namespace(**{**vars(args), "bf16": bf16})
            cfg = finetune_config(run_args, recipe, steps * args.batch_size * args.seq_len)
            timer = _StepTimes()
            load0 = harness.loadavg()
            finetune_(model, cfg, train_docs, tokenizer, teacher=dense if cfg.distill else None, callbacks=[timer])
            per_step = statistics.median(timer.times[1:])
            tokens = args.batch_size * args.seq_len
            result["throughput"][key] = {
                "recipe": recipe, "bf16": bf16, "step_s": timer.times, "tokens_per_step": tokens,
                "tokens_per_s": tokens / per_step, "load_average": [load0, harness.loadavg()],
            }  # fmt: skip
            logger.info("%s: %.0f tokens/s", key, tokens / per_step)
            harness.write_results(result, Path(args.output), renderer="recovery_curves")
            del model
            gc.collect()


def pruned_model(args, key: str, dense, calib):
    """The model `key` prunes, saved in `--workdir` by the same library code (reloaded on a rerun)."""
    from optimum_prune import load_pruned_model, save_pruned_model

    path = Path(args.workdir) / key
    tree = harness._git("rev-parse", "HEAD:optimum_prune")
    stamp = path / "library_tree.txt"
    if stamp.is_file() and stamp.read_text() == str(tree):
        return load_pruned_model(path).eval(), json.loads((path / "report.json").read_text())
    model = copy.deepcopy(dense)
    report = prune_(model, METHODS[key][1](args), calib)
    info = {"config": report.config, "params_after": report.params_after, "prune_s": report.timings.get("total_s")}
    save_pruned_model(model, path, overwrite=True)
    (path / "report.json").write_text(json.dumps(info, default=str))
    stamp.write_text(str(tree))
    return model, info


def train_label(texts: list[str]) -> str:
    return "" if texts == ["bbc"] else ", trained on " + " + ".join(TEXTS[t] for t in texts)


def curves(args, dense, tokenizer, protocol, train_docs, train_record, calib, result, out: Path) -> None:
    def write() -> None:
        result["protocol"] = protocol.record(result.get("protocol"))
        with open(out.with_suffix(".lock"), "a") as lock:  # processes running other methods merge into one file
            fcntl.flock(lock, fcntl.LOCK_EX)
            disk = json.loads(out.read_text()) if out.is_file() else {}
            for key, row in disk.get("rows", {}).items():
                if key not in args.methods:
                    result["rows"][key] = row
            harness.write_results(result, out, renderer="recovery_curves")

    if "dense" not in result:
        ppl, docs = protocol.evaluate(dense, tokenizer)
        result["dense"] = {"ppl": ppl, "docs": docs}
        write()
    for key in args.methods:
        row = result["rows"].setdefault(key, {"name": METHODS[key][0], "runs": {}})
        model, info = pruned_model(args, key, dense, calib)
        row["prune"] = info
        if "pruned" not in row:
            ppl, docs = protocol.evaluate(model, tokenizer)
            row["pruned"] = {"ppl": ppl, "docs": docs}
            write()
        runs = [(r, lr, b) for r in args.recipes for lr in learning_rates(args, r)
                for b in (args.budgets if args.separate_budgets else args.budgets[-1:])]  # fmt: skip
        for recipe, lr, budget in runs:
            name = run_name(args, recipe, lr, budget)
            if row["runs"].get(name, {}).get("complete"):
                continue
            cfg = finetune_config(args, recipe, budget, lr)
            checkpoints = [budget] if args.separate_budgets else args.budgets
            points = TokenCheckpoints(checkpoints, cfg.tokens_per_step, lambda m: _scores(protocol, m, tokenizer))
            student = copy.deepcopy(model)
            load0 = harness.loadavg()
            _, rep = finetune_(student, cfg, train_docs, tokenizer, teacher=dense if cfg.distill else None,
                               callbacks=[points])  # fmt: skip
            row["runs"][name] = {
                "recipe": recipe, "budget": budget,
                "label": f"{recipe_label(args, recipe)}, lr {lr:g}{train_label(args.train_texts)}",
                "config": rep.config, "train_texts": train_record,
                "points": points.points, "complete": True, "train_runtime_s": rep.train_runtime_s,
                "tokens_seen": rep.tokens_seen, "trainable_params": rep.trainable_params,
                "loss_history": rep.loss_history, "load_average": [load0, harness.loadavg()],
                "commit": result["versions"]["git_commit"],  # this process's (a resumed file mixes runs)
            }  # fmt: skip
            write()
            del student
            gc.collect()
        del model
        gc.collect()


def _scores(protocol, model, tokenizer) -> dict[str, Any]:
    ppl, docs = protocol.evaluate(model, tokenizer)
    return {"ppl": ppl, "docs": docs}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    harness.setup_logging()
    for name in ("datasets", "transformers", "httpx"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("optimum_prune.finetune").setLevel(logging.INFO)
    torch.manual_seed(0)
    out = Path(args.output)
    dense, tokenizer, model_desc = harness.load_model(args)
    protocol = harness.Protocol.from_args(args)
    train_docs, train_record = training_documents(protocol, args.train_texts)
    result: dict[str, Any] = json.loads(out.read_text()) if out.is_file() and not args.throughput else {}
    if result and result.get("args", {}).get("split") != args.split:
        raise SystemExit(f"{out} holds a run on another split; give another --output")
    result.update({**harness.environment(argv), "model": model_desc, "args": vars(args)})
    result.setdefault("rows", {})
    if args.throughput:
        result["throughput"] = {}
        throughput(args, dense, tokenizer, train_docs, result)
    else:
        calib = protocol.calibration_ids(tokenizer, args.num_samples, args.calib_seq_len)
        curves(args, dense, tokenizer, protocol, train_docs, train_record, calib, result, out)
        result["protocol"] = protocol.record(result.get("protocol"))
    harness.write_results(result, out, renderer="recovery_curves")
    return 0


# ---------------------------------------------------------------------------------------------------------- report
def gap_recovered(dense: float, pruned: float, recovered: float) -> float | None:
    """The share of the pruning gap a recovery won back (1 = dense again, 0 = nothing, < 0 = worse than pruned)."""
    gap = pruned - dense
    return None if gap <= 0 else (pruned - recovered) / gap


def markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    lines = [f"# Recovery at a token budget: {result['model']}", ""]
    lines.append(f"Generated by `benchmarks/recovery_curves.py` ({result.get('date', '')}).")
    lines.append("")
    if "throughput" in result:
        lines += [f"Training throughput, batch {a['batch_size']} × {a['seq_len']} tokens, {a['threads']} thread(s); "
                  "median of the timed steps after a warm-up step, on the dense model (a pruned one is faster).", "",
                  "| recipe | dtype | tokens / s | s / step | hours per 1M tokens |", "|---|---|---:|---:|---:|"]  # fmt: skip
        for r in result["throughput"].values():
            tps = r["tokens_per_s"]
            lines.append(f"| {RECIPES[r['recipe']][0]} | {'bf16 autocast' if r['bf16'] else 'fp32'} | {tps:.0f} | "
                         f"{r['tokens_per_step'] / tps:.2f} | {1e6 / tps / 3600:.2f} |")  # fmt: skip
        return "\n".join(lines) + "\n"
    lines.append(harness.protocol_line(result))
    lines += ["", "- Training: the calibration split's BBC documents (a run marked \"trained on\" several texts: the "
              "calibration split of each, an equal share of characters from each), streamed, batch "
              f"{a['batch_size']} × {a['seq_len']} tokens per step, a cosine schedule over the run's budget with "
              f"{a['warmup_fraction']:.0%} warm-up, the learning rate and dtype (fp32 or bf16 autocast) in its label. "
              "KD: 0.5 · T²·KL(dense ‖ student, T = 2) + 0.5 · LM loss.",
              "- A point below its run's budget is a checkpoint of that run (the schedule spans the whole run).",
              "- Gap recovered: (ppl pruned − ppl recovered) / (ppl pruned − ppl dense) per text; negative = worse "
              "than the pruned model.", ""]  # fmt: skip
    dense = result.get("dense")
    if dense:
        lines.append("Dense: " + ", ".join(f"{TEXTS[t]} {ppl_cell(dense['ppl'][t], dense['docs'][t])}"
                                           for t in dense["ppl"]))  # fmt: skip
        lines.append("")
    for row in result.get("rows", {}).values():
        pruned = row.get("pruned")
        if not pruned:
            continue
        texts = list(pruned["ppl"])
        lines += [f"## {row['name']}", ""]
        head = (
            ["recipe", "run's budget", "tokens"]
            + [f"{TEXTS[t]} [95%]" for t in texts]
            + [f"{TEXTS[t]} Δ vs pruned" for t in texts]
        )
        head += [f"{TEXTS[t]} gap recovered" for t in texts] + ["train s"]
        lines += ["| " + " | ".join(head) + " |", "|---|---:|---:|" + "---:|" * (3 * len(texts) + 1)]
        cells = ["no recovery", "", "0"] + [ppl_cell(pruned["ppl"][t], pruned["docs"][t]) for t in texts]
        lines.append("| " + " | ".join(cells + [""] * (2 * len(texts)) + [""]) + " |")
        for run in row.get("runs", {}).values():
            for p in run["points"]:
                cells = [f"{run['label']}, {run_dtype(run)}", f"{run_budget(run):,}", f"{p['tokens']:,}"]
                cells += [ppl_cell(p["ppl"][t], p["docs"][t]) for t in texts]
                cells += [delta_cell(p["ppl"][t], pruned["ppl"][t], p["docs"][t], pruned["docs"][t]) for t in texts]
                for t in texts:
                    share = gap_recovered(dense["ppl"][t], pruned["ppl"][t], p["ppl"][t]) if dense else None
                    cells.append("–" if share is None else f"{share:+.0%}")
                cells.append(f"{p['elapsed_s']:.0f}")
                lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        lines += _screen(row, texts)
    return "\n".join(lines) + "\n"


def geomean(ppl: dict[str, float]) -> float:
    return statistics.geometric_mean(ppl.values())


def run_dtype(run: dict[str, Any]) -> str:
    return "bf16" if run["config"].get("training_args", {}).get("bf16") else "fp32"


def run_budget(run: dict[str, Any]) -> int:
    """The token budget a run's schedule spans (its last checkpoint)."""
    return run.get("budget") or run["points"][-1]["tokens"]


def _screen(row: dict[str, Any], texts: list[str]) -> list[str]:
    """Per budget, training text and recipe, its runs ranked by the criterion fixed in advance: the geometric mean of
    the three texts' perplexities at the run's budget (lower is better); then per budget and training text the
    recipes' best runs ranked the same way (runs trained on other texts are not learning-rate variants)."""
    by_budget: dict[tuple[int, str], dict[str, list[tuple[float, str]]]] = {}
    for run in row.get("runs", {}).values():
        if run["points"] and run["points"][-1]["tokens"] >= run_budget(run):
            recipe = run["label"].split(", lr ")[0]  # the recipe as labelled (the hidden-state weight included)
            trained = run["label"].partition(", trained on ")[2]
            by_budget.setdefault((run_budget(run), trained), {}).setdefault(recipe, []).append(
                (geomean(run["points"][-1]["ppl"]), run["label"].partition(", trained on ")[0])
            )
    lines = []
    for (budget, trained), recipes in sorted(by_budget.items()):
        where = f"{budget:,} tokens" + (f" trained on {trained}" if trained else "")
        best = []
        for recipe, runs in recipes.items():
            ranked = sorted(runs)
            best.append(ranked[0])
            if len(ranked) > 1:
                lines.append(f"- {where}, {recipe}: "
                             + ", ".join(f"{label.split('lr ')[-1]} {g:.2f}" for g, label in ranked)
                             + f" -> best lr {ranked[0][1].split('lr ')[-1]}")  # fmt: skip
        if len(best) > 1:
            best.sort()
            lines.append(f"- {where}, best recipe: {best[0][1]} ({best[0][0]:.2f}; next "
                         f"{best[1][1]} {best[1][0]:.2f})")  # fmt: skip
    if not lines:  # one run per budget and recipe: nothing ranked
        return []
    return ["Screen (geometric mean of the three texts at the run's budget; lower is better):", "", *lines, ""]


if __name__ == "__main__":
    raise SystemExit(main())
