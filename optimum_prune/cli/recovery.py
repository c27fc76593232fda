"""`optimum-prune finetune`, `optimum-prune push` and the zero-shot part of `optimum-prune eval --tasks`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..auto import AutoPruner
from ..evaluation.zero_shot import zero_shot
from ..finetune import FinetuneConfig
from ..hub import upload_folder
from .common import UserError, _check_parent, _load, _overrides, _texts, _write_json

__all__ = ["add_recovery_commands", "run_zero_shot"]


def cmd_finetune(args: argparse.Namespace) -> int:
    fields = {
        "method": args.method, "max_steps": args.steps, "batch_size": args.batch_size, "learning_rate": args.lr,
        "seq_len": args.seq_len, "merge": not args.no_merge, "distill": args.distill, "seed": args.seed,
        "output_dir": args.checkpoint_dir, **_overrides(args.set),
    }  # fmt: skip
    config = FinetuneConfig.from_dict(fields)  # every argument is checked before the model is loaded
    out = Path(args.output)
    if out.exists() and not args.overwrite:
        raise FileExistsError(f"{out} already exists; choose another --output or pass --overwrite.")
    _check_parent(args.report)
    if config.distill and not args.teacher:
        raise UserError("--distill needs --teacher PATH: the unpruned model (a directory or .gguf file).")
    dataset = _texts(args.data, args.holdout_fraction, args.split_seed, part=0)
    model, tokenizer = _load(args.model, args.gguf_file, args.dtype)
    if tokenizer is None:
        raise UserError(f"{args.model} has no tokenizer; fine-tuning needs one.")
    teacher = _load(args.teacher, None, args.dtype)[0] if config.distill else None
    pruner = AutoPruner(model, tokenizer, keep_teacher=False)
    report = pruner.finetune(config, dataset, teacher=teacher)
    saved = pruner.save_pretrained(out, overwrite=args.overwrite)
    result = {**report.to_dict(), "output": str(saved)}
    result.pop("loss_history", None)
    if args.report:
        _write_json(report.to_dict(), args.report)
    _write_json(result, None)
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    folder = Path(args.folder)
    if not folder.is_dir():
        raise UserError(f"{args.folder!r} is not a directory; give a folder written by save_pretrained / prune.")
    info = upload_folder(
        folder, args.repo_id, private=args.private, token=args.token, commit_message=args.message,
        revision=args.revision, create_pr=args.create_pr,
    )  # fmt: skip
    _write_json({"repo_id": args.repo_id, "folder": str(folder), "commit": str(getattr(info, "oid", info))}, None)
    return 0


def run_zero_shot(args: argparse.Namespace, model: Any, tokenizer: Any) -> dict:
    return zero_shot(
        model, tokenizer, args.tasks, limit=args.limit, num_fewshot=args.num_fewshot, batch_size=args.batch_size,
        allow_hub=args.allow_hub,
    )  # fmt: skip


def add_eval_task_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tasks", nargs="+", help="zero-shot tasks (lm-eval): task YAML files/dirs or 'bbc_news_topic'")
    p.add_argument("--limit", type=float, help="documents per task (an integer, or a fraction < 1)")
    p.add_argument("--num-fewshot", type=int, help="few-shot examples (default: the task's)")
    p.add_argument("--allow-hub", action="store_true", help="allow lm-eval registry tasks whose data needs the Hub")


def add_recovery_commands(sub: Any, model_args, split_args) -> None:
    p = sub.add_parser(
        "finetune",
        help="recovery fine-tuning (LoRA / full, optional distillation)",
        description="Fine-tune a pruned checkpoint on text (transformers.Trainer + PEFT) and save the result.",
    )
    model_args(p)
    p.add_argument("--data", required=True, help="training text: file, directory of .txt, or 'bbc'")
    p.add_argument("--method", choices=["lora", "full"], default="lora")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--distill", choices=["kl"], help="distill from --teacher (KL on logits)")
    p.add_argument("--teacher", help="the unpruned model (directory or .gguf file) for --distill")
    p.add_argument("--no-merge", action="store_true", help="keep LoRA as a PEFT adapter (saved in OUTPUT/adapter)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", help="Trainer output_dir (checkpoints); default: a temporary directory")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any other FinetuneConfig field")
    split_args(p, "train on the rest")
    p.add_argument("--output", "-o", required=True, help="output directory")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument("--report", help="write the full FinetuneReport JSON here")
    p.set_defaults(func=cmd_finetune)

    p = sub.add_parser(
        "push",
        help="upload a saved pruned checkpoint to the Hub",
        description="Upload a folder written by `prune` / `finetune` / save_pretrained to the Hub in one commit.",
    )
    p.add_argument("folder", help="the saved checkpoint directory")
    p.add_argument("repo_id", help="e.g. user/smollm2-np30")
    p.add_argument("--private", action="store_true", default=None)
    p.add_argument("--token", help="Hub token (default: the logged-in one / HF_TOKEN)")
    p.add_argument("--message", help="commit message")
    p.add_argument("--revision", help="branch to push to")
    p.add_argument("--create-pr", action="store_true")
    p.set_defaults(func=cmd_push)
