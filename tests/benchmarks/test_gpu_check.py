"""benchmarks/gpu_check.py: its dry run (CPU, tiny sizes) walks every section, and its helpers.

The GPU run itself needs a CUDA machine; these tests keep its control flow from rotting: the
dry run starts a real hwrd, runs every section's code path on the CPU device and writes the
same report, and the trace analysis is checked on a trace in torch.profiler's format.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_check_sections  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_the_dry_run_walks_every_section_and_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["dry_run"] and report["lease_source"] == "hwrd"
    sections = report["sections"]
    assert list(sections) == ["matrix", "race", "registration", "gpu_dlo", "allgather"]
    cases = sections["matrix"]["cases"]
    assert len(cases) == 8 and {c["stream"] for c in cases} == {"default", "side"}
    assert all(c["ok"] and len(c["outputs_equal"]) == 3 for c in cases)
    assert {c["case"] for c in cases} == {"module-pinned", "module-unpinned", "lease-staged", "lease-registered"}
    assert all(sections["race"][name]["passed"] == 2 for name in ("compute_bound", "copy_bound"))
    assert sections["registration"]["ok"] is None and sections["registration"]["declined_without_cuda"]
    assert sections["gpu_dlo"]["gpu_dlo"]["result"]["outputs_equal"] is True
    assert Path(sections["gpu_dlo"]["profile"]["trace"]).is_file()
    runs = sections["allgather"]["runs"]
    assert [r["source"] for r in runs] == ["module", "lease"] and all(r["mode"] == "allgather" for r in runs)
    assert json.loads(proc.stdout.strip().splitlines()[-1])["status"] == 0


def _event(cat: str, name: str, stream: int, ts: float, dur: float) -> dict[str, object]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_the_trace_analysis_measures_h2d_overlapping_compute_on_other_streams(tmp_path: Path) -> None:
    events = [
        _event("kernel", "gemm", 7, 0, 100),
        _event("kernel", "gelu", 7, 150, 50),
        _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 20, 50, 120),  # overlaps 50 + 20
        _event("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 20, 300, 10),  # overlaps nothing
        _event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 7, 0, 10),  # not H2D
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    got = gpu_check_sections._analyze_trace(path)
    assert got["h2d_copies"] == 2 and got["h2d_pinned"] == 1 and got["h2d_pageable"] == 1
    assert got["copy_only_streams"] == ["20"] and got["compute_streams"] == ["7"]
    assert got["h2d_overlapping_compute_us"] == 70.0 and got["h2d_total_us"] == 130.0


def test_a_checkout_without_an_installed_hwr_is_mapped_onto_the_namespace(tmp_path: Path) -> None:
    # Drop the editable install's finder: hwr then imports only through gpu_check's mapping.
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in str(f)]
        sys.path.insert(0, {str(REPO / "benchmarks")!r})
        import gpu_check
        print(gpu_check.ensure_hwr(Path({str(tmp_path)!r})))
        import hwr.dlo_backend.backend as backend
        print(backend.__file__)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    how, where = proc.stdout.split("\n")[:2]
    assert how.startswith("checkout mapped at") and where.startswith(str(tmp_path / "import-shim" / "hwr"))
