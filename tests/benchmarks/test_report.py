"""benchmarks/report.py: BENCHMARKS.md rendered from a real run_all output folder (no speed asserted)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import report  # noqa: E402
import summary  # noqa: E402


@pytest.fixture(scope="module")
def run_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two fast sections of a real ``run_all.py`` run (the CPU offload copy and the idle penalty)."""
    out = tmp_path_factory.mktemp("bench-out")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "run_all.py"), "--only", "gpu_dlo,idle_penalty",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.mark.timeout(320)
def test_the_report_renders_the_run_header_summary_and_every_section(run_out: Path) -> None:
    results = json.loads((run_out / "results.json").read_text())
    # A section run into the same folder by hand, with no prose in the template: rendered generically.
    (run_out / "newbench.md").write_text("## newbench\n\n`newbench.py --x 1` (1.0 s, rc 0)\n\n"
                                         "| a | b |\n| --- | --- |\n| 1 | 2 |\n")
    text = report.render(run_out, report.parse_template(report.TEMPLATE.read_text()))
    assert f"**Date:** {results['date']} (UTC), commit {results['commit']}" in text
    assert "benchmarks/run_all.py --only gpu_dlo,idle_penalty" in text
    assert str(REPO) + "/" not in text  # commands are relative to the checkout
    assert "## Layerwise offload copy (CPU)" in text and "## The machine's idle penalty" in text
    assert "## newbench (`benchmarks/newbench.py`)" in text and "| 1 | 2 |" in text
    assert "--json-out" not in text
    assert "Sections described in the template but not in this run: peers, warm_start" in text
    # the summary row comes from this run's JSON: the copy rate it printed
    dlo = results["sections"]["gpu_dlo"]["result"]
    row = next(line for line in text.splitlines() if line.startswith("| layerwise offload block copy"))
    assert f"{dlo['direct_gbps']:.2f} GB/s" in row and f"memcpy {dlo['direct_reference_gbps']:.2f} GB/s" in row
    assert "(#layerwise-offload-copy-cpu)" in row
    # every table of the section's markdown made it, headings demoted under the section's own
    for line in (run_out / "idle_penalty.md").read_text().splitlines():
        if line.startswith("|"):
            assert line in text
    assert not re.search(r"^#{1,3} Idle penalty", text, re.MULTILINE)


@pytest.mark.timeout(320)
def test_output_file_and_a_missing_folder(run_out: Path, tmp_path: Path) -> None:
    target = tmp_path / "BENCHMARKS.md"
    assert report.main([str(run_out), "-o", str(target)]) == 0
    assert target.read_text().startswith("# Benchmarks\n")
    with pytest.raises(SystemExit):
        report.main([str(tmp_path / "nothing-here")])


def test_summary_rows_only_from_what_the_run_produced() -> None:
    ok = {"clients": 4, "ops_per_s": 1234.5, "all_ms": {"p99": 12.0}}
    rows = summary.summary_rows({"sections": {
        "load": {"rc": 0, "result": ok},
        "soak": {"rc": 1, "result": {"clean": True}},  # failed section: no row
        "churn": {"rc": 0, "result": {"clients": 4}},  # the JSON lacks fields: a row says so
    }})
    cells = [r.cells() for r in rows]
    assert cells[0][:2] == ["churn: no summary row (KeyError: 'goal'; see its tables)", "-"]
    assert cells[1][1] == "1,234 ops/s, p99 12.0 ms" and cells[1][5] == "load"
    assert len(rows) == 2


def test_template_errors_are_reported() -> None:
    with pytest.raises(ValueError, match="heading"):
        report.parse_template("<!-- section x -->\nno heading here\n")
    with pytest.raises(ValueError, match="outside a section"):
        report.parse_template("<!-- intro -->\n# T\n<!-- latest -->\n")
    t = report.parse_template("ignored\n<!-- intro -->\n# T\n\nhi\n<!-- section a -->\n## A\nwhat\n"
                              "<!-- latest -->\nread\n")
    assert t.intro == "# T\n\nhi" and t.sections["a"] == report.Section("## A", "what", "read")


def test_a_plot_is_linked_only_when_the_run_drew_it(tmp_path: Path) -> None:
    prose = "before\n![Latency](benchmarks/churn_latency.png)\nafter"
    assert report.plots(prose, tmp_path) == "before\n(no plot in this run: churn_latency.png was not drawn)\nafter"
    (tmp_path / "churn_latency.png").write_bytes(b"\x89PNG")
    assert report.plots(prose, tmp_path) == prose
