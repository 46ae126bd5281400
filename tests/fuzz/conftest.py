"""Prints how many inputs each fuzz target was given (``hwr fuzz: <target>: N inputs``)."""

from __future__ import annotations

from .fuzzkit import COUNTS


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if not COUNTS:
        return
    terminalreporter.section("hwr fuzz suite")
    for target, n in sorted(COUNTS.items()):
        terminalreporter.write_line(f"hwr fuzz: {target}: {n} inputs, all answered with a value or a typed error")
