"""Scratch directories that a killed process does not leave behind for good.

A save writes to a temporary directory next to its target, a low-memory run writes pruned blocks to a work
directory, and calibration activations can spill to disk: each can be as large as the model. An exception removes
them, a kill (SIGKILL, the OOM killer, a lost node) cannot. Their names therefore carry the host and the process id
(`<name>.<host>-<pid>.<random><suffix>`), and the next process that makes a directory of the same name in the same
place removes those whose process is gone (same host only: another host's process cannot be checked).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import socket
import tempfile
from pathlib import Path

__all__ = ["make_scratch_dir", "remove_stale", "write_text_atomic"]

logger = logging.getLogger(__name__)


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _size(directory: Path) -> int:
    """Bytes of the files under `directory` (0 for those another process removes meanwhile)."""
    total = 0
    for f in directory.rglob("*"):
        try:
            total += f.stat().st_size if f.is_file() else 0
        except OSError:
            pass
    return total


def remove_stale(where: str | os.PathLike, name: str, suffix: str = "") -> list[Path]:
    """Remove the directories `<name>.<this host>-<pid>.*<suffix>` in `where` whose process is gone; returns them."""
    where = Path(where)
    if not where.is_dir():
        return []
    pattern = re.compile(re.escape(f"{name}.{_host()}-") + r"(\d+)\.[^.]+" + re.escape(suffix) + "$")
    removed = []
    for entry in where.iterdir():
        m = pattern.match(entry.name)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))) and entry.is_dir():
            size = _size(entry)
            shutil.rmtree(entry, ignore_errors=True)
            logger.warning("Removed %s (%.2f GB): left by an interrupted run (process %s).", entry, size / 1e9,
                           m.group(1))  # fmt: skip
            removed.append(entry)
    return removed


def make_scratch_dir(where: str | os.PathLike | None, name: str, suffix: str = "") -> Path:
    """A new directory `<name>.<host>-<pid>.<random><suffix>` in `where` (default: the system temporary directory),
    after removing the ones of the same `name` that killed processes left there."""
    where = Path(where) if where is not None else Path(tempfile.gettempdir())
    remove_stale(where, name, suffix)
    return Path(tempfile.mkdtemp(prefix=f"{name}.{_host()}-{os.getpid()}.", suffix=suffix, dir=where))


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` through a temporary file of its own next to it (flushed to disk, then renamed over
    `path`): a reader never sees a partial file, and processes or threads writing the same path at once never move
    each other's temporary file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
