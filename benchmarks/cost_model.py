"""The cost model on this machine: a measured `CostTable` per workload for SmolLM2-135M's decoder (transformers, a
static KV cache, fp32; or llama.cpp, `--runtime llama.cpp`), and its predictions against the measured step time of
assembled models (random weights in the shapes each assembly has: dense, MLP widths cut, fewer KV heads, attention
removed in some layers, mixed), timed in the same runtime.

    python benchmarks/cost_model.py --output benchmarks/results/cost_model_smollm2.json
    python benchmarks/cost_model.py --workloads decode:16:2048 --rounds 11     # one workload, more rounds
    python benchmarks/cost_model.py --runtime llama.cpp    # -> results/cost_model_smollm2_llamacpp.json

In llama.cpp (the `llamacpp` extra) every model is written with `export_gguf` (`--outtype`) and timed as
`export.LlamaCppRuntime` times a step: each of the batch's sequences in its own KV stream, a decode timing the mean of
`--decode-tokens` successive steps.

The tables are written beside the results (`--tables DIR`) for reuse. Timings need a quiet machine: run it alone,
under the timing lock (`harness.timing_lock`); the machine's load is recorded with every workload.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("TQDM_DISABLE", "1")

import harness  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from optimum_prune.evaluation.cost_model import (  # noqa: E402
    NO_OP,
    CostTable,
    Workload,
    assembled_model,
    attention_variants,
    check_cost_table,
    fit_cost_table,
    layer_row_of,
    measure_assemblies,
    measure_cost_table,
    random_assemblies,
)

logger = logging.getLogger("cost_model")
WORKLOADS = ("prefill:1:512", "decode:1:2048", "decode:16:2048")


def smollm2_config() -> transformers.PretrainedConfig:
    from optimum_prune.samples import SMOLLM2_GGUF_FILE, smollm2_dir

    return transformers.AutoConfig.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF_FILE)


def assemblies(config) -> dict[str, list[dict[str, Any]]]:
    """Per-layer shapes of the assemblies checked: each a list of rows (one per layer). Layer 0 keeps its attention
    in every one (llama.cpp takes the head size from it)."""
    n, full = config.num_hidden_layers, config.intermediate_size
    kv = config.num_key_value_heads
    fewer = [a for a in attention_variants(config) if a != NO_OP][-1]  # the fewest KV heads
    row = lambda a, m: layer_row_of(config, a, m)  # noqa: E731
    return {
        "dense": [row(kv, full) for _ in range(n)],
        "mlp 1280 (servable-like 20%)": [row(kv, 1280 if i % 2 else 1024) for i in range(n)],
        "mlp 768 (50% of the MLP)": [row(kv, 768) for _ in range(n)],
        f"kv {fewer} everywhere": [row(fewer, full) for _ in range(n)],
        "attention removed in 10 layers": [row(NO_OP if i % 3 == 1 else kv, full) for i in range(n)],
        "mixed": [row((NO_OP, fewer, kv)[i % 3] if i else kv, (512, 1536, 1024, 768)[i % 4]) for i in range(n)],
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), help="phase:batch:context")
    p.add_argument("--layers", type=int, default=24, help="layers of each variant's timing model")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (1: on this 2-core machine a 16-row GEMM on 2 threads ran 30x slower)")  # fmt: skip
    p.add_argument("--runtime", default="transformers", choices=["transformers", "llama.cpp"],
                   help="where the steps are timed (llama.cpp: the llamacpp extra)")  # fmt: skip
    p.add_argument("--outtype", default="f16", choices=["f32", "f16", "bf16", "q8_0"], help="llama.cpp's weight type")
    p.add_argument("--decode-tokens", type=int, default=8, help="llama.cpp: decode steps per timing (their mean)")
    p.add_argument("--tables", default=None, help="also save each CostTable here (JSON; a fitted one as *_fit.json)")
    p.add_argument("--reuse-tables", action="store_true", help="take the per-variant tables saved in --tables")
    p.add_argument(
        "--fit",
        type=int,
        default=12,
        help="random full-depth assemblies the table is refitted to (0: none); the named ones are held out",
    )
    p.add_argument("--fit-batch", type=int, default=4, help="assemblies timed interleaved at a time")
    p.add_argument("--fit-prior", type=float, default=0.1, help="fit_cost_table's ridge towards the table")
    p.add_argument("--output", default=None,
                   help="results file (default: results/cost_model_smollm2.json, *_llamacpp.json for llama.cpp)")  # fmt: skip
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2 (smoke test)")
    args = p.parse_args(argv)
    if args.output is None:
        suffix = "_llamacpp" if args.runtime == "llama.cpp" else ""
        args.output = str(harness.RESULTS_DIR / f"cost_model_smollm2{suffix}.json")
    return args


def tiny_config(vocab_size: int = 512) -> transformers.PretrainedConfig:
    return transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=1536,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=3)  # fmt: skip


def make_runtime(args) -> tuple[Any, int | None]:
    """The runtime the steps are timed in, and the vocabulary size its models need (llama.cpp writes each GGUF file
    with SmolLM2's tokenizer)."""
    if args.runtime == "transformers":
        return "transformers", None
    from optimum_prune.export import LlamaCppRuntime
    from optimum_prune.samples import SMOLLM2_GGUF_FILE, smollm2_dir

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF_FILE)
    runtime = LlamaCppRuntime(tokenizer, outtype=args.outtype, threads=args.threads or None,
                              decode_tokens=args.decode_tokens)  # fmt: skip
    return runtime, len(tokenizer)


def main(argv=None) -> int:
    args = parse_args(argv)
    harness.setup_logging()
    if args.threads:
        torch.set_num_threads(args.threads)
    runtime, vocab_size = make_runtime(args)
    config = tiny_config(vocab_size or 512) if args.tiny else smollm2_config()
    workloads = [Workload.parse(name) for name in args.workloads]
    if runtime != "transformers":
        for workload in workloads:
            runtime.check(workload)  # before any timing
    label = "transformers static cache, fp32" if runtime == "transformers" else runtime.label
    result: dict[str, Any] = {**harness.environment(argv), "model": "tiny" if args.tiny else "SmolLM2-135M",
                              "runtime": label, "settings": vars(args), "workloads": {}}  # fmt: skip
    shapes = assemblies(config)
    timing = {"rounds": args.rounds, "warmup": args.warmup, "runtime": runtime}
    with harness.timing_lock():
        for workload in workloads:
            name = workload.name
            load0 = harness.loadavg()
            path = Path(args.tables or ".") / f"cost_table_{name.replace(':', '_')}.json"
            if args.reuse_tables and path.is_file():
                table = CostTable.load(path)
                timed_in = table.info.get("runtime", "")
                if timed_in.startswith("llama.cpp") != (args.runtime == "llama.cpp"):
                    raise SystemExit(f"{path} was timed in {timed_in}, not {args.runtime}: give another --tables.")
            else:
                table = measure_cost_table(config, workload, layers=args.layers, **timing)
                if args.tables:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    table.save(path)
            models = {k: assembled_model(config, rows) for k, rows in shapes.items()}
            checked = check_cost_table(table, models, **timing)
            rec = {"table": table.to_dict(), "checked": checked}
            if args.fit:
                fit_rows = random_assemblies(config, args.fit, seed=0)
                measured = measure_assemblies(config, fit_rows, workload, batch=args.fit_batch, **timing)
                fitted = fit_cost_table(table, fit_rows, measured, prior=args.fit_prior)
                if args.tables:
                    fitted.save(path.with_name(path.stem + "_fit.json"))
                rec["fitted"] = {"table": fitted.to_dict(), "fit_measured_s": measured,
                                 "checked": {k: {**c, "predicted_s": fitted.predict(shapes[k]),
                                                 "error": fitted.predict(shapes[k]) / c["measured_s"] - 1}
                                             for k, c in checked.items()}}  # fmt: skip
            rec["load_average"] = [load0, harness.loadavg()]
            result["workloads"][name] = rec
            logger.info("%s: %s", name, {k: round(v["error"], 3) for k, v in checked.items()})
            harness.write_results(result, Path(args.output), renderer="cost_model")
    return 0


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# Cost model: {result['model']}, {result.get('runtime', 'transformers static cache, fp32')}", ""]
    lines += [
        "A `CostTable` per workload (seconds per sublayer variant, measured as the difference between a model of "
        f"{result['settings']['layers']} identical layers of the variant and the empty model of that depth; {result['settings'].get('threads') or 'torch default'} thread(s)), and its "
        "prediction of whole assembled models against their measured step time (medians of interleaved rounds; "
        "`error` = predicted / measured − 1).",
        "",
    ]
    if result.get("runtime", "").startswith("llama.cpp"):
        lines += [
            "In llama.cpp every timed model is a GGUF file written by `export_gguf`; a layer without an MLP is skipped "
            "whole by llama.cpp's `deci` graph, so each timing model has a whole first layer in front and attention "
            "is timed beside the narrowest MLP, whose own cost is taken off.",
            "",
        ]
    for name, rec in result["workloads"].items():
        table = CostTable.from_dict(rec["table"])
        ms = lambda s: f"{1e3 * s:.2f}"  # noqa: E731
        lines += [f"## {name}", "", f"Load average before / after: {rec['load_average']}.", ""]
        lines += ["| attention variant | ms |", "|---|---|"]
        for k, v in table.attention.items():
            lines.append(f"| {k + ' KV heads' if k != NO_OP else 'no_op'} | {ms(v)} |")
        lines += ["", "| MLP variant | ms |", "|---|---|"]
        for k, v in sorted(table.mlp.items(), key=lambda kv: -1 if kv[0] == NO_OP else int(kv[0]), reverse=True):
            lines.append(f"| {k if k == NO_OP else 'width ' + k} | {ms(v)} |")
        lines += ["", f"Fixed part {ms(table.fixed_s)} ms, per layer {ms(table.per_layer_s)} ms.", ""]
        lines += ["| assembly | predicted ms | measured ms (median) | error |", "|---|---|---|---|"]
        for k, c in rec["checked"].items():
            lines.append(f"| {k} | {ms(c['predicted_s'])} | {ms(c['measured_s'])} | {100 * c['error']:+.1f}% |")
        errors = [abs(c["error"]) for c in rec["checked"].values()]
        lines += ["", f"Largest |error| {100 * max(errors):.1f}%, median {100 * statistics.median(errors):.1f}%.", ""]
        if "fitted" in rec:
            fit = rec["fitted"]
            info = fit["table"]["info"]["fit"]
            lines += [f"Refitted to the measured step times of {info['assemblies']} random full-depth assemblies "
                      f"(`fit_cost_table`, prior {info['prior']}; largest residual on them "
                      f"{100 * max(abs(r) for r in info['relative_residuals']):.1f}%); the assemblies above, held out:",
                      "", "| assembly | predicted ms (fitted) | measured ms | error |", "|---|---|---|---|"]  # fmt: skip
            for k, c in fit["checked"].items():
                lines.append(f"| {k} | {ms(c['predicted_s'])} | {ms(c['measured_s'])} | {100 * c['error']:+.1f}% |")
            errors = [abs(c["error"]) for c in fit["checked"].values()]
            lines += ["", f"Largest |error| {100 * max(errors):.1f}%, median {100 * statistics.median(errors):.1f}%.",
                      ""]  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
