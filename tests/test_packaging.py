"""Every Python package folder is listed in pyproject.toml (a non-editable install would miss it)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_declared() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared = set(config["packages"])
    mapping = {folder: name for name, folder in config["package-dir"].items()}
    found = set()
    for folder, name in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            found.add(".".join((name, *init.parent.relative_to(ROOT / folder).parts)))
    assert found, "no packages found: the mapping is wrong"
    assert found <= declared, f"undeclared packages: {sorted(found - declared)}"
