"""Zero-shot evaluation with lm-eval-harness (the `[eval]` extra) on an in-memory model and local task definitions.

Tasks are given as YAML files (or directories of them) with local data files, or as names of tasks shipped with
optimum_prune (`bbc_news_topic`). Nothing is fetched from the Hub unless `allow_hub=True`, which also makes
lm-eval's own task registry available (ARC, BoolQ, HellaSwag, ... where the Hub is reachable).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import constants

from ..modeling.architectures import require_causal_lm
from .tasks import LOCAL_TASKS, local_task_path

__all__ = ["zero_shot", "resolve_tasks"]

logger = logging.getLogger(__name__)

# `datasets` builders that read local files: a task using one of them is offline when its data files exist.
_LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas")


def _require_lm_eval():
    try:
        import lm_eval  # noqa: F401, PLC0415  (optional dep: lm-eval, extra [eval])
    except ImportError as e:
        raise ImportError(
            "Zero-shot evaluation needs lm-eval-harness: pip install 'optimum-prune[eval]' "
            "(or pip install lm-eval; keep your torch with -c constraints)."
        ) from e


def _load_yaml(path: Path) -> dict:
    import yaml  # noqa: PLC0415  (optional dep: PyYAML, read for lm-eval task files)

    class _Loader(yaml.SafeLoader):
        pass

    _Loader.add_multi_constructor("!", lambda loader, suffix, node: None)  # lm-eval's !function tags
    with open(path, encoding="utf-8") as f:
        data = yaml.load(f, Loader=_Loader) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a task YAML (a mapping with `task:` and `dataset_path:`).")
    include = data.get("include")
    if include:
        base = _load_yaml((path.parent / include).resolve())
        data = {**base, **data}
    return data


def _check_offline(path: Path, data: dict) -> None:
    dataset_path = data.get("dataset_path")
    if dataset_path is None:
        if data.get("group") or data.get("task") and isinstance(data.get("task"), list):
            return  # a group of tasks: each member is checked by lm-eval's loading
        raise ValueError(f"Task {path} has no `dataset_path`.")
    if dataset_path in _LOCAL_BUILDERS:
        files = (data.get("dataset_kwargs") or {}).get("data_files")
        flat = files.values() if isinstance(files, dict) else ([files] if isinstance(files, str) else files or [])
        names = [f for v in flat for f in (v if isinstance(v, list) else [v])]
        missing = [f for f in names if not (path.parent / f).exists()]
        if not names or missing:
            raise FileNotFoundError(
                f"Task {path}: local data files {missing or '(none given)'} do not exist; set "
                "`dataset_kwargs.data_files` to existing files (paths relative to the YAML or absolute)."
            )
        return
    if (path.parent / dataset_path).exists():
        return
    raise ValueError(
        f"Task {path} needs the Hugging Face Hub (dataset_path={dataset_path!r}). Use local data files "
        f"(dataset_path: json|csv|parquet with dataset_kwargs.data_files), or pass allow_hub=True where the Hub is "
        "reachable."
    )


def resolve_tasks(tasks: list[str], allow_hub: bool = False, cache_dir: str | os.PathLike | None = None):
    """`(task names, include paths)` for lm-eval; every local YAML is checked (exists, offline) first."""

    if isinstance(tasks, (str, os.PathLike)):
        tasks = [tasks]
    if not tasks:
        raise ValueError("Give at least one task: a YAML path, a directory of YAMLs, or 'bbc_news_topic'.")
    names, include = [], []
    for t in tasks:
        t = os.fspath(t)
        if t in LOCAL_TASKS:
            path = local_task_path(t, cache_dir)
            names.append(t)
            include.append(str(path.parent))
            continue
        p = Path(t).expanduser()
        if p.suffix in (".yaml", ".yml") or p.exists():
            if not p.exists():
                raise FileNotFoundError(f"Task file {t!r} does not exist.")
            yamls = sorted(p.rglob("*.yaml")) if p.is_dir() else [p]
            if not yamls:
                raise FileNotFoundError(f"{t!r} holds no task YAML files.")
            for y in yamls:
                data = _load_yaml(y)
                if not allow_hub:
                    _check_offline(y, data)
                if isinstance(data.get("task"), str):
                    names.append(data["task"])
            include.append(str((p if p.is_dir() else p.parent).resolve()))
        elif allow_hub:
            names.append(t)  # a task of lm-eval's registry, data from the Hub
        else:
            raise ValueError(
                f"Unknown task {t!r}: give a task YAML path, a directory of YAMLs, or one of {sorted(LOCAL_TASKS)}; "
                "lm-eval's registry tasks (arc_easy, boolq, ...) need the Hub: pass allow_hub=True."
            )
    if allow_hub:
        if constants.HF_HUB_OFFLINE and any(n not in LOCAL_TASKS for n in names):
            raise OSError("allow_hub=True but offline mode is on (HF_HUB_OFFLINE=1); unset it or use local tasks.")
    return list(dict.fromkeys(names)), list(dict.fromkeys(include))


def zero_shot(
    model: torch.nn.Module,
    tokenizer: Any,
    tasks: list[str] | str,
    *,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 1,
    allow_hub: bool = False,
    cache_dir: str | os.PathLike | None = None,
    seed: int = 0,
    return_raw: bool = False,
) -> dict[str, dict[str, float]]:
    """Zero-shot (or few-shot) accuracy of an in-memory model with lm-eval-harness.

    Args:
        model (`PreTrainedModel`): the (pruned) causal LM, evaluated where it is.
        tokenizer (`PreTrainedTokenizerBase`): its tokenizer.
        tasks (`list[str] | str`): task YAML files, directories of YAMLs, or `"bbc_news_topic"`; with
            `allow_hub=True` also lm-eval task names (`"arc_easy"`, `"boolq"`, ...).
        limit (`int | float | None`): documents per task (a float is a fraction).
        num_fewshot (`int | None`): few-shot examples (default: the task's, usually 0).
        batch_size (`int`, defaults to `1`): requests per forward pass.
        allow_hub (`bool`, defaults to `False`): allow tasks whose data comes from the Hub.
        cache_dir (`str | os.PathLike | None`): where shipped tasks write their data files.
        seed (`int`, defaults to `0`): lm-eval's random seeds.
        return_raw (`bool`, defaults to `False`): also return lm-eval's full result dict under `"_raw"`.

    Returns:
        `dict`: `{task: {metric: value}}` (e.g. `{"bbc_news_topic": {"acc": 0.71, "acc_stderr": 0.03, ...}}`).
    """
    require_causal_lm(model, "Zero-shot evaluation with lm-eval")
    names, include = resolve_tasks(tasks, allow_hub, cache_dir)  # every check before lm-eval is imported
    _require_lm_eval()
    import lm_eval  # noqa: PLC0415  (optional dep: lm-eval, extra [eval])
    from lm_eval.models.huggingface import HFLM  # noqa: PLC0415  (optional dep: lm-eval)
    from lm_eval.tasks import TaskManager  # noqa: PLC0415  (optional dep: lm-eval)

    was_training = model.training
    lm = HFLM(pretrained=model.eval(), tokenizer=tokenizer, batch_size=batch_size)
    manager = TaskManager(include_path=include, include_defaults=allow_hub)
    try:
        out = lm_eval.simple_evaluate(
            model=lm, tasks=names, task_manager=manager, limit=limit, num_fewshot=num_fewshot, log_samples=False,
            random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
            bootstrap_iters=1000,
        )  # fmt: skip
    finally:
        model.train(was_training)
    results = {}
    for task, metrics in out["results"].items():
        results[task] = {
            k.split(",")[0]: float(v)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        results[task]["samples"] = int(out.get("n-samples", {}).get(task, {}).get("effective", 0))
    if return_raw:
        results["_raw"] = out
    return results
