"""The daemon's rooms depend only downwards (``hwr.daemon.ROOMS``), checked on every import.

Every ``import``/``from ... import`` in every module under ``daemon/`` counts: top-level, lazy
(inside a function) and under ``TYPE_CHECKING`` alike, since a type-only import still ties the
rooms together for a reader.

Also here: no daemon module loads torch when it is imported (its module-level imports, followed
through every first-party module they reach); only the producer process's modules may.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hwr.daemon import ROOMS, SERVICE_FLOORS

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


# --- the transports never touch the store room -------------------------------------------------
#: The transports: they parse requests and encode the service room's results, nothing else.
TRANSPORTS = ("peer", "rpc")


def transport_store_imports(root: Path = DAEMON) -> list[str]:
    """Every import of the store room (``hwr.daemon.store``) in a transport module: top-level,
    lazy and ``TYPE_CHECKING`` ones alike. What a transport needs of a record (its type, its
    manifest) it takes from the service room (``hwr.daemon.service.catalog``)."""
    found: list[str] = []
    for room in TRANSPORTS:
        for path in sorted((root / room).rglob("*.py")):
            rel = path.relative_to(root)
            module = "hwr.daemon." + ".".join(rel.with_suffix("").parts)
            tree = ast.parse(path.read_text(), filename=str(path))
            for line, dotted in _imported_modules(tree, module, rel.name == "__init__.py"):
                if dotted == "hwr.daemon.store" or dotted.startswith("hwr.daemon.store."):
                    found.append(f"{rel}:{line}: the {room} transport imports the store room ({dotted})")
    return found


def test_the_transports_never_import_the_store_room() -> None:
    assert transport_store_imports() == []


@pytest.mark.parametrize(
    ("room", "source"),
    [
        ("peer", "from hwr.daemon.store.inspection import ArtifactRecord\n"),
        ("rpc", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hwr.daemon.store.root import Store\n"),
        ("rpc", "def f():\n    import hwr.daemon.store.records\n"),
        ("peer", "from hwr.daemon import store\n"),
    ],
)
def test_the_transport_check_catches_a_store_import(tmp_path: Path, room: str, source: str) -> None:
    for name in TRANSPORTS:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / room / "mod.py").write_text(source)
    found = transport_store_imports(tmp_path)
    assert len(found) == 1 and f"{room}/mod.py" in found[0] and "imports the store room" in found[0], found


# --- one reader of the store -----------------------------------------------------------------------
#: ``Store``'s record reads (``hwr.daemon.store.root`` and its record cache ``store.records``):
#: every way to get a record, a key's deny state, the list of keys or records, descriptors of a
#: record's payloads, and the record cache itself. Not reads of records, so not here: usage
#: accounting (``store.usage``, ``rescan_usage``: capacity's), publication (``store.installer``),
#: the operator's commands (``verify``, ``deny``, ``allow``), ``is_volatile`` and the lifecycle.
RECORD_READS = frozenset({
    "lookup", "cached", "listed", "absent_now", "open_payloads", "artifacts", "known_keys",
    "denied_records", "deny_reason", "is_denied", "take_added", "records",
})
#: The rooms above the store; in them only the read API reads ``Store``'s records.
READER_ROOMS = ("service", "producers", "fleet", "peer", "rpc", "app")
THE_READER = "service/catalog.py"


def _names_a_store(node: ast.expr) -> bool:
    """``store``, ``self.store``, ``self._store``, ``self.c.store``: a name that says Store."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return "store" in name.lower() and not name.lower().startswith(("store_io", "remote"))


def store_record_reads(root: Path = DAEMON) -> list[str]:
    """``<something named store>.<a record read>`` (called or passed) in a module above the
    store room other than the read API's (``hwr.daemon.service.catalog``)."""
    found: list[str] = []
    for room in READER_ROOMS:
        for path in sorted((root / room).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel == THE_READER:
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr in RECORD_READS and _names_a_store(node.value):
                    found.append(f"{rel}:{node.lineno}: reads the store's records ({ast.unparse(node)}); "
                                 "go through the read API (hwr.daemon.service.catalog)")
    return found


def test_only_the_read_api_reads_the_stores_records() -> None:
    assert store_record_reads() == []


@pytest.mark.parametrize(
    ("room", "source", "expected"),
    [
        ("fleet", "def f(self):\n    return self.store.lookup(self.key)\n", "self.store.lookup"),
        ("rpc", "async def f(self):\n    return await asyncio.to_thread(self.c.store.artifacts)\n",
         "self.c.store.artifacts"),
        ("service", "def f(store_service, key):\n    return store_service.lookup_now and store_service.cached(key)\n",
         "store_service.cached"),
        ("app", "def f(self):\n    return self._store.records\n", "self._store.records"),
    ],
)
def test_the_reader_check_catches_a_direct_read(tmp_path: Path, room: str, source: str, expected: str) -> None:
    for name in READER_ROOMS:
        (tmp_path / name).mkdir()
    (tmp_path / "service" / "catalog.py").write_text("def f(self):\n    return self._store.lookup('k')\n")
    (tmp_path / room / "mod.py").write_text(source)
    found = store_record_reads(tmp_path)
    assert len(found) == 1 and f"{room}/mod.py" in found[0] and expected in found[0], found


# --- torch stays out of hwrd ----------------------------------------------------------------------
#: The producer process's own modules (``python -m hwr.daemon.producers.worker``): they import torch.
WORKER_SIDE = frozenset({"hwr.daemon.producers.worker", "hwr.daemon.producers.blocks"})
#: Where each first-party package lives in the repository (``[tool.setuptools.package-dir]``).
PACKAGE_DIRS = {"hwr.client": "client", "hwr.daemon": "daemon", "hwr.dlo_backend": "dlo_backend",
                "hwr.protos": "protos", "hwr": "hwr"}


def _source_of(dotted: str, repo: Path) -> Path | None:
    """The file of a first-party module (``X.py`` or ``X/__init__.py``), None for anything else."""
    for package, folder in PACKAGE_DIRS.items():
        if dotted == package or dotted.startswith(package + "."):
            base = repo / folder / Path(*dotted[len(package) + 1:].split(".")) if dotted != package else repo / folder
            for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                if candidate.is_file():
                    return candidate
            return None
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _eager_imports(body: list[ast.stmt], module: str, is_package: bool) -> list[str]:
    """What a module imports when it is imported: its module-level statements (inside ``if``,
    ``try`` and ``with`` blocks too), not the bodies of functions nor ``if TYPE_CHECKING:``."""
    found: list[str] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found += [dotted for _line, dotted in _imported_modules(node, module, is_package)]
            if isinstance(node, ast.ImportFrom):  # ``from a.b import c``: a.b runs even when c is a name
                found += [dotted.rsplit(".", 1)[0] for _line, dotted in _imported_modules(node, module, is_package)]
        elif isinstance(node, ast.If):
            found += _eager_imports(node.orelse if _is_type_checking(node.test) else node.body + node.orelse,
                                    module, is_package)
        elif isinstance(node, ast.Try):
            found += _eager_imports(node.body + node.orelse + node.finalbody
                                    + [s for h in node.handlers for s in h.body], module, is_package)
        elif isinstance(node, ast.With):
            found += _eager_imports(node.body, module, is_package)
    return found


def eager_torch_imports(repo: Path) -> list[str]:
    """Each daemon module (the worker's side excepted) whose import loads torch, with the chain
    of module-level imports that leads there. Lazy imports (inside functions) are not followed:
    tests/e2e/test_daemon_without_torch.py runs every operation of a real hwrd for those."""
    cache: dict[str, list[str]] = {}

    def imports_of(dotted: str) -> list[str]:
        if dotted not in cache:
            path = _source_of(dotted, repo)
            if path is None:
                cache[dotted] = []
            else:
                tree = ast.parse(path.read_text(), filename=str(path))
                names = _eager_imports(tree.body, dotted, path.name == "__init__.py")
                parts = dotted.split(".")  # importing a.b.c runs a and a.b first
                cache[dotted] = [".".join(parts[:i]) for i in range(1, len(parts))] + names
        return cache[dotted]

    found = []
    for path in sorted((repo / "daemon").rglob("*.py")):
        rel = path.relative_to(repo / "daemon").with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        start = ".".join(("hwr", "daemon", *parts))
        if start in WORKER_SIDE:
            continue
        chains, seen = [[start]], {start}
        while chains:
            chain = chains.pop()
            for name in imports_of(chain[-1]):
                if name.split(".")[0] == "torch":
                    found.append(" -> ".join([*chain, name]))
                elif name not in seen:
                    seen.add(name)
                    chains.append([*chain, name])
    return found


def test_no_daemon_module_imports_torch_when_it_is_imported() -> None:
    assert eager_torch_imports(DAEMON.parent) == []


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"daemon/store/mod.py": "import torch\n"}, "hwr.daemon.store.mod -> torch"),
        ({"daemon/store/mod.py": "try:\n    from torch import nn\nexcept ImportError:\n    pass\n"},
         "hwr.daemon.store.mod -> torch"),
        ({"daemon/rpc/mod.py": "from hwr.client.lease import Lease\n", "client/lease.py": "import torch\n"},
         "hwr.daemon.rpc.mod -> hwr.client.lease -> torch"),
        ({"daemon/producers/__init__.py": "from hwr.daemon.producers.blocks import SourceReader\n",
          "daemon/producers/blocks.py": "import torch\n"}, "hwr.daemon.producers -> hwr.daemon.producers.blocks"),
    ],
)
def test_the_torch_check_follows_module_level_imports(tmp_path: Path, files: dict[str, str], expected: str) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = eager_torch_imports(tmp_path)
    assert found and all(expected in chain for chain in found), found


def test_the_torch_check_skips_lazy_and_type_only_imports(tmp_path: Path) -> None:
    (tmp_path / "daemon" / "store").mkdir(parents=True)
    (tmp_path / "daemon" / "store" / "mod.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
        "def f():\n    import torch\n")
    assert eager_torch_imports(tmp_path) == []


# --- the service room's inner floors ---------------------------------------------------------------
def _service_imports(root: Path) -> dict[str, list[tuple[int, str]]]:
    """Each module of ``<root>/service`` -> ``(line, service module)`` it imports (any kind)."""
    found: dict[str, list[tuple[int, str]]] = {}
    for path in sorted((root / "service").glob("*.py")):
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        targets = []
        for line, dotted in _imported_modules(tree, f"hwr.daemon.service.{path.stem}", False):
            parts = dotted.split(".")
            if parts[:3] == ["hwr", "daemon", "service"] and len(parts) > 3 and parts[3] != path.stem:
                targets.append((line, parts[3]))
        found[path.stem] = targets
    return found


def floor_violations(root: Path = DAEMON,
                     floors: tuple[tuple[str, tuple[str, ...]], ...] = SERVICE_FLOORS) -> list[str]:
    """Every service module on no floor (or two), every import of a floor above the importer's,
    and every circle of imports between service modules (top-level, lazy and type-only alike)."""
    level = {}
    found: list[str] = []
    for rank, (_floor, modules) in enumerate(floors):
        for module in modules:
            if module in level:
                found.append(f"service/{module}.py: on two floors")
            level[module] = rank
    imports = _service_imports(root)
    name = {rank: floor for rank, (floor, _m) in enumerate(floors)}
    for module, targets in imports.items():
        if module not in level:
            found.append(f"service/{module}.py: on no floor of hwr.daemon.SERVICE_FLOORS")
            continue
        for line, target in targets:
            if target in level and level[target] > level[module]:
                found.append(f"service/{module}.py:{line}: the {name[level[module]]} floor imports upwards "
                             f"from the {name[level[target]]} floor ({target})")
    # Circles: a depth-first walk over the import graph; each circle reported once.
    state: dict[str, int] = {}
    stack: list[str] = []
    seen_cycles: set[frozenset[str]] = set()

    def walk(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for _line, target in imports.get(module, []):
            if state.get(target) == 1:
                cycle = stack[stack.index(target):]
                if frozenset(cycle) not in seen_cycles:
                    seen_cycles.add(frozenset(cycle))
                    found.append("service imports in a circle: " + " -> ".join([*cycle, target]))
            elif target in imports and not state.get(target):
                walk(target)
        stack.pop()
        state[module] = 2

    for module in sorted(imports):
        if not state.get(module):
            walk(module)
    return found


def test_the_service_room_imports_only_down_its_floors() -> None:
    assert floor_violations() == []


TOY_FLOORS = (("bottom", ("reader",)), ("middle", ("leasing",)), ("top", ("publishing",)))


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"reader": "from hwr.daemon.service.leasing import Leasing\n"},
         "service/reader.py:1: the bottom floor imports upwards from the middle floor (leasing)"),
        ({"leasing": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from hwr.daemon.service.publishing import Publishing\n"},
         "service/leasing.py:3: the middle floor imports upwards from the top floor (publishing)"),
        ({"reader": "def f():\n    from hwr.daemon.service import publishing\n"},
         "the bottom floor imports upwards from the top floor (publishing)"),
        ({"stray": ""}, "service/stray.py: on no floor"),
    ],
)
def test_the_floor_check_catches_an_import_up_the_floors(tmp_path: Path, files: dict[str, str],
                                                         expected: str) -> None:
    (tmp_path / "service").mkdir()
    for module in ("reader", "leasing", "publishing"):
        (tmp_path / "service" / f"{module}.py").write_text("")
    for module, text in files.items():
        (tmp_path / "service" / f"{module}.py").write_text(text)
    found = floor_violations(tmp_path, TOY_FLOORS)
    assert len(found) >= 1 and any(expected in f for f in found), found


def test_the_floor_check_catches_a_circle_on_one_floor(tmp_path: Path) -> None:
    (tmp_path / "service").mkdir()
    (tmp_path / "service" / "reader.py").write_text("from hwr.daemon.service.marks import M\n")
    (tmp_path / "service" / "marks.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hwr.daemon.service.reader import R\n")
    found = floor_violations(tmp_path, (("bottom", ("reader", "marks")),))
    assert found == ["service imports in a circle: marks -> reader -> marks"], found
