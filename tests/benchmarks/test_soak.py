"""benchmarks/soak.py for 4 s (half its ``--quick`` size; a few hundred evictions and publications
on 2 cores): it runs every scenario and finds the end state clean."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_quick_soak_runs_every_scenario_and_ends_clean(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "soak.py"), "--seconds", "4",
                           "--json-out", str(out)], capture_output=True, text=True, timeout=200, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["clean"] and result["unexpected"] == []
    # every scenario did real work: publications evicted, leases were checked, the operator acted
    assert result["evictions"] > 0
    assert result["ok"].get("publish", 0) > 0 and result["ok"].get("publish_fresh", 0) > 0
    assert result["ok"].get("acquire", 0) + result["ok"].get("acquire_fresh", 0) > 0
    assert sum(result["ok"].get(op, 0) for op in ("gc", "ls", "usage")) > 0
    assert result["end_state"]["deny_markers"] == 0 and result["end_state"]["leases_left"] == 0
