"""Every third-party import is declared in pyproject.toml, and each scope imports only its extras.

The check is deptry (configured in ``[tool.deptry]``), run twice over the tree:

- once on the whole repository against every declared dependency (base and all extras): an
  import of a package that no part of the distribution declares fails (DEP001), and so does a
  declared package that nothing uses and that is not listed as used by other means (DEP002);
- once per scope of ``[tool.hwr.dependency-scopes]``, against the base dependencies plus that
  scope's extras only: the base package importing a test-only package, or the vLLM plugin
  importing a bench-only one, fails (DEP001, or DEP003 when the package happens to be installed
  through another one).

deptry reads imports statically, so a guarded optional import counts like any other: code that
imports an extra's package belongs to that extra's scope (see the comment in pyproject.toml).
The last two tests show that the check fails on a deliberately undeclared import.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
UNDECLARED = {"DEP001", "DEP003"}

TomlValue = str | Sequence[str] | Mapping[str, "TomlValue"]


def _toml_value(value: str | Sequence[str]) -> str:
    # JSON strings and arrays of strings are valid TOML basic strings and arrays.
    return json.dumps(value if isinstance(value, str) else list(value))


def _toml(tables: Mapping[str, Mapping[str, TomlValue]]) -> str:
    """A minimal TOML writer for tables of strings, string arrays and one level of sub-tables."""
    lines: list[str] = []
    for name, table in tables.items():
        lines.append(f"[{name}]")
        subtables = {k: v for k, v in table.items() if isinstance(v, Mapping)}
        lines += [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in table.items() if not isinstance(v, Mapping)]
        for sub, entries in subtables.items():
            lines.append(f"[{name}.{sub}]")
            lines += [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in entries.items()]
    return "\n".join(lines) + "\n"


def sibling_modules() -> list[str]:
    """Modules that benchmarks/ and tests/ import by bare name (their folder is on ``sys.path``).

    Derived from the files, so a new helper module needs no entry in pyproject.toml.
    """
    names = {p.stem for folder in ("benchmarks", "tests") for p in (ROOT / folder).rglob("*.py")}
    names |= {p.name for p in (ROOT / "tests").rglob("*") if p.is_dir() and (p / "__init__.py").exists()}
    return sorted(names)


def write_config(name: str, deps: Sequence[str], work: Path, *, exclude: Sequence[str] = (),
                 ignore: Sequence[str] = ()) -> Path:
    """A pyproject.toml with ``deps`` as its dependencies and this project's ``[tool.deptry]``."""
    deptry = dict(PYPROJECT["tool"]["deptry"])
    deptry["exclude"] = [*deptry.get("exclude", []), *exclude]
    deptry["known_first_party"] = [*deptry.get("known_first_party", []), *sibling_modules()]
    if ignore:
        deptry["ignore"] = list(ignore)
    path = work / f"pyproject-{name}.toml"
    path.write_text(_toml({
        "project": {"name": f"hwr-{name}", "version": "0", "dependencies": list(deps)},
        "tool.deptry": deptry,
    }))
    return path


def expand(requirements: Sequence[str]) -> list[str]:
    """``requirements`` with each self-reference (``hwr[worker]``: an extra that includes another)
    replaced by that extra's own requirements, since deptry would take ``hwr`` for a third party."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    out: list[str] = []
    for req in requirements:
        if req.startswith("hwr["):
            for name in req[len("hwr["):].rstrip("]").split(","):
                out += expand(extras[name.strip()])
        else:
            out.append(req)
    return list(dict.fromkeys(out))


def whole_config(work: Path) -> Path:
    """Every declared dependency, base and all extras (deptry's DEP002 needs them as one list)."""
    project = PYPROJECT["project"]
    deps = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        deps += extra
    return write_config("whole", expand(deps), work)


def scope_config(scope: str, work: Path) -> Path:
    """A pyproject.toml declaring only the base dependencies plus ``scope``'s extras."""
    spec = PYPROJECT["tool"]["hwr"]["dependency-scopes"][scope]
    project = PYPROJECT["project"]
    deps = list(project["dependencies"])
    for extra in spec["extras"]:
        deps += project["optional-dependencies"][extra]
    deps = expand(deps)
    # Within one scope, a dependency used only elsewhere is expected: unused ones are the
    # whole-tree run's business.
    return write_config(f"scope-{scope}", deps, work, exclude=spec.get("exclude", []), ignore=["DEP002"])


def deptry(roots: Sequence[str | Path], config: Path, work: Path) -> list[dict[str, object]]:
    """Run deptry on ``roots`` (relative to the repository root) and return its findings."""
    report = work / f"deptry-{len(list(work.iterdir()))}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "deptry", *map(str, roots), "--config", str(config), "--no-ansi",
         "--json-output", str(report)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    if not report.exists():
        pytest.fail(f"deptry did not run (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
    findings: list[dict[str, object]] = json.loads(report.read_text())
    # deptry exits 1 exactly when it found something; anything else is a crash.
    assert proc.returncode == (1 if findings else 0), proc.stdout + proc.stderr
    return findings


def describe(findings: Sequence[Mapping[str, object]]) -> str:
    return "\n".join(f"{f['location']['file']}:{f['location']['line']}: {f['error']['code']} {f['error']['message']}"  # type: ignore[index]
                     for f in findings)


def undeclared(findings: Sequence[Mapping[str, object]]) -> list[Mapping[str, object]]:
    return [f for f in findings if f["error"]["code"] in UNDECLARED]  # type: ignore[index]


def test_every_import_in_the_tree_is_declared(tmp_path: Path) -> None:
    findings = deptry(["."], whole_config(tmp_path), tmp_path)
    assert not findings, "undeclared or unused dependencies:\n" + describe(findings)


@pytest.mark.parametrize("scope", sorted(PYPROJECT["tool"]["hwr"]["dependency-scopes"]))
def test_each_scope_imports_only_the_base_and_its_extras(scope: str, tmp_path: Path) -> None:
    spec = PYPROJECT["tool"]["hwr"]["dependency-scopes"][scope]
    findings = deptry(spec["paths"], scope_config(scope, tmp_path), tmp_path)
    assert not findings, f"scope {scope!r} imports packages outside its extras {spec['extras']}:\n" + describe(findings)


def _module(tmp_path: Path, folder: str, source: str) -> Path:
    pkg = tmp_path / "src" / folder
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "leak.py").write_text(source)
    return pkg


def test_the_check_fails_on_an_import_nothing_declares(tmp_path: Path) -> None:
    pkg = _module(tmp_path, "client", "import torch\nimport yaml_not_declared_anywhere\n")
    # Only the module is scanned, so most declared packages are unused here: look at imports only.
    findings = undeclared(deptry([pkg], whole_config(tmp_path), tmp_path))
    assert [(f["error"]["code"], f["module"]) for f in findings] == [("DEP001", "yaml_not_declared_anywhere")]  # type: ignore[index]


def test_the_worker_scope_fails_on_a_test_extra_import(tmp_path: Path) -> None:
    # hypothesis is declared (test extra), so the whole-tree run accepts it; worker code may not use it.
    pkg = _module(tmp_path, "client", "import grpc\nimport torch\nfrom hypothesis import given\n")
    assert not undeclared(deptry([pkg], whole_config(tmp_path), tmp_path))
    findings = deptry([pkg], scope_config("worker", tmp_path), tmp_path)
    assert [f["module"] for f in findings] == ["hypothesis"]
    assert {f["error"]["code"] for f in findings} <= UNDECLARED  # type: ignore[index]


def test_the_base_scope_fails_on_torch(tmp_path: Path) -> None:
    # hwrd's install carries no torch: daemon code that imported it would fail on a node.
    pkg = _module(tmp_path, "daemon", "import grpc\nimport torch\n")
    findings = deptry([pkg], scope_config("base", tmp_path), tmp_path)
    assert [f["module"] for f in findings] == ["torch"]
    assert {f["error"]["code"] for f in findings} <= UNDECLARED  # type: ignore[index]
