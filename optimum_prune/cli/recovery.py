"""`optimum-prune finetune`, `optimum-prune push` and the zero-shot part of `optimum-prune eval --tasks`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..auto import AutoPruner
from ..evaluation.zero_shot import zero_shot
from ..finetune import FinetuneConfig
from ..hub import upload_folder
from .common import UserError, _check_parent, _overrides, _write_json
from .inputs import _load, _texts

__all__ = ["cmd_finetune", "cmd_push", "run_zero_shot"]


def cmd_finetune(args: argparse.Namespace) -> int:
    fields = {
        **{k: v for k, v in (("method", args.method), ("learning_rate", args.lr), ("batch_size", args.batch_size),
                             ("seq_len", args.seq_len)) if v is not None},
        **({"max_steps": args.steps} if args.steps is not None else {}),
        **({"eval_at_tokens": tuple(args.eval_at)} if args.eval_at else {}), "streaming": args.stream,
        "merge": not args.no_merge, **({"distill": args.distill} if args.distill else {}), "seed": args.seed,
        "output_dir": args.checkpoint_dir, **_overrides(args.set),
    }  # fmt: skip
    # every argument is checked before the model is loaded
    if args.tokens is not None and args.method is None and args.lr is None and not args.distill:
        config = FinetuneConfig.for_budget(args.tokens, distill=bool(args.teacher), **fields)
    else:
        defaults = {"method": "lora", "learning_rate": 2e-4, "batch_size": 4, "seq_len": 512}
        budget = {"token_budget": args.tokens} if args.tokens is not None else {}
        config = FinetuneConfig.from_dict({**defaults, **fields, **budget})
    out = Path(args.output)
    if out.exists() and not args.overwrite:
        raise FileExistsError(f"{out} already exists; choose another --output or pass --overwrite.")
    _check_parent(args.report)
    if config.distill and not args.teacher:
        raise UserError("--distill needs --teacher PATH: the unpruned model (a directory or .gguf file).")
    dataset = _texts(args.data, args.holdout_fraction, args.split_seed, part=0, lazy=args.stream)
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
