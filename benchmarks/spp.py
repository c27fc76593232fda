"""Solution Path Pruning on SmolLM2-135M: one search, a family of structured models, against NP and FLAP at the same
ratios (before and after a short LoRA recovery), and SPP + RIA against RIA and Wanda at 50%.

Phases (each resumable: results are written after every model, a finished item is never recomputed):

    quality       dense; one SPP search (its path is kept in --workdir); SPP extracted at each ratio; NP and FLAP
                  pruned at each ratio; held-out BBC and Python-docs perplexity; every pruned model saved in --workdir
    recovery      LoRA on each saved model (the same windows for all), perplexity after
    unstructured  SPP + RIA vs RIA vs Wanda at 50% on the same calibration ids
    ablation      other dynamics (coupled, paper) and extraction choices (step_record, cost-weighted pool, folded
                  masks) against the default path and a random order, at --ablation-ratios, before recovery
    speed         prefill / decode speed of dense vs SPP / NP / FLAP at each ratio, interleaved (timings: run it
                  alone under the timing lock, at normal priority)

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/spp.py --phases quality recovery unstructured
    flock /tmp/optimum_prune_timing.lock python benchmarks/spp.py --phases speed

The DINOv2-S/14 CIFAR-10 family (one search on labelled calibration images, every ratio extracted, accuracy before /
after fine-tuning, latency) against magnitude runs in `benchmarks/vision.py` (its data and protocol):

    nice -n 10 python benchmarks/vision.py --methods spp magnitude --ratios 0.2 0.4 --ft-lr 1e-5 \
        --output benchmarks/results/vision_dinov2s_cifar10_spp.json
    flock /tmp/optimum_prune_timing.lock python benchmarks/vision.py --timing \
        --output benchmarks/results/vision_dinov2s_cifar10_spp.json
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks._shared import head_documents, reuse_calibration_pass  # noqa: E402
from benchmarks._spp_report import markdown  # noqa: E402
from optimum_prune import (  # noqa: E402
    AutoPrunedModelForCausalLM,
    CalibrationConfig,
    FinetuneConfig,
    FLAPConfig,
    NumericalConfig,
    RIAConfig,
    SolutionPath,
    SPPConfig,
    SPPRIAConfig,
    WandaConfig,
    finetune_,
    prune_,
    save_pruned_model,
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
from optimum_prune.evaluation import compare_speed, perplexity  # noqa: E402
from optimum_prune.methods.spp import search_solution_path  # noqa: E402

RESULTS = Path(__file__).parent / "results"
logger = logging.getLogger("spp")
STRUCTURED = ("spp", "np", "flap")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phases", nargs="+", default=["quality", "ablation", "recovery", "unstructured"],
                   choices=["quality", "recovery", "unstructured", "ablation", "speed"])  # fmt: skip
    p.add_argument("--ratios", nargs="+", type=float, default=[0.1, 0.2, 0.3, 0.5])
    p.add_argument("--num-samples", type=int, default=64, help="calibration sequences (all methods)")
    p.add_argument("--calib-seq-len", type=int, default=256)
    p.add_argument("--search-steps", type=int, default=300, help="SPP search steps (batch 1)")
    p.add_argument("--search-lr", type=float, default=None, help="default: SPPConfig's")
    p.add_argument("--search-lambda", type=float, default=None, help="default: SPPConfig's")
    p.add_argument("--ria-search-steps", type=int, default=48, help="SPP + RIA elementwise search steps")
    p.add_argument("--eval-tokens", type=int, default=2048, help="tokens of each perplexity corpus")
    p.add_argument("--eval-seq-len", type=int, default=512)
    p.add_argument("--lora-steps", type=int, default=16)
    p.add_argument("--lora-batch-size", type=int, default=2)
    p.add_argument("--lora-seq-len", type=int, default=128)
    p.add_argument("--lora-lr", type=float, default=1e-3)
    p.add_argument("--speed-repeats", type=int, default=5)
    p.add_argument("--ablation-ratios", nargs="+", type=float, default=[0.1, 0.2, 0.3])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--workdir", default="/tmp/spp_bench", help="the solution path and the pruned models")
    p.add_argument("--output", default=str(RESULTS / "spp_smollm2.json"))
    return p.parse_args(argv)


def _git() -> str | None:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def write(res: dict, path: Path) -> None:
    res["load_average_now"] = os.getloadavg()[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2, default=str) + "\n", encoding="utf-8")
    path.with_suffix(".md").write_text(markdown(res), encoding="utf-8")


def spp_config(args, ratio: float = 0.2, **kw) -> SPPConfig:
    search = {"steps": args.search_steps}
    if args.search_lr is not None:
        search["lr"] = args.search_lr
    if args.search_lambda is not None:
        search["lambda_"] = args.search_lambda
    return SPPConfig(pruning_ratio=ratio, **search, **kw)


def evaluate(model, tokenizer, data, args) -> dict[str, float]:
    t0 = time.perf_counter()
    out = {name: perplexity(model, tokenizer, data[name], seq_len=args.eval_seq_len, max_tokens=args.eval_tokens)
           for name in ("bbc", "python")}  # fmt: skip
    out["eval_s"] = time.perf_counter() - t0
    return out


def phase_quality(res, args, dense, tokenizer, data, calib, work: Path, out: Path) -> None:
    if "dense" not in res:
        res["dense"] = {**evaluate(dense, tokenizer, data, args), "params": sum(p.numel() for p in dense.parameters())}
        write(res, out)
    path_dir = work / "solution_path"
    if not (path_dir / "solution_path.json").is_file():
        path = search_solution_path(dense, spp_config(args), calib)
        path.save_pretrained(path_dir, overwrite=True)
    path = SolutionPath.from_pretrained(path_dir)
    res["search"] = {**path.summary(), "loss_history": path.meta.get("loss_history"),
                     "support": {k: v.tolist() for k, v in path.support.items()},
                     "path_bytes": sum(f.stat().st_size for f in path_dir.iterdir()), "settings": path.meta["search"]}  # fmt: skip
    write(res, out)
    configs = {
        "spp": lambda r: spp_config(args, r, solution_path=str(path_dir)),
        "np": lambda r: NumericalConfig(pruning_ratio=r),
        "flap": lambda r: FLAPConfig(pruning_ratio=r),
    }
    with reuse_calibration_pass():
        for ratio in args.ratios:
            for method in STRUCTURED:
                key = f"{method}@{ratio}"
                if key in res["rows"] and (work / "models" / key).is_dir():
                    continue
                model = copy.deepcopy(dense)
                config = configs[method](ratio)
                report = prune_(model, config, None if method == "spp" else calib)
                row = {"method": method, "ratio": ratio, "measured": report.measured, "params": report.params_after,
                       "prune_s": report.timings["total_s"], "config": report.config}  # fmt: skip
                if method == "spp":
                    row["extract_s"] = report.info["extract_s"]
                    row["layers"] = [(x.get("qk_head_dim", x["head_dim"]), x.get("vo_head_dim", x["head_dim"]),
                                      x["intermediate_size"]) for x in report.layers]  # fmt: skip
                row["pruned"] = evaluate(model, tokenizer, data, args)
                save_pruned_model(model, work / "models" / key, tokenizer, overwrite=True)
                res["rows"][key] = row
                logger.info("%s: %s", key, row["pruned"])
                write(res, out)
                del model
                gc.collect()


def phase_recovery(res, args, dense, tokenizer, data, train_docs, work: Path, out: Path) -> None:
    ft = FinetuneConfig(
        method="lora", max_steps=args.lora_steps, batch_size=args.lora_batch_size, seq_len=args.lora_seq_len,
        learning_rate=args.lora_lr, lora_r=16, lora_alpha=32, warmup_steps=max(1, args.lora_steps // 10),
        eval_fraction=0.02, eval_max_tokens=2 * args.lora_seq_len,
    )  # fmt: skip
    res["finetune_config"] = ft.to_dict()
    for key, row in res["rows"].items():
        if "lora" in row or not (work / "models" / key).is_dir():
            continue
        model = AutoPrunedModelForCausalLM.from_pretrained(work / "models" / key).eval()
        model, rep = finetune_(model, ft, train_docs, tokenizer)
        row["lora"] = {**evaluate(model, tokenizer, data, args), "train_s": rep.train_runtime_s,
                       "train_loss": rep.train_loss}  # fmt: skip
        logger.info("%s + LoRA: %s", key, row["lora"])
        write(res, out)
        del model
        gc.collect()


def phase_unstructured(res, args, dense, tokenizer, data, calib, out: Path) -> None:
    configs = {
        "spp_ria": SPPRIAConfig(sparsity=0.5, steps=args.ria_search_steps),
        "ria": RIAConfig(sparsity=0.5),
        "wanda": WandaConfig(sparsity=0.5),
    }
    for name, config in configs.items():
        if name in res["unstructured"]:
            continue
        model = copy.deepcopy(dense)
        report = prune_(model, config, calib)
        res["unstructured"][name] = {"measured": report.measured, "prune_s": report.timings["total_s"],
                                     "config": report.config, "search": report.info.get("search"),
                                     **evaluate(model, tokenizer, data, args)}  # fmt: skip
        logger.info("%s: %s", name, res["unstructured"][name])
        write(res, out)
        del model
        gc.collect()


# name -> (search settings, or None for the default path; extraction settings). The coupled and paper searches ran
# 150 steps and did not enter every unit: they are cut with extrapolate=True (never-entered units ranked by Z).
ABLATION = {
    "default": (None, {}),
    "step_record": (None, {"statistic": "step_record"}),
    "cost_weighted": (None, {"pools": "cost_weighted"}),
    "fold_masks": (None, {"fold_masks": True}),
    "coupled": ({"steps": 150, "lr": 0.01, "lambda_": 1.0, "nu": 100.0, "coupling": True}, {"extrapolate": True}),
    "paper": ({"steps": 150, "faithful_to": "paper", "lr": 3.0, "lambda_": 0.5, "nu": 300.0}, {"extrapolate": True}),
    "random": (None, {}),
}


def _random_path(path_dir: Path, out_dir: Path) -> None:
    """The default path with every pool's order replaced by a random one (seed 0): the control."""
    path = SolutionPath.from_pretrained(path_dir)
    g = torch.Generator().manual_seed(0)
    for st in path.stats.values():
        st["entry"] = torch.randperm(st["entry"].numel(), generator=g).to(torch.int32)
        st["z"] = torch.rand(st["z"].numel(), generator=g)
    path.save_pretrained(out_dir, overwrite=True)


def phase_ablation(res, args, dense, tokenizer, data, calib, work: Path, out: Path) -> None:
    default_dir = work / "solution_path"
    for name, (search, extract) in ABLATION.items():
        path_dir = default_dir if search is None and name != "random" else work / "paths" / name
        if name == "random" and not (path_dir / "solution_path.json").is_file():
            _random_path(default_dir, path_dir)
        if search is not None and not (path_dir / "solution_path.json").is_file():
            search_solution_path(dense, SPPConfig(**search), calib).save_pretrained(path_dir, overwrite=True)
        meta = SolutionPath.from_pretrained(path_dir).meta
        settings = search if search is not None else {"steps": args.search_steps}
        for ratio in args.ablation_ratios:
            key = f"{name}@{ratio}"
            if key in res["ablation"]:
                continue
            model = copy.deepcopy(dense)
            config = SPPConfig(pruning_ratio=ratio, solution_path=str(path_dir), **settings, **extract)
            report = prune_(model, config)
            res["ablation"][key] = {"measured": report.measured, "entered": report.info["solution_path"]["entered"],
                                    "search_steps": meta["steps"], **evaluate(model, tokenizer, data, args)}  # fmt: skip
            logger.info("ablation %s: %s", key, res["ablation"][key])
            write(res, out)
            del model
            gc.collect()


def phase_speed(res, args, dense, tokenizer, work: Path, out: Path) -> None:
    res["speed_load_average_start"] = os.getloadavg()[0]
    for ratio in args.ratios:
        key = str(ratio)
        if key in res["speed"]:
            continue
        models = {"dense": dense}
        for method in STRUCTURED:
            path = work / "models" / f"{method}@{ratio}"
            if path.is_dir():
                models[method] = AutoPrunedModelForCausalLM.from_pretrained(path).eval()
        speed = compare_speed(models, tokenizer, repeats=args.speed_repeats, warmup=2)
        res["speed"][key] = {"ratios": speed["ratios"], "settings": speed["settings"],
                             "medians_ms": {n: {"prefill": m["prefill_ms_median"], "decode": m["decode_ms_median"]}
                                            for n, m in speed["models"].items()},
                             "load_average": os.getloadavg()[0]}  # fmt: skip
        write(res, out)
        del models
        gc.collect()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for name in ("datasets", "transformers", "httpx"):
        logging.getLogger(name).setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    out, work = Path(args.output), Path(args.workdir)
    res = json.loads(out.read_text()) if out.is_file() else {}
    res.setdefault("rows", {})
    res.setdefault("unstructured", {})
    res.setdefault("speed", {})
    res.setdefault("ablation", {})
    res.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               host=f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs", torch=torch.__version__,
               commit=_git(), args=vars(args), load_average_start=os.getloadavg()[0])  # fmt: skip
    dense, tokenizer = load_model_and_tokenizer(smollm2_dir(), gguf_file=SMOLLM2_GGUF_FILE, torch_dtype="float32")
    dense.eval()
    train_docs, eval_docs = split_documents(load_texts(bbc_news_dir()), 0.5, seed=0)
    perm = torch.randperm(len(eval_docs), generator=torch.Generator().manual_seed(0)).tolist()
    ood = load_texts(python_docs_dir())
    ood = [ood[i] for i in torch.randperm(len(ood), generator=torch.Generator().manual_seed(0)).tolist()]
    data = {"bbc": head_documents([eval_docs[i] for i in perm], args.eval_tokens),
            "python": head_documents(ood, args.eval_tokens)}  # fmt: skip
    calib = get_calibration_batches(
        CalibrationConfig(dataset=train_docs, num_samples=args.num_samples, seq_len=args.calib_seq_len, seed=0),
        tokenizer,
    )
    if "quality" in args.phases:
        phase_quality(res, args, dense, tokenizer, data, calib, work, out)
    if "recovery" in args.phases:
        phase_recovery(res, args, dense, tokenizer, data, train_docs, work, out)
    if "unstructured" in args.phases:
        phase_unstructured(res, args, dense, tokenizer, data, calib, out)
    if "ablation" in args.phases:
        phase_ablation(res, args, dense, tokenizer, data, calib, work, out)
    if "speed" in args.phases:
        phase_speed(res, args, dense, tokenizer, work, out)
    res["load_average_end"] = os.getloadavg()[0]
    write(res, out)
    return res


if __name__ == "__main__":
    main()
