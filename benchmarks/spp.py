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
    python benchmarks/spp.py --phases speed

The DINOv2-S/14 CIFAR-10 family (one search on labelled calibration images, every ratio extracted, accuracy before /
after fine-tuning, latency) against magnitude runs in `benchmarks/vision.py` (its data and protocol):

    nice -n 10 python benchmarks/vision.py --methods spp magnitude --ratios 0.2 0.4 --ft-lr 1e-5 \
        --output benchmarks/results/vision_dinov2s_cifar10_spp.json
    python benchmarks/vision.py --timing \
        --output benchmarks/results/vision_dinov2s_cifar10_spp.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import logging
import os
import time
from pathlib import Path
from typing import Any
from unittest import mock

os.environ.setdefault("TQDM_DISABLE", "1")

import harness  # noqa: E402
import torch  # noqa: E402
from _spp_report import (
    FORMER,  # noqa: E402
    markdown,  # noqa: E402, F401  (the renderer's entry point for spp results)
)
from _spp_report import VARIANTS as EXTRA_ROWS  # noqa: E402

from optimum_prune import (  # noqa: E402
    AutoPrunedModelForCausalLM,
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
from optimum_prune.evaluation import compare_speed  # noqa: E402
from optimum_prune.methods.spp import search_solution_path  # noqa: E402

RESULTS = harness.RESULTS_DIR
TEXT_KEYS = {"bbc": "bbc", "python_docs": "python", "kjv": "kjv"}  # protocol texts -> this script's result keys
logger = logging.getLogger("spp")
STRUCTURED = ("spp", "np", "flap")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phases", nargs="+", default=["quality", "ablation", "recovery", "unstructured"],
                   choices=["quality", "recovery", "unstructured", "ablation", "speed"])  # fmt: skip
    p.add_argument("--ratios", nargs="+", type=float, default=[0.1, 0.2, 0.3, 0.5])
    p.add_argument("--num-samples", type=int, default=64, help="calibration sequences (all methods)")
    p.add_argument("--calib-seq-len", type=int, default=256)
    p.add_argument("--search-steps", type=int, default=None, help="SPP search steps (default: SPPConfig's)")
    p.add_argument("--search-samples", type=int, default=256, help="calibration windows SPP's search trains on")
    p.add_argument("--search-seq-len", type=int, default=128, help="their length in tokens")
    p.add_argument(
        "--search-view",
        action="store_true",
        help="the search trains on the calibration ids above (--num-samples x --calib-seq-len) reshaped to "
        "--search-seq-len tokens (the same tokens, sliced otherwise) instead of windows of their own",
    )
    p.add_argument("--search-window", default=None,
                   help="SPPConfig.search_seq_len (`none`: the windows as given; default: SPPConfig's)")  # fmt: skip
    p.add_argument("--search-batch-size", type=int, default=None, help="default: SPPConfig's")
    p.add_argument("--search-lr", type=float, default=None, help="default: SPPConfig's")
    p.add_argument("--search-lambda", type=float, default=None, help="default: SPPConfig's")
    p.add_argument("--search-nu-scale", type=float, default=None, help="default: SPPConfig's")
    p.add_argument(
        "--search-labels",
        default=None,
        choices=["data", "sampled", "dense", "layers"],
        help="SPPConfig.search_labels, the search's loss (default: SPPConfig's)",
    )
    p.add_argument("--global-allocation", action="store_true",
                   help='the np row at allocation="global" (NP\'s default before "auto"): how the runs made before '
                   "then were configured, to re-run them faithfully")  # fmt: skip
    p.add_argument("--reference", default=None,
                   help="a results file of this script whose `spp` and `np` rows the report compares this run's SPP "
                        "rows with (paired intervals; the same split, tokens and documents), e.g. another search "
                        "loss's run")  # fmt: skip
    p.add_argument("--rows", nargs="+", default=None,
                   help="only these rows of the quality phase (e.g. `spp` for a screen of search settings whose NP / "
                        "FLAP rows are in another file); default: every row but the diagnostic `spp_np_widths` (the "
                        "path's MLP order at the widths of the np row of the same ratio, which must come first)")  # fmt: skip
    p.add_argument("--spp-round-to", type=int, default=None, help="SPPConfig.round_to (default: SPPConfig's)")
    p.add_argument("--head-dim-multiple", type=int, default=None, help="SPPConfig.head_dim_multiple (default: its)")
    p.add_argument("--extra-spp-rows", nargs="*", default=[], choices=sorted(EXTRA_ROWS),
                   help="more extractions from the same path (benchmarks/_spp_report.py's VARIANTS), e.g. SPP's "
                        "former default (spp_former_default) or the refit with a bias at half strength "
                        "(spp_bias_s0.5)")  # fmt: skip
    p.add_argument(
        "--ria-search-steps",
        type=int,
        default=48,
        help="SPP + RIA elementwise search steps (its lr / lambda: --search-lr / --search-lambda)",
    )
    harness.add_protocol_args(p)
    p.add_argument("--lora-steps", type=int, default=16)
    p.add_argument("--lora-batch-size", type=int, default=2)
    p.add_argument("--lora-seq-len", type=int, default=128)
    p.add_argument("--lora-lr", type=float, default=1e-3)
    p.add_argument("--speed-repeats", type=int, default=5)
    p.add_argument("--ablation-ratios", nargs="+", type=float, default=[0.1, 0.2, 0.3])
    harness.add_model_args(p)
    p.set_defaults(threads=1)
    p.add_argument("--workdir", default="/tmp/spp_bench", help="the solution path and the pruned models")
    p.add_argument("--output", default=str(RESULTS / "spp_smollm2.json"))
    return p.parse_args(argv)


PROTOCOL: harness.Protocol | None = None  # the run's protocol (set by `main`), recorded by every write


def write(res: dict, path: Path) -> None:
    res["load_average_now"] = (harness.loadavg() or [None])[0]
    if PROTOCOL is not None:
        res["protocol"] = PROTOCOL.record(res.get("protocol"))
    harness.write_results(res, path, "spp")


def search_settings(args) -> dict:
    """The search options given on the command line (the rest: SPPConfig's defaults)."""
    names = {"steps": args.search_steps, "lr": args.search_lr, "lambda_": args.search_lambda,
             "batch_size": args.search_batch_size, "nu_scale": args.search_nu_scale,
             "search_labels": args.search_labels}  # fmt: skip
    out = {k: v for k, v in names.items() if v is not None}
    if args.search_window is not None:
        out["search_seq_len"] = None if args.search_window == "none" else int(args.search_window)
    return out


def spp_config(args, ratio: float = 0.2, **kw) -> SPPConfig:
    return SPPConfig(pruning_ratio=ratio, **search_settings(args), **spp_shape(args), **kw)


def np_config(ratio: float, global_allocation: bool = False) -> NumericalConfig:
    """NP's row: its library default, or with `global_allocation` the per-layer allocation that was its default
    before `"auto"` (how the runs made then were configured)."""
    return NumericalConfig(pruning_ratio=ratio, **({"allocation": "global"} if global_allocation else {}))


def spp_shape(args) -> dict:
    """The SPP shape options given on the command line (tiny models need `round_to=1`, `head_dim_multiple=1`)."""
    shape = {"round_to": args.spp_round_to, "head_dim_multiple": args.head_dim_multiple}
    return {k: v for k, v in shape.items() if v is not None}


def kept_fractions(model, dense) -> dict[str, float]:
    """The fractions of the dense model's attention (q/k/v/o) and MLP parameters that `model` keeps."""

    def count(m) -> dict[str, int]:
        c = {"attention": 0, "mlp": 0}
        for name, p in m.named_parameters():
            kind = "attention" if ".self_attn." in name else "mlp" if ".mlp." in name else None
            if kind is not None:
                c[kind] += p.numel()
        return c

    have, full = count(model), count(dense)
    return {k: round(have[k] / full[k], 4) for k in full if full[k]}


def evaluate(model, tokenizer, protocol: harness.Protocol, args) -> dict[str, Any]:
    """`{text key: perplexity, "documents": {text key: per-document sums}, "eval_s"}`."""
    t0 = time.perf_counter()
    ppl, docs = protocol.evaluate(model, tokenizer)
    out: dict[str, Any] = {TEXT_KEYS[t]: x for t, x in ppl.items()}
    out["documents"] = {TEXT_KEYS[t]: d for t, d in docs.items()}
    out["eval_s"] = time.perf_counter() - t0
    return out


def path_vs_magnitude(path: SolutionPath, dense, calib: torch.Tensor, windows: int = 32) -> list[float]:
    """Per layer, the Spearman correlation between an MLP channel's place in the path's order (kept longer = higher)
    and a plain importance score, ‖W_down[:, j]‖·‖X_j‖ on `windows` calibration windows (a path that carries no
    information gives ≈ 0)."""
    from optimum_prune.methods.spp.functional import removal_order
    from optimum_prune.modeling.architectures import get_layers, get_spec, layer_view, weight_oi

    spec = get_spec(dense)
    views = [layer_view(layer, i, spec, dense.config) for i, layer in enumerate(get_layers(dense, spec))]
    sq = {}
    hooks = [v.mlp_out.register_forward_pre_hook(
        lambda m, a, i=v.index: sq.__setitem__(i, sq.get(i, 0) + a[0].detach().double().pow(2).sum((0, 1))))
        for v in views if (v.index, "mlp") in path.stats]  # fmt: skip
    try:
        with torch.no_grad():
            for batch in calib[:windows].split(8):
                dense(batch)
    finally:
        for h in hooks:
            h.remove()

    def ranks(x: torch.Tensor) -> torch.Tensor:
        return x.argsort().argsort().double()

    out = []
    for i in sorted(sq):
        st = path.stats[(i, "mlp")]
        order = removal_order(st["entry"], st["record"], st["z"], st["gamma"])  # least important first
        score = weight_oi(views[i].mlp_out).detach().double().norm(dim=0) * sq[i].sqrt()
        rho = torch.corrcoef(torch.stack([ranks(order.argsort().double()), ranks(score)]))[0, 1]
        out.append(round(float(rho), 4))
    return out


def np_widths_keep(path: SolutionPath, np_dir: Path) -> dict[int, dict[str, list[int]]]:
    """Per layer, the MLP channels the path keeps longest at the widths of the NP model saved in `np_dir`: SPP's
    order within each layer, NP's allocation across layers (the `spp_np_widths` diagnostic row)."""
    from optimum_prune.methods.spp.functional import removal_order
    from optimum_prune.modeling.architectures import get_layers, get_spec, layer_view, weight_oi

    ref = AutoPrunedModelForCausalLM.from_pretrained(np_dir)
    spec = get_spec(ref)
    widths = {i: weight_oi(layer_view(layer, i, spec, ref.config).mlp_out).shape[1]
              for i, layer in enumerate(get_layers(ref, spec))}  # fmt: skip
    keep = {}
    for (i, kind), st in sorted(path.stats.items()):
        n = st["entry"].numel()
        if kind == "mlp" and widths[i] < n:
            order = removal_order(st["entry"], st["record"], st["z"], st["gamma"])  # least important first
            keep[i] = {"mlp": sorted(order[n - widths[i] :].tolist())}
    return keep


# SPP rows besides the default extraction: the other compensation setting, the permutation control (the path's
# order replaced by a random one within each pool: what the path's information is worth), and with
# --extra-spp-rows the refit's options on the same path (as NP's light-ratio default: an intercept, a shrink)


def phase_quality(res, args, dense, tokenizer, data, calib, search_calib, work: Path, out: Path) -> None:
    if "dense" not in res:
        res["dense"] = {**evaluate(dense, tokenizer, data, args), "params": sum(p.numel() for p in dense.parameters())}
        write(res, out)
    path_dir = work / "solution_path"
    if not (path_dir / "solution_path.json").is_file():
        path = search_solution_path(dense, spp_config(args), search_calib)
        path.save_pretrained(path_dir, overwrite=True)
    path = SolutionPath.from_pretrained(path_dir)
    res["search"] = {**path.summary(), "loss_history": path.meta.get("loss_history"),
                     "support": {k: v.tolist() for k, v in path.support.items()},
                     "path_bytes": sum(f.stat().st_size for f in path_dir.iterdir()), "settings": path.meta["search"],
                     "nu": path.meta.get("nu"), "calibration": list(search_calib.shape),
                     "windows": path.meta.get("windows"), "view_of_calibration": args.search_view,
                     **{k: path.meta.get(k) for k in ("targets_seconds", "targets_cpu_seconds")}}  # fmt: skip
    if "spearman_mlp" not in res["search"]:
        res["search"]["spearman_mlp"] = path_vs_magnitude(path, dense, calib)
    write(res, out)
    random_dir = work / "paths" / "random"
    if not (random_dir / "solution_path.json").is_file():
        _random_path(path_dir, random_dir)
    comp = SPPConfig().compensate  # the default; the other setting is the extra row
    configs = {
        "spp": lambda r: spp_config(args, r, solution_path=str(path_dir)),
        "spp_refit" if not comp else "spp_norefit": lambda r: spp_config(
            args, r, solution_path=str(path_dir), compensate=not comp
        ),
        **{
            row: (
                lambda r, kw=EXTRA_ROWS[row]: spp_config(args, r, solution_path=str(path_dir), compensate=True, **kw)
            )
            for row in args.extra_spp_rows
        },
        "spp_random": lambda r: spp_config(args, r, solution_path=str(random_dir)),
        "np": lambda r: np_config(r, args.global_allocation),
        # diagnostic: the path's MLP order cut at NP's per-layer MLP widths (after the np row of the same ratio),
        # with NP's servable refit; against `spp_mlp_refit` it isolates the widths, against `np` the order
        "spp_np_widths": lambda r: spp_config(
            args,
            r,
            solution_path=str(path_dir),
            prune_attention=False,
            compensation_bias=False,
            compensation_strength=1.0,
            channel_order="path",
        ),
        "flap": lambda r: FLAPConfig(pruning_ratio=r),
    }
    # (its converse, NP's order at the widths of the path's MLP-only cut, is `channel_order="np"`: the library's
    # `spp_mlp_np_order`, SPP's language-model default since; the rows `np_spp_widths` of the files that first
    # measured it came from a stand-in for NP's allocation, removed once the option computed the same)
    diagnostic = {"spp_np_widths"}
    with contextlib.nullcontext(harness.CalibrationStatsCache()) as cache:
        for ratio in args.ratios:
            for method in [m for m in configs if (m in args.rows if args.rows else m not in diagnostic)]:
                key = f"{method}@{ratio}"
                if key in res["rows"] and (work / "models" / key).is_dir():
                    continue
                model = copy.deepcopy(dense)
                config = configs[method](ratio)
                needs = method.startswith("np") or method == "flap" or config.compensate
                fixed = contextlib.nullcontext()
                if method == "spp_np_widths":  # the cut replaced by NP's widths; the refit as in every SPP row
                    keep = np_widths_keep(path, work / "models" / f"np@{ratio}")
                    fixed = mock.patch("optimum_prune.methods.spp.pruner.extract_keep",
                                       lambda *a, keep=keep: (keep, {"np_widths": True}))  # fmt: skip
                with fixed:
                    report = prune_(model, config, calib if needs else None, stats_cache=cache)
                row = {"method": method, "ratio": ratio, "measured": report.measured, "params": report.params_after,
                       "prune_s": report.timings["total_s"], "config": report.config,
                       "kept": kept_fractions(model, dense)}  # fmt: skip
                if method.startswith("spp"):
                    row["extract_s"] = report.info["extract_s"] + report.info.get("compensate_s", 0.0)
                    row["refit_s"] = report.info.get("compensate_s")
                    if method == "spp" and config.compensate:  # what the same member costs without the refit
                        bare = copy.deepcopy(dense)
                        cut = spp_config(args, ratio, solution_path=str(path_dir), compensate=False)
                        row["prune_norefit_s"] = prune_(bare, cut).timings["total_s"]
                        del bare
                if method.startswith("spp"):
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
        "spp_ria": SPPRIAConfig(sparsity=0.5, **{**search_settings(args), "steps": args.ria_search_steps}),
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


# name -> (search settings, or None for the default path; extraction settings). `code`: the authors' dynamics (no
# pull towards Γ) with the default step sizes and data, cut with extrapolate=True (never-entered units ranked by Z).
# The extractions cut every kind in the path's order, SPP's default when the ablation was run (`FORMER`), so that the
# pools and the statistics still decide something.
ABLATION = {
    "default": (None, FORMER),
    "step_record": (None, {**FORMER, "statistic": "step_record"}),
    "cost_weighted": (None, {**FORMER, "pools": "cost_weighted"}),
    "fold_masks": (None, {**FORMER, "fold_masks": True, "compensate": False}),
    "code": ({"faithful_to": "code"}, {**FORMER, "extrapolate": True}),
    "random": (None, FORMER),
}


def _random_path(path_dir: Path, out_dir: Path) -> None:
    """The path with its statistics (entry, step_record, Z, Γ) permuted at random (seed 0) among the units of each
    pool of the default extraction (`SPPConfig().pools`; per kind: every layer's QK units, VO units, MLP channels):
    the same values, in an order that carries no information (the control)."""
    from optimum_prune.methods.spp.extract import POOLS

    path = SolutionPath.from_pretrained(path_dir)
    g = torch.Generator().manual_seed(0)
    for kinds in POOLS[SPPConfig().pools].values():
        keys = [key for key in sorted(path.stats) if key[1] in kinds]
        if not keys:
            continue
        sizes = [path.stats[key]["entry"].numel() for key in keys]
        perm = torch.randperm(sum(sizes), generator=g)
        for name in ("entry", "record", "z", "gamma"):
            shuffled = torch.cat([path.stats[key][name] for key in keys])[perm]
            for key, part in zip(keys, shuffled.split(sizes)):
                path.stats[key][name] = part.clone()
    path.save_pretrained(out_dir, overwrite=True)


def phase_ablation(res, args, dense, tokenizer, data, calib, search_calib, work: Path, out: Path) -> None:
    default_dir = work / "solution_path"
    for name, (search, extract) in ABLATION.items():
        path_dir = default_dir if search is None and name != "random" else work / "paths" / name
        if name == "random" and not (path_dir / "solution_path.json").is_file():
            _random_path(default_dir, path_dir)
        if search is not None and not (path_dir / "solution_path.json").is_file():
            search_solution_path(
                dense, SPPConfig(**{**search_settings(args), **search}, **spp_shape(args)), search_calib
            ).save_pretrained(path_dir, overwrite=True)
        meta = SolutionPath.from_pretrained(path_dir).meta
        settings = {**search_settings(args), **(search or {})}
        for ratio in args.ablation_ratios:
            key = f"{name}@{ratio}"
            if key in res["ablation"]:
                continue
            model = copy.deepcopy(dense)
            config = SPPConfig(
                pruning_ratio=ratio, solution_path=str(path_dir), **settings, **extract, **spp_shape(args)
            )
            report = prune_(model, config, calib if config.compensate else None)
            res["ablation"][key] = {"measured": report.measured, "entered": report.info["solution_path"]["entered"],
                                    "search_steps": meta["steps"], **evaluate(model, tokenizer, data, args)}  # fmt: skip
            logger.info("ablation %s: %s", key, res["ablation"][key])
            write(res, out)
            del model
            gc.collect()


def phase_speed(res, args, dense, tokenizer, work: Path, out: Path) -> None:
    res["speed_load_average_start"] = (harness.loadavg() or [None])[0]
    for ratio in args.ratios:
        key = str(ratio)
        if key in res["speed"]:
            continue
        models = {"dense": dense}
        for method in STRUCTURED:
            path = work / "models" / f"{method}@{ratio}"
            if path.is_dir():
                models[method] = AutoPrunedModelForCausalLM.from_pretrained(path).eval()
        with harness.timing_lock():
            speed = compare_speed(models, tokenizer, repeats=args.speed_repeats, warmup=2)
        res["speed"][key] = {"ratios": speed["ratios"], "settings": speed["settings"],
                             "medians_ms": {n: {"prefill": m["prefill_ms_median"], "decode": m["decode_ms_median"]}
                                            for n, m in speed["models"].items()},
                             "load_average": (harness.loadavg() or [None])[0],
                             "prefill_ms_rounds": {n: m["prefill_ms"] for n, m in speed["models"].items()},
                             **{f"{n}_rounds": harness.round_ratios(speed["models"]["dense"]["prefill_ms"], m["prefill_ms"],
                                                                    "prefill_speedup")
                                for n, m in speed["models"].items() if n != "dense"}}  # fmt: skip
        write(res, out)
        del models
        gc.collect()


def main(argv: list[str] | None = None) -> dict:
    global PROTOCOL
    args = parse_args(argv)
    harness.setup_logging()
    torch.manual_seed(0)
    out, work = Path(args.output), Path(args.workdir)
    res = json.loads(out.read_text()) if out.is_file() else {}
    res.setdefault("rows", {})
    res.setdefault("unstructured", {})
    res.setdefault("speed", {})
    res.setdefault("ablation", {})
    dense, tokenizer, model_desc = harness.load_model(args)
    env = harness.environment(argv, "spp.py")
    res.update(env, model=model_desc, host=f"{env['host']['cpu']}, {env['host']['cpu_count']} CPUs",
               torch=torch.__version__, commit=str(env["versions"]["git_commit"])[:7], args=vars(args),
               load_average_start=(harness.loadavg() or [None])[0])  # fmt: skip
    if args.reference:
        ref = json.loads(Path(args.reference).read_text())
        res["reference"] = {"file": Path(args.reference).name, "commit": ref.get("commit"),
                            "rows": {k: v for k, v in ref["rows"].items() if k.split("@")[0] in ("spp", "np")}}  # fmt: skip
    PROTOCOL = protocol = harness.Protocol.from_args(args)
    train_docs = protocol.documents("bbc", "calibration")
    calib = protocol.calibration_ids(tokenizer, args.num_samples, args.calib_seq_len)
    if args.search_view:
        search_calib = calib.reshape(-1, args.search_seq_len)
    else:
        search_calib = protocol.calibration_ids(tokenizer, args.search_samples, args.search_seq_len)
    data = protocol
    if "quality" in args.phases:
        phase_quality(res, args, dense, tokenizer, data, calib, search_calib, work, out)
    if "recovery" in args.phases:
        phase_recovery(res, args, dense, tokenizer, data, train_docs, work, out)
    if "unstructured" in args.phases:
        phase_unstructured(res, args, dense, tokenizer, data, calib, out)
    if "ablation" in args.phases:
        phase_ablation(res, args, dense, tokenizer, data, calib, search_calib, work, out)
    if "speed" in args.phases:
        phase_speed(res, args, dense, tokenizer, work, out)
    res["load_average_end"] = (harness.loadavg() or [None])[0]
    write(res, out)
    return res


if __name__ == "__main__":
    main()
