"""Scratch directories that a killed process does not leave behind for good.

A save writes to a temporary directory next to its target, a low-memory run writes pruned blocks to a work
directory, and calibration activations can spill to disk: each can be as large as the model. An exception removes
them, a kill (SIGKILL, the OOM killer, a lost node) cannot. Their names therefore carry the host and the process id
(`<name>.<host>-<pid>.<random><suffix>`), and the next process that makes a directory of the same name in the same
place removes those whose process is gone (same host only: another host's process cannot be checked).

The same module puts finished output in place atomically: `write_text_atomic` for one file, and for a directory
`check_target` (refuse a non-empty target without `overwrite`, pick where the temporary copy goes) then
`publish_directory` (move or rename the copy into place), used by `save_pruned` and `SolutionPath.save_pretrained`.
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

__all__ = [
    "make_scratch_dir",
    "remove_stale",
    "write_text_atomic",
    "check_output_dir",
    "check_target",
    "publish_directory",
]

logger = logging.getLogger(__name__)

_SHOWN_ENTRIES = 5  # entries named in the error for a non-empty target


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


def check_output_dir(
    target: str | os.PathLike, overwrite: bool, replace_hint: str = "pass overwrite=True to replace it"
) -> None:
    """Refuse a `target` that is a file, or a non-empty directory without `overwrite`; absent or empty is fine.

    The error names the entries in the way (the first few), so the user can see what would be replaced.
    """
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"{target} exists and is not a directory. Choose a directory path.")
    if overwrite or not target.is_dir():
        return
    entries = sorted(e.name for e in target.iterdir())
    if entries:
        shown = ", ".join(entries[:_SHOWN_ENTRIES]) + (
            f" and {len(entries) - _SHOWN_ENTRIES} more" if len(entries) > _SHOWN_ENTRIES else ""
        )
        raise FileExistsError(
            f"{target} already exists and is not empty ({len(entries)} "
            f"{'entry' if len(entries) == 1 else 'entries'} in the way: {shown}). "
            f"Choose a new or empty directory, or {replace_hint}."
        )


def check_target(target: Path, overwrite: bool) -> Path:
    """Check `target` and return the directory to write the temporary copy in: `target` itself when it is an
    existing empty directory (its files are then moved up into it, so the directory itself, e.g. a mount point or a
    scheduler's scratch directory in a read-only parent, is kept), else its parent (the copy is renamed into place).
    """
    remove_stale(target, f".{target.name}", ".tmp")  # what a killed save into this empty directory left
    check_output_dir(target, overwrite)
    if target.is_dir() and not any(target.iterdir()):
        where = target
    else:
        where = target.parent
        try:
            where.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise PermissionError(f"Cannot create {where}: {e}. Choose a writable output directory.") from e
    if not os.access(where, os.W_OK | os.X_OK):
        raise PermissionError(f"{where} is not writable. Choose a writable output directory.")
    return where


def _move_into(tmp: Path, target: Path) -> None:
    """Move the entries of `tmp` (inside the empty `target`) up into `target`; on failure `target` is empty again."""
    intruders = sorted(e.name for e in target.iterdir() if e.name != tmp.name)
    if intruders:  # something was written there while we were saving
        raise FileExistsError(f"{target} is no longer empty ({', '.join(intruders[:_SHOWN_ENTRIES])}); not saved.")
    moved = []
    try:
        for entry in sorted(tmp.iterdir()):
            os.rename(entry, target / entry.name)  # same file system: atomic, no copy
            moved.append(target / entry.name)
        tmp.rmdir()
    except BaseException:
        for path in moved:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        raise


def publish_directory(tmp: Path, target: Path, where: Path) -> None:
    """Put the finished temporary directory `tmp` (made in `where`, see `check_target`) in place as `target`:
    moved into an existing empty `target`, or renamed over it (an old `target` is moved aside first)."""
    if where == target:  # an existing empty directory: keep it, move the files in
        _move_into(tmp, target)
    elif target.exists():
        backup = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=where))
        os.rename(target, backup / "d")
        os.rename(tmp, target)
        shutil.rmtree(backup, ignore_errors=True)
    else:
        os.rename(tmp, target)
