"""Prints how many inputs each fuzz target was given and how many failed their checks
(``hwr fuzz: <target>: N inputs, F failed``; "all answered ..." only when none failed)."""

from __future__ import annotations

from .fuzzkit import COUNTS


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if not COUNTS:
        return
    terminalreporter.section("hwr fuzz suite")
    for target, (passed, failed) in sorted(COUNTS.items()):
        verdict = f"{failed} failed" if failed else "0 failed, all answered with a value or a typed error"
        terminalreporter.write_line(f"hwr fuzz: {target}: {passed + failed} inputs, {verdict}")
