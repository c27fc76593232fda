"""`optimum-prune cost-model`: a cost table of a decoder's sublayer variants at a workload, measured on this machine
(or the analytic bytes / FLOP model), saved as JSON for a later run to reuse."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import transformers

from ..evaluation.cost_model import (
    Workload,
    analytic_cost_table,
    assembled_model,
    check_cost_table,
    fit_cost_table,
    layer_row_of,
    measure_assemblies,
    measure_cost_table,
    random_assemblies,
)
from ..export import LlamaCppRuntime
from .common import UserError, _model_location, _rounded

__all__ = ["cmd_cost_model"]


def cmd_cost_model(args: argparse.Namespace) -> int:
    threads = torch.get_num_threads()
    if args.threads is not None and not args.analytic:
        torch.set_num_threads(args.threads)
    try:
        return _cost_model(args)
    finally:
        torch.set_num_threads(threads)


def _cost_model(args: argparse.Namespace) -> int:
    try:
        workloads = [Workload.parse(w) for w in (args.workload or ["decode:1:2048"])]
    except ValueError as e:
        raise UserError(str(e)) from e
    if args.analytic and len(args.analytic) != 2:
        raise UserError("--analytic takes two numbers: memory bandwidth in GB/s and compute in TFLOP/s.")
    out_dir = Path(args.output)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--output {args.output} is a file; it names a directory (one cost table per workload).")
    path, gguf_file = _model_location(args.model, args.gguf_file)
    try:
        config = transformers.AutoConfig.from_pretrained(path, gguf_file=gguf_file)
    except (OSError, ValueError) as e:
        raise UserError(f"Cannot read the model configuration of {args.model}: {e}") from e
    dtype = getattr(torch, args.dtype) if args.dtype not in (None, "auto") else torch.float32
    runtime = "transformers"
    if args.runtime == "llama.cpp" and not args.analytic:
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)
        except (OSError, ValueError) as e:
            raise UserError(f"Timing in llama.cpp writes GGUF files with the model's tokenizer: {e}") from e
        runtime = LlamaCppRuntime(tokenizer, threads=args.threads)  # its ImportError names the extra
        for w in workloads:
            runtime.check(w)  # before any timing (a ValueError: the CLI's own error)
    out_dir.mkdir(parents=True, exist_ok=True)
    timing = {"rounds": args.rounds, "warmup": args.warmup, "dtype": dtype, "runtime": runtime}
    for w in workloads:
        if args.analytic:
            table = analytic_cost_table(config, w, bandwidth_gbs=args.analytic[0], tflops=args.analytic[1])
        else:
            try:
                table = measure_cost_table(config, w, layers=args.layers, **timing)
            except ValueError as e:
                raise UserError(str(e)) from e
        if args.fit and not args.analytic:
            rows = random_assemblies(config, args.fit)
            measured = measure_assemblies(config, rows, w, **timing)
            table = fit_cost_table(table, rows, measured)
        summary = {"workload": w.name, "source": table.source, "fixed_ms": 1e3 * table.fixed_s,
                   "attention_ms": {k: 1e3 * v for k, v in table.attention.items()},
                   "mlp_ms": {k: 1e3 * v for k, v in table.mlp.items()}}  # fmt: skip
        if args.check and not args.analytic:  # the dense model, assembled, against the table's prediction
            n, kv, width = config.num_hidden_layers, config.num_key_value_heads, config.intermediate_size
            dense = assembled_model(config, [layer_row_of(config, kv, width) for _ in range(n)])
            check = check_cost_table(table, {"dense": dense}, rounds=args.rounds, warmup=args.warmup,
                                     runtime=runtime)["dense"]  # fmt: skip
            table.info["check_dense"] = {k: check[k] for k in ("predicted_s", "measured_s", "error")}
            summary["dense_predicted_vs_measured"] = check["error"]
        path = out_dir / f"cost_table_{w.phase}_{w.batch}_{w.context}.json"
        table.save(path)
        print(json.dumps(_rounded(summary, 4)), file=sys.stderr)
        print(f"wrote {path}", file=sys.stderr)
    return 0
