"""The import contracts of pyproject.toml cover the code they are about (`make quality` runs them: lint-imports)."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_independence_contract_lists_every_method():
    """A new method subpackage joins the contract that keeps methods from importing one another."""
    text = (REPO / "pyproject.toml").read_text("utf-8")
    (contract,) = re.findall(r'type = "independence"\n(?:#.*\n)*modules = \[(.*?)\]', text, re.S)
    listed = set(re.findall(r'"([\w.]+)"', contract))
    methods = REPO / "optimum_prune" / "methods"
    packages = {f"optimum_prune.methods.{p.parent.name}" for p in methods.glob("*/__init__.py")}
    assert packages and listed == packages
