"""The model card (`README.md`) that `save_pretrained` writes next to a pruned checkpoint: what was pruned and how,
the fine-tuning it had, and how to load it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData
from torch import nn

from .constants import PRUNED_MODEL_TYPE_PREFIX, PRUNING_CONFIG_NAME
from .modeling.architectures import spec_for_config
from .modeling.auto_classes import auto_class_for_config
from .modeling.decilm import DECI_MODEL_TYPE

__all__ = ["model_card", "REPO_ID"]

# A Hub repository id, `user/name`.
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _base_model(model: nn.Module, given: str | None) -> str | None:
    if given:
        return given
    name = str(getattr(model.config, "_name_or_path", "") or "")
    return name if REPO_ID.match(name) and not Path(name).exists() else None


def _fmt_params(n: Any) -> str:
    return f"{n / 1e6:.2f} M" if isinstance(n, (int, float)) else "?"


def _configs(entry: dict) -> list[dict]:
    """The config dicts of one history entry (a recipe entry holds a list of them)."""
    config = entry.get("config") or {}
    return [c for c in config if isinstance(c, dict)] if isinstance(config, list) else [config]


def _experts_line(model: nn.Module, layers: list[dict]) -> list[str]:
    """`- Experts per layer: 8 → 6 (top-2 routing), 192 → 144 channels each` for a mixture-of-experts model (the
    counts before from the model's config, after from its layers)."""
    spec = spec_for_config(model.config)
    rows = [r for r in layers if "num_experts" in r]
    if spec is None or spec.moe is None or not rows:
        return []
    keys = spec.config_keys

    def span(values: set) -> str:
        return str(min(values)) if len(values) == 1 else f"{min(values)}-{max(values)}"

    before_e, before_w = (
        getattr(model.config, keys["experts"], None),
        getattr(model.config, keys["intermediate"], None),
    )
    after_e, after_w = span({r["num_experts"] for r in rows}), span({r["intermediate_size"] for r in rows})
    return [
        f"- Experts per layer: {before_e} → {after_e} (top-{model.config.num_experts_per_tok} routing), "
        f"{before_w} → {after_w} channels each"
    ]


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


def _architecture_note(config, stock: bool) -> str:
    if config.model_type == DECI_MODEL_TYPE:
        return " (DeciLM `block_configs`: per-layer shapes that vLLM, SGLang, TensorRT-LLM, MLX and llama.cpp read)"
    return "" if stock else f" (per-layer shapes; `{PRUNED_MODEL_TYPE_PREFIX}*` needs `pip install optimum-prune`)"


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
        f"- Architecture: `{config.model_type}`" + _architecture_note(config, stock),
        *_experts_line(model, side_car.get("layers") or []),
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
    if config.model_type == DECI_MODEL_TYPE:
        body += [
            "Serving engines read the DeciLM `block_configs` with their own model code; the configuration code "
            "`auto_map` names ships in this folder (hence `--trust-remote-code`):",
            "",
            "```bash",
            f"vllm serve {where} --trust-remote-code",
            f"python -m sglang.launch_server --model-path {where} --trust-remote-code",
            f"mlx_lm.generate --model {where} --prompt 'Hello'",
            f"python convert_hf_to_gguf.py {where} --outfile model.gguf  # llama.cpp's converter",
            "```",
            "",
        ]
    elif not stock:
        body += ["Stock `transformers` cannot build this checkpoint (its layers differ in shape): it fails loudly "
                 "instead of loading wrong weights.", ""]  # fmt: skip
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body))
