"""Sharing pruned models: the model card `save_pretrained` writes, and `push_to_hub` (one commit of exactly the folder
`save_pretrained` writes).

The network is touched only by `HfApi.create_repo` and `HfApi.upload_folder`; a missing token or offline mode fails
before anything is written, and the folder is built in a temporary directory that is always removed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from torch import nn

from .constants import PRUNED_MODEL_TYPE_PREFIX, PRUNING_CONFIG_NAME
from .modeling.auto_classes import auto_class_for_config

__all__ = ["model_card", "push_to_hub", "upload_folder", "check_hub_access"]

logger = logging.getLogger(__name__)

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _base_model(model: nn.Module, given: str | None) -> str | None:
    if given:
        return given
    name = str(getattr(model.config, "_name_or_path", "") or "")
    return name if _REPO_ID.match(name) and not Path(name).exists() else None


def _fmt_params(n: Any) -> str:
    return f"{n / 1e6:.2f} M" if isinstance(n, (int, float)) else "?"


def _configs(entry: dict) -> list[dict]:
    """The config dicts of one history entry (a recipe entry holds a list of them)."""
    config = entry.get("config") or {}
    return [c for c in config if isinstance(c, dict)] if isinstance(config, list) else [config]


def _history_section(history: list[dict]) -> list[str]:
    lines = []
    for i, h in enumerate(history, 1):
        r = h.get("report", {})
        calib = h.get("calibration") or {}
        src = calib.get("source") if isinstance(calib, dict) else None
        if isinstance(src, dict):
            where = src.get("path") or src.get("name") or src.get("kind")
        else:
            where = src or "none (data-free)"
        lines += [
            f"### Step {i}: `{h.get('method')}`",
            "",
            f"- Target: {r.get('target')}; measured: {r.get('measured', float('nan')):.4f} "
            "(fraction of attention + MLP parameters removed, or zeroed for unstructured / N:M)",
            f"- Parameters: {_fmt_params(r.get('params_before'))} → {_fmt_params(r.get('params_after'))}",
            f"- Calibration: {where}"
            + (
                f", {calib.get('num_samples')} × {calib.get('seq_len')} tokens, seed {calib.get('seed')}"
                if calib
                else ""
            ),
            "",
            "```json",
            json.dumps(h.get("config", {}), indent=2, sort_keys=True),
            "```",
            "",
        ]
    return lines


def _finetune_section(finetune: list[dict]) -> list[str]:
    images = any(f.get("accuracy_before") is not None for f in finetune)  # image classifiers report accuracy
    metric, key, fmt = ("held-out accuracy", "accuracy", ".4f") if images else ("held-out ppl", "perplexity", ".2f")
    seq_head, seq_rule = ("", "") if images else (" seq_len |", "---:|")
    lines = ["## Recovery fine-tuning", "", f"| method | distill | steps |{seq_head} {metric} before | after | time (s) |",
             f"|---|---|---:|{seq_rule}---:|---:|---:|"]  # fmt: skip
    for f in finetune:
        c = f.get("config", {})
        seq = "" if images else f" {c.get('seq_len')} |"
        before, after = (f.get(f"{key}_{w}") for w in ("before", "after"))
        lines.append(
            f"| {c.get('method')} | {c.get('distill') or '-'} | {c.get('max_steps')} |{seq} "
            f"{float('nan') if before is None else before:{fmt}} | {float('nan') if after is None else after:{fmt}} | "
            f"{f.get('train_runtime_s', 0):.0f} |"
        )
    return [*lines, ""]


def model_card(
    model: nn.Module,
    side_car: dict,
    config: Any,
    *,
    base_model: str | None = None,
    license: str | None = None,
    evaluation: dict | None = None,
    tags: list[str] | None = None,
    repo_id: str | None = None,
) -> Any:
    """A `huggingface_hub.ModelCard` describing a pruned checkpoint.

    Args:
        model (`PreTrainedModel`): the pruned model.
        side_car (`dict`): the content of `pruning_config.json` (history, fine-tuning, loadability).
        config (`PretrainedConfig`): the exported config (stock or `optimum_pruned_*`).
        base_model (`str | None`): Hub id of the unpruned model (default: the model's `_name_or_path` when it is a
            Hub id).
        license (`str | None`): license id, when known.
        evaluation (`dict | None`): extra results to list (name → value).
        tags (`list[str] | None`): extra tags.
        repo_id (`str | None`): where the card will live (used in the loading snippet).
    """
    from huggingface_hub import ModelCard, ModelCardData

    history = side_car.get("history", [])
    methods = sorted({c.get("method") for h in history for c in _configs(h) if c.get("method")})
    stock = side_car.get("loadable_with_stock_transformers", True)
    base = _base_model(model, base_model)
    all_tags = ["pruned", "optimum-prune", *methods]
    if any(c.get("pattern", "structured") != "structured" for h in history for c in _configs(h)):
        all_tags.append("sparse")
    if side_car.get("finetune"):
        all_tags.append(
            "lora" if any(f["config"].get("method") == "lora" for f in side_car["finetune"]) else "finetuned"
        )
    all_tags += list(tags or [])
    task, auto = auto_class_for_config(config)
    pipeline = {"causal-lm": "text-generation", "image-classification": "image-classification"}
    data = ModelCardData(
        base_model=base, library_name="transformers", pipeline_tag=pipeline.get(task, "image-feature-extraction"),
        license=license, tags=list(dict.fromkeys(all_tags)),
    )  # fmt: skip
    name = base or getattr(model.config, "model_type", "model")
    first, last = (history[0].get("report", {}), history[-1].get("report", {})) if history else ({}, {})
    where = repo_id or "path/to/this/checkpoint"
    ours = {"causal-lm": "AutoPrunedModelForCausalLM", "image-classification": "AutoPrunedModelForImageClassification"}
    if stock:
        loader = f'from transformers import {auto.__name__}\n\nmodel = {auto.__name__}.from_pretrained("{where}")'
    elif task in ours:
        loader = (f"import optimum_prune  # registers the pruned architectures\nfrom optimum_prune import {ours[task]}"
                  f'\n\nmodel = {ours[task]}.from_pretrained("{where}")')  # fmt: skip
    else:
        loader = (f"import optimum_prune  # registers the pruned architectures\nfrom transformers import {auto.__name__}"
                  f'\n\nmodel = {auto.__name__}.from_pretrained("{where}")')  # fmt: skip
    body = [
        f"# {name}, pruned with optimum-prune",
        "",
        f"Pruned with {', '.join(f'`{m}`' for m in methods) or 'no method'} "
        f"({len(history)} step{'s' if len(history) != 1 else ''}) by "
        f"[optimum-prune](https://github.com/huggingface/optimum) {side_car.get('optimum_prune_version', '')}.",
        "",
        f"- Parameters: {_fmt_params(first.get('params_before'))} before, {_fmt_params(last.get('params_after'))} after",
        f"- Architecture: `{config.model_type}`"
        + ("" if stock else f" (per-layer shapes; `{PRUNED_MODEL_TYPE_PREFIX}*` needs `pip install optimum-prune`)"),
        f"- Full record: `{PRUNING_CONFIG_NAME}`",
        "",
        "## Pruning",
        "",
        *_history_section(history),
    ]
    if side_car.get("finetune"):
        body += _finetune_section(side_car["finetune"])
    if evaluation:
        body += ["## Evaluation", "", "| metric | value |", "|---|---:|"]
        body += [f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in evaluation.items()]
        body.append("")
    body += ["## How to load", "", "```python", loader, "```", ""]
    if not stock:
        body += ["Stock `transformers` cannot build this checkpoint (its layers differ in shape): it fails loudly "
                 "instead of loading wrong weights.", ""]  # fmt: skip
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body))


def check_hub_access(token: str | None) -> str:
    """The token to use; raises before anything is written when offline or without a token."""
    from huggingface_hub import constants, get_token

    if constants.HF_HUB_OFFLINE:
        raise OSError(
            "Cannot push to the Hub: offline mode is on (HF_HUB_OFFLINE=1). Unset it, or save locally with "
            "save_pretrained() and upload later."
        )
    token = token or get_token()
    if not token:
        raise OSError(
            "Cannot push to the Hub without a token: run `hf auth login`, set HF_TOKEN, or pass token=... "
            "Nothing was written."
        )
    return token


def upload_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
) -> Any:
    """Create the repo if needed and upload `folder` in one commit (the `CommitInfo`)."""
    from huggingface_hub import HfApi

    if not isinstance(repo_id, str) or not _REPO_ID.match(repo_id):
        raise ValueError(f"repo_id must look like 'user/name', got {repo_id!r}.")
    token = check_hub_access(token)
    folder = Path(folder)
    if not (folder / PRUNING_CONFIG_NAME).is_file():
        raise FileNotFoundError(f"{folder} is not a checkpoint saved by optimum-prune (no {PRUNING_CONFIG_NAME}).")
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    info = api.upload_folder(
        repo_id=repo_id, folder_path=str(folder), commit_message=commit_message or "Upload pruned model (optimum-prune)",
        revision=revision, create_pr=create_pr, repo_type="model",
    )  # fmt: skip
    logger.info("Uploaded %s to %s", folder, repo_id)
    return info


def push_to_hub(
    model: nn.Module,
    repo_id: str,
    tokenizer: Any = None,
    *,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    model_card: bool | dict = True,
    max_shard_size: str | int = "5GB",
) -> Any:
    """Save `model` (as `save_pretrained` does: checkpoint, tokenizer, `pruning_config.json`, README.md) into a
    temporary folder and upload that folder to `repo_id` in one commit. Returns the `CommitInfo`."""
    from .serialization import save_pruned_model

    if not isinstance(repo_id, str) or not _REPO_ID.match(repo_id):
        raise ValueError(f"repo_id must look like 'user/name', got {repo_id!r}.")
    token = check_hub_access(token)  # before anything is written
    if model_card:
        model_card = {"repo_id": repo_id, **(model_card if isinstance(model_card, dict) else {})}
    with tempfile.TemporaryDirectory(prefix="optimum_prune_push_") as tmp:
        folder = save_pruned_model(
            model, Path(tmp) / "model", tokenizer, max_shard_size=max_shard_size, model_card=model_card
        )
        return upload_folder(folder, repo_id, private=private, token=token, commit_message=commit_message,
                             revision=revision, create_pr=create_pr)  # fmt: skip
