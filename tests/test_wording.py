"""The repository speaks of the product, not of how it was built: no work-diary wording.

Docs, code, docstrings, comments, test names and script output must not say which work period
or ticket a thing came from (that history lives in git). The check scans every file git tracks,
plus untracked files that are not ignored (so a new file is caught before its commit), for the
patterns in ``DIARY`` (case-insensitive) and fails with ``file:line: text`` for each hit.

A comment that explains why may cite a public upstream issue by its URL: a line holding a
``github.com/<owner>/<repo>/issues/<n>`` (or ``/pull/<n>``) link is allowed. Anything else that
must stay goes in ``ALLOWED`` as an exact (path, line text) pair, kept tiny and explicit.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

DIARY = re.compile(r"session\s+#?[0-9]|this\s+session|issues?\s+#?[0-9]", re.IGNORECASE)
UPSTREAM_LINK = re.compile(r"github\.com/[\w.-]+/[\w.-]+/(issues|pull)/[0-9]+")
# (path relative to the repository root, the exact stripped line): reviewed exceptions.
ALLOWED: frozenset[tuple[str, str]] = frozenset()


def diary_hits(files: Iterable[tuple[str, str]]) -> list[str]:
    """``path:line: text`` for every line of ``(path, text)`` pairs that reads like a work diary."""
    hits = []
    for path, text in files:
        for number, line in enumerate(text.splitlines(), 1):
            if not DIARY.search(line) or UPSTREAM_LINK.search(line) or (path, line.strip()) in ALLOWED:
                continue
            hits.append(f"{path}:{number}: {line.strip()[:160]}")
    return hits


def repository_files() -> list[tuple[str, str]]:
    """(path, text) of every tracked or untracked-but-not-ignored text file of the checkout."""
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True).stdout
    files = []
    for name in sorted(set(out.decode().split("\0")) - {""}):
        path = ROOT / name
        if not path.is_file():  # deleted in the working tree, or a submodule
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # binary (a plot)
            continue
        files.append((name, data.decode("utf-8", errors="replace")))
    return files


def test_the_check_flags_diary_wording_and_allows_upstream_links() -> None:
    # The planted phrases are split in two literals so that this file itself stays clean.
    files = [("a.md", "fine\nAs measured in Session" " 3, it is fast.\n"),
             ("b.py", "# this  " "session's fix\nx = 1  # see issue" " #12\n"),
             ("c.py", "# vLLM bug: https://github.com/vllm-project/vllm/issues/12345 (issue" " 12345 upstream)\n"),
             ("d.py", "def session_3_ok(): ...  # a session's lease; an issue with the disk\n")]
    assert diary_hits(files) == ["a.md:2: As measured in Session" " 3, it is fast.",
                                 "b.py:1: # this  " "session's fix", "b.py:2: x = 1  # see issue" " #12"]


def test_repository_has_no_work_diary_wording() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing to list")
    files = repository_files()
    assert any(name == "tests/test_wording.py" for name, _ in files)  # the listing reaches this file
    hits = diary_hits(files)
    assert not hits, ("work-diary wording (say what the product does or what was measured; history lives "
                      "in git):\n" + "\n".join(hits))


#: A document a module names: ``ARCHITECTURE.md``, ``benchmarks/report_template.md`` (a word
#: ending in ``.md``; the path is read from the repository root, or from the module's folder).
DOC_NAME = re.compile(r"(?<![\w./-])([\w-]+(?:/[\w.-]+)*\.md)\b")
#: The product's packages and scripts, whose docstrings and comments speak to users (tests build
#: throwaway reports with invented names, so they are not scanned).
PRODUCT_DIRS = ("client", "daemon", "dlo_backend", "hwr", "protos", "benchmarks", "scripts")


def missing_documents(files: Iterable[tuple[str, str]], exists: Callable[[str], bool]) -> list[str]:
    """``path:line: name`` for every ``.md`` a product file names that is not in the repository."""
    hits = []
    for path, text in files:
        if not path.startswith(tuple(d + "/" for d in PRODUCT_DIRS)):
            continue
        folder = path.rsplit("/", 1)[0]
        for number, line in enumerate(text.splitlines(), 1):
            for name in DOC_NAME.findall(line):
                if not (exists(name) or exists(f"{folder}/{name}")):
                    hits.append(f"{path}:{number}: {name}")
    return hits


def test_the_document_check_flags_a_file_outside_the_repository() -> None:
    present = {"ARCHITECTURE.md", "benchmarks/report_template.md"}
    files = [("daemon/x.py", '"""As fixed in ARCHITECTURE.md and DESIGN.md."""\n'),
             ("benchmarks/r.py", 'TEMPLATE = HERE / "report_template.md"\n'),
             ("tests/t.py", "# writes scaling.md\n")]
    assert missing_documents(files, present.__contains__) == ["daemon/x.py:1: DESIGN.md"]


def test_every_document_a_module_names_is_in_the_repository() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing to list")
    hits = missing_documents(repository_files(), lambda name: (ROOT / name).is_file())
    assert not hits, "a module names a document the repository does not hold:\n" + "\n".join(hits)
