"""Every third-party module the library imports is declared in pyproject.toml (a requirement or an extra)."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _name(requirement: str) -> str:
    """The normalised distribution name of a requirement string (`"PyYAML>=5.1"` -> `"pyyaml"`)."""
    return re.sub(r"[-_.]+", "-", re.match(r"\s*([A-Za-z0-9_.\-]+)", requirement).group(1)).lower()


def _imported_modules(package: Path) -> set[str]:
    """Top-level names of the absolute imports in every module of `package` (the standard library excluded)."""
    names = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"__future__", package.name}


# Distributions whose import name differs from their name, for an optional one that is not installed here (an
# installed one is looked up in its own metadata).
IMPORT_NAMES = {"llama_cpp": "llama-cpp-python", "yaml": "pyyaml", "sklearn": "scikit-learn", "PIL": "pillow"}


def test_every_third_party_import_is_declared():
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    declared = {_name(r) for r in project["dependencies"]}
    declared |= {_name(r) for reqs in project["optional-dependencies"].values() for r in reqs}
    dists = md.packages_distributions()
    imported = _imported_modules(ROOT / "optimum_prune")
    assert {"torch", "psutil", "yaml"} <= imported  # the scan sees the imports (psutil: evaluation/speed.py)
    dist_of = {m: dists.get(m, [IMPORT_NAMES.get(m, m)]) for m in imported}
    missing = {m: d for m, d in dist_of.items() if not {_name(x) for x in d} & declared}
    assert not missing, f"imported but not declared in pyproject.toml (a requirement or an extra): {missing}"
