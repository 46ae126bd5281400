"""The daemon's rooms depend only downwards (``hwr.daemon.ROOMS``), checked on every import.

Every ``import``/``from ... import`` in every module under ``daemon/`` counts: top-level, lazy
(inside a function) and under ``TYPE_CHECKING`` alike, since a type-only import still ties the
rooms together for a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hwr.daemon import ROOMS

DAEMON = Path(__file__).resolve().parents[2] / "daemon"
RANK = {room: rank for rank, siblings in enumerate(ROOMS) for room in siblings}


def _imported_modules(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of everything a module imports, relative imports resolved."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # ``from hwr.daemon import store`` imports a room: name it by its members too.
            found += [(node.lineno, f"{prefix}.{alias.name}") for alias in node.names]
    return found


def _room_of(dotted: str) -> str | None:
    parts = dotted.split(".")
    if parts[:2] != ["hwr", "daemon"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in RANK else "?" + parts[2]


def violations(root: Path = DAEMON) -> list[str]:
    """Every import that goes up or sideways between rooms, or into a module outside the rooms."""
    found: list[str] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if len(rel.parts) == 1:
            if rel.name != "__init__.py":
                found.append(f"{rel}: a module outside the rooms (put it in one of {sorted(RANK)})")
            continue
        room = rel.parts[0]
        if room not in RANK:
            found.append(f"{rel}: {room!r} is not a room listed in hwr.daemon.ROOMS")
            continue
        module = "hwr.daemon." + ".".join(rel.with_suffix("").parts)
        if rel.name == "__init__.py":
            module = module.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, dotted in _imported_modules(tree, module, rel.name == "__init__.py"):
            target = _room_of(dotted)
            if target is None or target == room:
                continue
            if target.startswith("?"):
                found.append(f"{rel}:{line}: imports {dotted}, which is in no room")
            elif room == "ctl":
                found.append(f"{rel}:{line}: hwrctl imports the daemon's {target} room ({dotted})")
            elif RANK[target] >= RANK[room]:
                way = "sideways" if RANK[target] == RANK[room] else "upwards"
                found.append(f"{rel}:{line}: {room} imports {way} from {target} ({dotted})")
    return found


def test_every_import_in_the_daemon_goes_down_the_rooms() -> None:
    assert violations() == []


def test_the_contract_packages_never_import_the_daemon() -> None:
    repo = DAEMON.parent
    found = []
    for package in ("client", "dlo_backend", "protos"):
        for path in sorted((repo / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for line, dotted in _imported_modules(tree, "x", False):
                if dotted.startswith("hwr.daemon"):
                    found.append(f"{path.relative_to(repo)}:{line}: {dotted}")
    assert found == []


@pytest.mark.parametrize(
    ("room", "source", "expected"),
    [
        ("service", "from hwr.daemon.app.server import Daemon\n", "service imports upwards from app"),
        ("peer", "def f():\n    from hwr.daemon.rpc import servicer\n", "peer imports sideways from rpc"),
        ("store", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hwr.daemon.service import x\n",
         "store imports upwards from service"),
        ("ctl", "from hwr.daemon.store import root\n", "hwrctl imports the daemon's store room"),
        ("policy", "from hwr.daemon.nowhere import x\n", "which is in no room"),
    ],
)
def test_the_check_catches_an_import_against_the_direction(tmp_path: Path, room: str, source: str,
                                                           expected: str) -> None:
    (tmp_path / room).mkdir()
    (tmp_path / room / "__init__.py").write_text("")
    (tmp_path / room / "mod.py").write_text(source)
    found = violations(tmp_path)
    assert len(found) == 1 and expected in found[0], found


def test_the_check_catches_a_module_outside_the_rooms(tmp_path: Path) -> None:
    (tmp_path / "stray.py").write_text("")
    assert violations(tmp_path) == ["stray.py: a module outside the rooms (put it in one of "
                                    f"{sorted(RANK)})"]


def test_every_room_is_a_package_in_the_distribution() -> None:
    import tomllib

    pyproject = tomllib.loads((DAEMON.parent / "pyproject.toml").read_text())
    packages = set(pyproject["tool"]["setuptools"]["packages"])
    assert {f"hwr.daemon.{room}" for room in RANK} <= packages
    assert {p.name for p in DAEMON.iterdir() if (p / "__init__.py").exists()} == set(RANK)
