"""Old public names kept for one release: reading one warns (`FutureWarning`, shown to users by default) with the
name that replaces it."""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["warn_deprecated", "deprecated_getattr", "renamed"]


def warn_deprecated(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that `old` is deprecated and will be removed in the next release; `new` says what to use instead."""
    warnings.warn(
        f"`{old}` is deprecated and will be removed in the next release of optimum_prune; use {new}.",
        FutureWarning,
        stacklevel=stacklevel,
    )


def deprecated_getattr(module: str, namespace: dict[str, Any], renamed: dict[str, tuple[str, str]]):
    """A module `__getattr__` (PEP 562) serving the old names of `renamed` (`old -> (attribute, advice)`): the
    module's attribute `attribute`, with a warning whose advice names the new spelling."""

    def __getattr__(name: str) -> Any:
        if name in renamed:
            attribute, advice = renamed[name]
            warn_deprecated(f"{module}.{name}", advice)
            return namespace[attribute]
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


def renamed(module: str, **names: str) -> dict[str, tuple[str, str]]:
    """`renamed` entries for plain renames inside `module`: `old=new` gives `new`, advised as `module.new`."""
    return {old: (new, f"`{module}.{new}`") for old, new in names.items()}
