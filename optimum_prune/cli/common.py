"""What every `optimum-prune` command shares and the parser needs too, without torch: one-line user errors, `--set`
values, model paths, JSON output. Loading the models and texts named on the command line: `inputs.py`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


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


def _rounded(data: Any, digits: int = 12) -> Any:
    """Floats to `digits` significant digits: `0.30000000000000004` is printed `0.3`; 12 keep a perplexity's
    precision."""
    if isinstance(data, float):
        return float(f"{data:.{digits}g}")
    if isinstance(data, dict):
        return {k: _rounded(v, digits) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_rounded(v, digits) for v in data]
    return data


def _write_json(data: Any, path: str | None) -> None:
    text = json.dumps(_rounded(data), indent=2, default=str)
    if path:
        Path(path).write_text(text + "\n", encoding="utf-8")
        print(f"wrote {path}", file=sys.stderr)
    else:
        print(text)


def _check_parent(path: str | None) -> None:
    """Fail before the slow part when a result file could not be written."""
    if path and not Path(path).absolute().parent.is_dir():
        raise UserError(f"Cannot write {path}: directory {str(Path(path).absolute().parent)!r} does not exist.")
