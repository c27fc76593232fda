"""llama.cpp's own HF → GGUF converter (`convert_hf_to_gguf.py`, its `conversion/` package and `gguf-py`), taken from
the llama-cpp-python sdist on PyPI (pure Python: nothing is compiled) and cached, for the tests and benchmarks that
check our saved directories with a reader we did not write.

`python tests/llamacpp_converter.py` fetches it (`make install` does) and prints the folder; `converter_dir()` does
the same from Python. The cache is `$OPTIMUM_PRUNE_CACHE` (default `~/.cache/optimum_prune`); two processes fetching
at once wait for each other. Standard library only.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

__all__ = ["LLAMA_CPP_PYTHON", "convert", "converter_dir"]

# The llama-cpp-python release whose vendored llama.cpp we check against (the same pin as the `llamacpp` extra).
LLAMA_CPP_PYTHON = "0.3.36"
_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "LICENSE")


def _cache_root() -> Path:
    return Path(os.environ.get("OPTIMUM_PRUNE_CACHE") or Path.home() / ".cache" / "optimum_prune")


def converter_dir() -> Path:
    """The folder holding `convert_hf_to_gguf.py` (fetched from PyPI on first use)."""
    root = _cache_root()
    target = root / f"llama.cpp-converter-{LLAMA_CPP_PYTHON}"
    if (target / "convert_hf_to_gguf.py").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "convert_hf_to_gguf.py").is_file():  # fetched by another process meanwhile
            return target
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", tmp]
            cmd.append(f"llama-cpp-python=={LLAMA_CPP_PYTHON}")
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(
                    f"Could not fetch llama.cpp's converter (the llama-cpp-python {LLAMA_CPP_PYTHON} sdist) from "
                    f"PyPI:\n{done.stderr[-2000:]}\nWith network access run `python tests/llamacpp_converter.py` "
                    f"(make install does), or unpack the sdist's vendor/llama.cpp/{{{','.join(_PARTS)}}} into {target}."
                )
            (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
            prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
            out = Path(tmp) / "converter"
            with tarfile.open(sdist) as tar:
                members = [m for m in tar.getmembers() if m.name.startswith(tuple(prefix + p for p in _PARTS))]
                for m in members:
                    m.name = m.name[len(prefix) :]
                tar.extractall(out, members=members, filter="data")
            os.replace(out, target)
    return target


# llama.cpp's DeciLM converter writes the vocabulary of Llama 3 (128256 tokens) or of a SentencePiece-style tokenizer
# and stops on any other (SmolLM2's byte-level BPE). `convert(..., gpt2_vocab=True)` runs the same script with the
# DeciLM class's vocabulary step swapped for the converter's own byte-level BPE one (`_set_vocab_gpt2`, which every
# GPT-2-style model class of the converter uses); the hyperparameters and tensors are still the DeciLM class's.
_GPT2_VOCAB = (
    "import runpy, sys; sys.path[:0] = [{folder!r}, {folder!r} + '/gguf-py']; import conversion.deci as d; "
    "d.DeciModel.set_vocab = lambda self: self._set_vocab_gpt2(); sys.argv = {argv!r}; "
    "runpy.run_path('convert_hf_to_gguf.py', run_name='__main__')"
)


def convert(
    model_dir: str | os.PathLike, outfile: str | os.PathLike, outtype: str = "f32", gpt2_vocab: bool = False
) -> str:
    """Run llama.cpp's `convert_hf_to_gguf.py` on `model_dir` in a fresh interpreter (which never imports
    optimum_prune; stdin closed, as in a script); returns its log. Raises `RuntimeError` with the log when it fails.
    `gpt2_vocab`: see `_GPT2_VOCAB` above."""
    folder = converter_dir()
    argv = ["convert_hf_to_gguf.py", str(model_dir), "--outfile", str(outfile), "--outtype", outtype]
    cmd = [sys.executable, *argv]
    if gpt2_vocab:
        cmd = [sys.executable, "-c", _GPT2_VOCAB.format(folder=str(folder), argv=argv)]
    done = subprocess.run(cmd, cwd=folder, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    log = done.stdout + done.stderr
    if done.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {model_dir}:\n{log[-4000:]}")
    return log


if __name__ == "__main__":
    print(converter_dir())
