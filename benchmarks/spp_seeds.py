"""SPP's spread over calibration draws and thread counts, against NP's, on SmolLM2-135M.

For every seed of the calibration-window draw (`--calib-seeds`; the document split stays `--seed`, so every draw
comes from the same calibration documents): the `--num-samples` x `--seq-len` BBC windows, SPP's default search on
them (or the path saved from it, `--paths SEED=DIR`, e.g. by `benchmarks/_spp_thread_probe.py --save-path`), SPP's
default extraction and NP's default at each ratio on those same windows (one calibration-statistics cache per draw),
every model scored on each split of `--splits` (one results file per split: `--output` for the test split,
`<output>_selection.json` for the selection split). Paths searched with another thread count (`--thread-paths
SEED=DIR`) are compared with the first, tensor by tensor, and their MLP widths at every ratio.

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/spp_seeds.py --calib-seeds 0 1 2 \
        --paths 0=/tmp/p0 1=/tmp/p1 2=/tmp/p2 --thread-paths 0=/tmp/p0_t2 1=/tmp/p1_t2 --splits selection test
"""

from __future__ import annotations

import argparse
import copy
import fcntl
import gc
import hashlib
import json
import logging
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TQDM_DISABLE", "1")

import harness  # noqa: E402
import torch  # noqa: E402

from optimum_prune import NumericalConfig, SolutionPath, SPPConfig, prune_  # noqa: E402
from optimum_prune.methods.spp import search_solution_path  # noqa: E402
from optimum_prune.methods.spp.extract import extract_keep  # noqa: E402
from optimum_prune.modeling.architectures import get_spec  # noqa: E402

RESULTS = harness.RESULTS_DIR
logger = logging.getLogger("spp_seeds")
TEXTS = ("bbc", "python_docs", "kjv")
# SPP rows: name -> (label, SPPConfig fields beyond the ratio, the path and the shape options)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "spp": ("SPP (default)", {}),
    # shrunk refits, less fitted to one draw's Grams: candidates for a smaller spread over the draws
    "spp_damp0.3": ("SPP, refit damping 0.3", {"compensation_damping": 0.3}),
    "spp_s0.5": ("SPP, refit at half strength", {"compensation_strength": 0.5}),
}
METHODS = ("spp", "np")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calib-seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds of the window draw")
    p.add_argument("--ratios", nargs="+", type=float, default=[0.2, 0.3, 0.4])
    p.add_argument("--num-samples", type=int, default=32, help="calibration windows (all methods)")
    p.add_argument("--seq-len", type=int, default=512, help="their length in tokens")
    p.add_argument("--paths", nargs="*", default=[], metavar="SEED=DIR",
                   help="saved default-search paths of these draws (the rest are searched into --workdir)")  # fmt: skip
    p.add_argument("--thread-paths", nargs="*", default=[], metavar="SEED=DIR",
                   help="the same draw's path searched with another thread count, compared with the first")  # fmt: skip
    p.add_argument("--path-threads", nargs="*", default=[], metavar="DIR=N",
                   help="the thread count each path was searched with (recorded; default: unknown)")  # fmt: skip
    p.add_argument("--variants", nargs="+", default=["spp"], choices=sorted(VARIANTS), help="SPP rows")
    p.add_argument("--splits", nargs="+", default=["test"], choices=["selection", "test"])
    p.add_argument("--search-steps", type=int, default=None, help="(searches run here) default: SPPConfig's")
    p.add_argument("--search-lr", type=float, default=None)
    p.add_argument("--search-lambda", type=float, default=None)
    p.add_argument("--search-batch-size", type=int, default=None)
    p.add_argument("--spp-round-to", type=int, default=None, help="SPPConfig.round_to (tiny models: 1)")
    p.add_argument("--head-dim-multiple", type=int, default=None)
    harness.add_protocol_args(p)
    harness.add_model_args(p)
    p.set_defaults(threads=1)
    p.add_argument("--workdir", default="/tmp/spp_seeds", help="paths searched here")
    p.add_argument("--output", default=str(RESULTS / "spp_seeds_smollm2.json"))
    return p.parse_args(argv)


def _pairs(items: list[str]) -> dict[str, str]:
    return dict(x.split("=", 1) for x in items)


def output_for(args, split: str) -> Path:
    out = Path(args.output)
    return out if split == "test" else out.with_name(out.stem + f"_{split}.json")


def search_kw(args) -> dict[str, Any]:
    kw = {"steps": args.search_steps, "lr": args.search_lr, "lambda_": args.search_lambda,
          "batch_size": args.search_batch_size}  # fmt: skip
    return {k: v for k, v in kw.items() if v is not None}


def shape_kw(args) -> dict[str, Any]:
    kw = {"round_to": args.spp_round_to, "head_dim_multiple": args.head_dim_multiple}
    return {k: v for k, v in kw.items() if v is not None}


def path_digest(path_dir: Path) -> str:
    h = hashlib.sha256()
    h.update((Path(path_dir) / "solution_path.safetensors").read_bytes())
    return h.hexdigest()


def mlp_widths(path: SolutionPath, model, ratio: float, **kw) -> list[int]:
    """Every layer's MLP width in SPP's default cut of `path` at `ratio`."""
    spec = get_spec(model)
    cfg = SPPConfig(pruning_ratio=ratio, **kw).for_architecture(spec)
    keep, _ = extract_keep(path, model, spec, cfg)
    n = model.config.intermediate_size
    return [len(keep.get(i, {}).get("mlp", range(n))) for i in range(model.config.num_hidden_layers)]


def compare_paths(a: Path, b: Path, model, ratios, **kw) -> dict[str, Any]:
    """Tensor-by-tensor comparison of two saved paths of the same search, and their MLP widths at each ratio."""
    pa, pb = SolutionPath.from_pretrained(a), SolutionPath.from_pretrained(b)
    differ, entry_differ = [], 0
    for key in pa.stats:
        for s in pa.stats[key]:
            if not torch.equal(pa.stats[key][s], pb.stats[key][s]):
                differ.append(f"{key[0]}.{key[1]}.{s}")
        entry_differ += int((pa.stats[key]["entry"] != pb.stats[key]["entry"]).sum())
    widths = {str(r): mlp_widths(pa, model, r, **kw) == mlp_widths(pb, model, r, **kw) for r in ratios}
    return {"a": str(a), "b": str(b), "sha256": [path_digest(a), path_digest(b)], "tensors_differ": differ,
            "entry_steps_differ": entry_differ, "nu": [pa.meta.get("nu"), pb.meta.get("nu")],
            "losses_identical": pa.meta.get("loss_history") == pb.meta.get("loss_history"),
            "widths_identical": widths}  # fmt: skip


def write_all(results: dict[str, dict], protocols: dict[str, harness.Protocol], args) -> None:
    """Write every split's file; under a lock, merging the draws another run of the same commit wrote to it meanwhile
    (runs of different draws can share the output files)."""
    for split, res in results.items():
        out = output_for(args, split)
        lock_file = (
            Path(tempfile.gettempdir())
            / f"spp_seeds_{hashlib.sha1(str(out.resolve()).encode()).hexdigest()[:12]}.lock"
        )
        with open(lock_file, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            earlier = [res.get("protocol") or {}]  # the record this run started from (rows of earlier commits)
            if out.is_file():
                disk = json.loads(out.read_text())
                if disk.get("versions", {}).get("git_commit") == res["versions"]["git_commit"]:
                    for part in ("rows", "paths", "threads", "variants"):
                        res[part] = {**disk.get(part, {}), **res[part]}
                    earlier.append(disk.get("protocol") or {})
            for old in earlier:
                cal = {c["seed"]: c for c in old.get("calibration", [])}
                protocols[split]._calibration.update({f"merged{k}": c for k, c in cal.items()})
            record = protocols[split].record(res.get("protocol"))  # a run that scored nothing keeps the record
            seen, calibration = set(), []
            for c in record["calibration"]:
                if c["ids_sha256"] not in seen:
                    seen.add(c["ids_sha256"])
                    calibration.append(c)
            res["protocol"] = {**record, "calibration": sorted(calibration, key=lambda c: c["seed"])}
            res["load_average_now"] = (harness.loadavg() or [None])[0]
            harness.write_results(res, out, "spp_seeds")
            fcntl.flock(lock, fcntl.LOCK_UN)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    harness.setup_logging()
    torch.manual_seed(0)
    harness.require_clean_tree(args)
    dense, tokenizer, model_desc = harness.load_model(args)
    env = harness.environment(argv, "spp_seeds.py")
    protocols = {s: harness.Protocol(split=s, seed=args.seed, eval_texts=tuple(args.eval_texts),
                                     eval_tokens=args.eval_tokens, eval_seq_len=args.eval_seq_len)
                 for s in args.splits}  # fmt: skip
    results = {}
    for split in args.splits:
        out = output_for(args, split)
        res = json.loads(out.read_text()) if out.is_file() else {}
        res.setdefault("rows", {})
        res.setdefault("paths", {})
        res.setdefault("threads", {})
        res.update(env, model=model_desc, torch=torch.__version__, args=vars(args),
                   commit=str(env["versions"]["git_commit"])[:7], torch_threads=torch.get_num_threads(),
                   variants={**res.get("variants", {}), **{k: VARIANTS[k] for k in args.variants}})  # fmt: skip
        results[split] = res
    for split, proto in protocols.items():
        if "dense" not in results[split]:
            ppl, docs = proto.evaluate(dense, tokenizer)
            results[split]["dense"] = {"ppl": ppl, "docs": docs}
    write_all(results, protocols, args)
    paths, thread_paths, path_threads = _pairs(args.paths), _pairs(args.thread_paths), _pairs(args.path_threads)
    work = Path(args.workdir)
    for seed in args.calib_seeds:
        ids = [p.calibration_ids(tokenizer, args.num_samples, args.seq_len, seed=seed) for p in protocols.values()]
        calib = ids[0]
        assert all(torch.equal(calib, x) for x in ids), "the calibration split does not depend on the evaluation split"
        path_dir = Path(paths.get(str(seed), work / f"path_seed{seed}"))
        searched_s = None
        if not (path_dir / "solution_path.json").is_file():
            t0 = time.perf_counter()
            path = search_solution_path(dense, SPPConfig(**search_kw(args)), calib)
            searched_s = time.perf_counter() - t0
            path.save_pretrained(path_dir, overwrite=True)
            path_threads.setdefault(str(path_dir), str(torch.get_num_threads()))
        path = SolutionPath.from_pretrained(path_dir)
        record = {"dir": str(path_dir), "sha256": path_digest(path_dir), "nu": path.meta.get("nu"),
                  "search": path.meta.get("search"), "threads": path_threads.get(str(path_dir)),
                  "searched_here_s": searched_s, "read_at_commit": env["versions"]["git_commit"], "calibration_sha256": hashlib.sha256(calib.numpy().tobytes()).hexdigest(),
                  "mlp_widths": {str(r): mlp_widths(path, dense, r, **shape_kw(args)) for r in args.ratios}}  # fmt: skip
        threads = None
        if str(seed) in thread_paths:
            threads = compare_paths(path_dir, Path(thread_paths[str(seed)]), dense, args.ratios, **shape_kw(args))
            threads["threads"] = [path_threads.get(str(path_dir)), path_threads.get(thread_paths[str(seed)])]
        for res in results.values():
            res["paths"][str(seed)] = record
            if threads is not None:
                res["threads"][str(seed)] = threads
        write_all(results, protocols, args)
        cache = harness.CalibrationStatsCache()
        for ratio in args.ratios:
            for method in [*args.variants, "np"]:
                key = f"{method}@{ratio}@seed{seed}"
                if all(key in res["rows"] for res in results.values()):
                    continue
                model = copy.deepcopy(dense)
                if method == "np":
                    config = NumericalConfig(pruning_ratio=ratio)
                else:
                    config = SPPConfig(pruning_ratio=ratio, solution_path=str(path_dir), **shape_kw(args),
                                       **VARIANTS[method][1])  # fmt: skip
                report = prune_(model, config, calib, stats_cache=cache)
                n = dense.config.intermediate_size
                widths = [x.get("intermediate_size", n) for x in report.layers] if report.layers else None
                row = {"method": method, "ratio": ratio, "seed": seed, "measured": report.measured,
                       "params": report.params_after, "prune_s": report.timings["total_s"], "config": report.config,
                       "mlp_widths": widths, "commit": env["versions"]["git_commit"]}  # fmt: skip
                for split, proto in protocols.items():
                    t0 = time.perf_counter()
                    ppl, docs = proto.evaluate(model, tokenizer)
                    results[split]["rows"][key] = {**row, "ppl": ppl, "docs": docs, "eval_s": time.perf_counter() - t0}
                logger.info("%s: %s", key, {s: r["rows"][key]["ppl"] for s, r in results.items()})
                write_all(results, protocols, args)
                del model
                gc.collect()
    for res in results.values():
        res["load_average_end"] = (harness.loadavg() or [None])[0]
    write_all(results, protocols, args)
    return results[args.splits[-1]]


# ------------------------------------------------------------------------------------------------------- markdown
def _mean_range(xs: list[float]) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.2f}"
    return f"{statistics.mean(xs):.2f} ({min(xs):.2f}–{max(xs):.2f}, sd {statistics.stdev(xs):.2f})"


def _rel_spread(xs: list[float]) -> float:
    return max(xs) / min(xs) - 1


def _spread_cell(xs: list[float]) -> str:
    return f"{100 * _rel_spread(xs):.1f}%" if len(xs) > 1 else "(1 draw)"


def _paired_gm(row: dict, ref: dict, texts) -> tuple[float, float, float, str]:
    """The paired Δ of `row`'s geometric mean over `texts` against `ref`'s (document bootstrap): Δ, low, high, verdict."""
    from optimum_prune.evaluation.uncertainty import compare_geometric_mean

    g = compare_geometric_mean([(row["docs"][t]["nll"], row["docs"][t]["tokens"]) for t in texts],
                               [(ref["docs"][t]["nll"], ref["docs"][t]["tokens"]) for t in texts])  # fmt: skip
    return g.delta, g.low, g.high, g.verdict


def summary(res: dict) -> dict[str, Any]:
    """Per ratio and method: each text's and the geometric mean's values over the seeds, their relative spread
    (max / min − 1), and per seed the paired Δ of the geometric mean against NP."""
    from _intervals import comparison

    texts = res["protocol"]["eval_texts"]
    out: dict[str, Any] = {}
    rows = res["rows"]
    for row in sorted(rows.values(), key=lambda r: (r["ratio"], r["method"] == "np", r["method"], r["seed"])):
        method, ratio, seed = row["method"], row["ratio"], row["seed"]
        cell = out.setdefault(str(ratio), {}).setdefault(method, {"seeds": [], "ppl": {t: [] for t in texts},
                                                                   "gm": [], "vs_np": []})  # fmt: skip
        cell["seeds"].append(seed)
        for t in texts:
            cell["ppl"][t].append(row["ppl"][t])
        cell["gm"].append(harness.geomean(row["ppl"], texts))
        ref = rows.get(f"np@{ratio}@seed{seed}")
        if method != "np" and ref is not None:
            per_text = {}
            for t in texts:
                c = comparison(row["docs"][t], ref["docs"][t])
                per_text[t] = None if c is None else (c.delta, c.low, c.high, c.verdict)
            cell["vs_np"].append({"seed": seed, "texts": per_text, "gm": _paired_gm(row, ref, texts)})
    return out


def _verdicts(ds) -> str:
    """`3 better` / `2 better, 1 tie`: the verdicts of the paired comparisons of the draws."""
    counts = {v: sum(1 for d in ds if d is not None and d[3] == v) for v in ("better", "tie", "worse")}
    return ", ".join(f"{n} {v}" for v, n in counts.items() if n) or "–"


def _delta(d) -> str:
    return "–" if d is None else f"{100 * d[0]:+.1f}% [{100 * d[1]:+.1f}, {100 * d[2]:+.1f}] {d[3]}"


def _screen_lines(res: dict, summ: dict[str, Any], labels: dict[str, str]) -> list[str]:
    """With more than one SPP row: every method's mean over the (ratio, draw) cells that all methods have of the log
    geometric mean, its spread per ratio, and per cell the paired Δ of the geometric mean against SPP's default (the
    selection screen of an extraction against the default)."""
    methods = sorted({m for cells in summ.values() for m in cells}, key=lambda m: (m == "np", m != "spp", m))
    if sum(m != "np" for m in methods) < 2:
        return []
    cells = [(r, s) for r, by in summ.items() for s in by.get("spp", {"seeds": []})["seeds"]
             if all(m in by and s in by[m]["seeds"] for m in methods)]  # fmt: skip
    if not cells:
        return []
    texts, rows = res["protocol"]["eval_texts"], res["rows"]

    def log_gm(method: str) -> float:
        return statistics.mean(math.log(summ[r][method]["gm"][summ[r][method]["seeds"].index(s)]) for r, s in cells)

    def paired(method: str) -> str:
        if method == "spp":
            return ""
        ds = []
        for r, s in cells:
            ds.append(_paired_gm(rows[f"{method}@{r}@seed{s}"], rows[f"spp@{r}@seed{s}"], texts))
        return f"{100 * statistics.mean(d[0] for d in ds):+.1f}% ({_verdicts(ds)})"

    ratios = sorted({r for r, _ in cells}, key=float)
    lines = ["", f"Screen: over the {len(cells)} (ratio, draw) cells every method has, the mean log geometric mean "
             "(lower is better) and its difference from SPP's default; the paired Δ of the geometric mean against SPP's "
             "default per cell (document-level bootstrap 95%), mean and verdicts; the spread of the geometric mean over "
             "the draws per ratio:", "", "| method | mean log geometric mean | − SPP (default) | paired Δ vs SPP "
             "(default) | " + " | ".join(f"spread at {r}" for r in ratios) + " |",
             "|---|---:|---:|---|" + "---:|" * len(ratios)]  # fmt: skip
    base = log_gm("spp")
    for m in methods:
        spreads = [_spread_cell([summ[r][m]["gm"][summ[r][m]["seeds"].index(s)] for rr, s in cells if rr == r])
                   for r in ratios]  # fmt: skip
        lines.append(f"| {labels.get(m, m)} | {log_gm(m):.4f} | {log_gm(m) - base:+.4f} | {paired(m)} | "
                     + " | ".join(spreads) + " |")  # fmt: skip
    return lines


def markdown(res: dict) -> str:
    from harness import protocol_line, text_label

    texts = res["protocol"]["eval_texts"]
    labels = {**{k: v[0] for k, v in res.get("variants", {}).items()}, "np": "NP (default)"}
    seeds = sorted({r["seed"] for r in res["rows"].values()})
    lines = [
        f"# SPP's spread over calibration draws and thread counts, against NP: {res['model']}",
        "",
        f"Generated by `benchmarks/spp_seeds.py` ({res['date']}, {res['host']['cpu']}, {res['host']['cpu_count']} CPUs;"
        f" torch {res['torch']}, {res['torch_threads']} torch thread(s) for the extraction and scoring, commit "
        f"{res['commit']}). 1-min load average {res.get('load_average_now')} at the last write.",
        "",
        f"- Calibration: {res['args']['num_samples']} × {res['args']['seq_len']} BBC windows drawn from the calibration"
        f" split with each seed of the window draw ({', '.join(map(str, seeds))}); the document split is seed "
        f"{res['protocol']['seed']} for every draw. SPP and NP use the same windows of a draw.",
        "- SPP: `SPPConfig()`'s search on those windows, then `SPPConfig(pruning_ratio=r, solution_path=...)` (the "
        "default extraction and refit). NP: `NumericalConfig(pruning_ratio=r)`.",
        protocol_line(res),
        "",
    ]
    if res["paths"]:
        lines += ["Search paths (one per draw; threads: the `OMP_NUM_THREADS` of the search):", "",
                  "| seed | threads | path sha256 | ν (qk / vo / mlp) |", "|---:|---:|---|---|"]  # fmt: skip
        for seed, p in sorted(res["paths"].items()):
            nu = p.get("nu") or {}
            lines.append(f"| {seed} | {p.get('threads') or '?'} | `{p['sha256'][:12]}` | "
                         + " / ".join(f"{nu[k]:.2f}" for k in ("qk", "vo", "mlp") if k in nu) + " |")  # fmt: skip
        lines.append("")
    if res.get("threads"):
        lines += ["The same draw searched with two thread counts:", "",
                  "| seed | threads | path files | tensors that differ | entry steps that differ | losses | MLP widths "
                  "at the ratios |", "|---:|---|---|---:|---:|---|---|"]  # fmt: skip
        for seed, t in sorted(res["threads"].items()):
            same_file = "identical" if t["sha256"][0] == t["sha256"][1] else "differ"
            widths = ", ".join(f"{r}: {'identical' if v else 'DIFFER'}" for r, v in t["widths_identical"].items())
            lines.append(f"| {seed} | {' vs '.join(str(x or '?') for x in t['threads'])} | {same_file} | "
                         f"{len(t['tensors_differ'])} | {t['entry_steps_differ']} | "
                         f"{'identical' if t['losses_identical'] else 'differ'} | {widths} |")  # fmt: skip
        lines.append("")
    summ = summary(res)
    head = " | ".join(text_label(t) for t in texts)
    lines += ["Over the draws: mean (min–max, sd) of the perplexity per text and of their geometric mean; spread = "
              "max / min − 1 of the geometric mean; Δ vs NP: the paired Δ of the geometric mean against NP on the same "
              "draw, mean (min–max) over the draws, and the verdicts (better / tie / worse) per text and of the "
              "geometric mean:", "",
              f"| ratio | method | {head} | geometric mean | spread | Δ vs NP | verdicts {' / '.join(text_label(t) for t in texts)} / "
              "geometric mean |", "|---:|---|" + "---|" * (len(texts) + 4)]  # fmt: skip
    for ratio in sorted(summ, key=float):
        for method, cell in summ[ratio].items():
            deltas = [100 * d["gm"][0] for d in cell["vs_np"]]
            vs = f"{statistics.mean(deltas):+.1f}% ({min(deltas):+.1f} to {max(deltas):+.1f})" if deltas else ""
            if len(deltas) == 1:
                vs = f"{deltas[0]:+.1f}%"
            verdicts = " / ".join(_verdicts([d["texts"][t] for d in cell["vs_np"]]) for t in texts)
            verdicts = f"{verdicts} / {_verdicts([d['gm'] for d in cell['vs_np']])}" if deltas else ""
            lines.append(f"| {ratio} | {labels.get(method, method)} | "
                         + " | ".join(_mean_range(cell["ppl"][t]) for t in texts)
                         + f" | {_mean_range(cell['gm'])} | {_spread_cell(cell['gm'])} | {vs} | {verdicts} |")  # fmt: skip
    lines += _screen_lines(res, summ, labels)
    lines += ["", "Paired against NP on the same draw (document-level bootstrap 95%; better / worse only when the "
              "interval excludes 0):", "",
              f"| ratio | method | seed | {' | '.join('Δ ' + text_label(t) for t in texts)} | Δ geometric mean |",
              "|---:|---|---:|" + "---|" * (len(texts) + 1)]  # fmt: skip
    for ratio in sorted(summ, key=float):
        for method, cell in summ[ratio].items():
            for d in cell["vs_np"]:
                lines.append(f"| {ratio} | {labels.get(method, method)} | {d['seed']} | "
                             + " | ".join(_delta(d["texts"][t]) for t in texts) + f" | {_delta(d['gm'])} |")  # fmt: skip
    lines += ["", "Per draw (commit: the code that pruned and scored the row):", "",
              f"| ratio | method | seed | {head} | geometric mean | measured ratio | commit |",
              "|---:|---|---:|" + "---|" * (len(texts) + 3)]  # fmt: skip
    for key in sorted(res["rows"], key=lambda k: (res["rows"][k]["ratio"], res["rows"][k]["method"] != "np",
                                                   res["rows"][k]["method"], res["rows"][k]["seed"])):  # fmt: skip
        row = res["rows"][key]
        lines.append(f"| {row['ratio']} | {labels.get(row['method'], row['method'])} | {row['seed']} | "
                     + " | ".join(f"{row['ppl'][t]:.2f}" for t in texts)
                     + f" | {harness.geomean(row['ppl'], texts):.2f} | {row['measured']:.3f} | "
                     f"{str(row.get('commit') or '?')[:7]} |")  # fmt: skip
    dense = res.get("dense")
    if dense:
        lines += ["", "Dense: " + " / ".join(f"{text_label(t)} {dense['ppl'][t]:.2f}" for t in texts) + "."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
