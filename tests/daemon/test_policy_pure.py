"""``hwr.daemon.policy`` is pure (``hwr.daemon``'s room list): no module there imports the event
loop, threads, processes or the filesystem; stateful objects built on its decisions live in the
service room."""

from __future__ import annotations

import ast
from pathlib import Path

import hwr.daemon.policy

IMPURE = {"asyncio", "threading", "concurrent", "multiprocessing", "subprocess", "os", "socket", "shutil"}


def test_policy_modules_import_nothing_impure() -> None:
    root = Path(hwr.daemon.policy.__file__).parent
    found = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [(path.name, n) for n in names if n.split(".")[0] in IMPURE]
    assert found == []
