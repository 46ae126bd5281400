"""benchmarks/run_all.py and benchmarks/scaling.py: the harness, on tiny sizes (no speed asserted)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import run_all  # noqa: E402

from .helpers import exits_within  # noqa: E402


def test_sections_cover_every_benchmark_and_scale_with_the_size(tmp_path: Path) -> None:
    small, big = run_all.sections(64, True, tmp_path), run_all.sections(1024, False, tmp_path)
    scripts = {p.name for p in (REPO / "benchmarks").glob("*.py")}
    covered = {Path(argv[0]).name for argv in small.values() if argv[0].endswith(".py")}
    # every benchmark script except the harness itself, its helpers (the S3 servers remote.py
    # starts among them), the report, the GPU-only serve run and check, and the two that run on their
    # own (BENCHMARKS.md gives their commands): peer_fill.py needs root, network namespaces and the
    # peers extra; vllm_omni_warm.py's interleaved sizes take about 25 minutes on 2 cores
    assert scripts - covered == {"run_all.py", "common.py", "report.py", "summary.py", "s3_servers.py",
                                 "gpu_vllm_serve.py", "gpu_check.py", "gpu_check_cases.py", "gpu_check_sections.py",
                                 "peer_fill.py", "vllm_omni_warm.py"}
    assert small["demo"][:2] == ["-m", "hwr.demo"]
    assert "--size-mib" in small["peers"] and small["peers"][small["peers"].index("--size-mib") + 1] == "64"
    assert big["scaling"][big["scaling"].index("--size-mib") + 1] == "1024"
    assert big["warm_start"][big["warm_start"].index("--size-gib") + 1] == "1"
    assert big["scaling"][big["scaling"].index("--workers") + 1] == "1,2,4,8"
    # churn paces at a fraction of the capacity it measured, and draws latency under load
    assert big["churn"][big["churn"].index("--rate-of-capacity") + 1] == "0.7" and "--rate" not in big["churn"]
    assert big["churn"][big["churn"].index("--png") + 1] == str(tmp_path / "churn_latency.png")


def test_markdown_and_json_extraction() -> None:
    text = ("noise\n## Title\n\n| a | b |\n| --- | --- |\n| 1 | 2 |\nmore noise\nGoal x: met\n"
            "Closed loop, 8 clients: p99 2 ms\n{\"k\": 1}\n")
    md = run_all.markdown_of(text)
    assert "| 1 | 2 |" in md and "## Title" in md and "Goal x: met" in md and "noise" not in md
    assert "Closed loop, 8 clients: p99 2 ms" in md
    assert run_all.last_json(text) == {"k": 1}
    assert run_all.last_json("no json here\n{broken") is None


@pytest.mark.timeout(240)
def test_scaling_section_end_to_end(tmp_path: Path) -> None:
    """run_all's section runner on scaling.py: a real hwrd, real worker processes, same bytes, PSS.

    Workers 1,2 only (each imports torch: 1,2,4,8 is 45 processes, too heavy for a test).
    """
    argv = [str(REPO / "benchmarks" / "scaling.py"), "--size-mib", "16", "--tensors", "20", "--workers", "1,2",
            "--png", str(tmp_path / "scaling.png")]
    entry = run_all.run_section("scaling", argv, tmp_path, timeout=220)
    assert entry["rc"] == 0, (tmp_path / "scaling.log").read_text()[-3000:]
    scaling = entry["result"]["scaling"]
    assert set(scaling) == {"hwrd", "copy", "safe_open"}
    for rows in scaling.values():
        assert [r["workers"] for r in rows] == [1, 2]
        assert all(len(r["checksums"]) == 1 and r["touch_ms_median"] > 0 for r in rows)
    # two private copies (16 MiB each) hold more than one shared lease mapping plus 2 sessions
    assert scaling["copy"][-1]["weights_pss_mib"] > scaling["hwrd"][-1]["weights_pss_mib"]
    assert json.loads((tmp_path / "scaling.json").read_text())["benchmark"] == "scaling"
    assert "| 2 | hwrd lease |" in (tmp_path / "scaling.md").read_text()
    if (tmp_path / "scaling.png").exists():  # matplotlib (bench extra) installed
        assert (tmp_path / "scaling.png").read_bytes()[:4] == b"\x89PNG"


def test_a_timed_out_section_stops_its_daemon_too(tmp_path: Path) -> None:
    """A section past its timeout gets SIGTERM with its whole process group: the benchmark's
    cleanup stops its hwrd (``subprocess.run(timeout=)`` SIGKILLed the script alone, and the
    daemon outlived run_all).

    The timeout must fire after the section's hwrd is serving (else there is no daemon to stop):
    a short one first, and a longer one only when a loaded machine did not get the section that
    far in time. Every try's daemon, if it started, must be gone."""
    script = tmp_path / "stuck.py"
    pid_file = tmp_path / "daemon.pid"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from benchmarks.common import hwrd\n"
        "with hwrd(None) as daemon:\n"
        f"    open({str(pid_file)!r}, 'w').write(str(daemon.pid))\n"
        "    print('serving', flush=True)\n"
        "    time.sleep(300)\n")
    for timeout in (6, 20, 40):
        pid_file.unlink(missing_ok=True)
        started = time.monotonic()
        entry = run_all.run_section("stuck", [str(script)], tmp_path, timeout=timeout)
        assert entry["rc"] == -1 and time.monotonic() - started < timeout + 40
        log = (tmp_path / "stuck.log").read_text()
        assert f"(timed out after {timeout} s)" in log
        # Its hwrd started, whether or not it printed "serving" in time: it must be gone.
        if pid_file.exists() and pid_file.read_text().strip():
            assert exits_within(int(pid_file.read_text()), 10), "hwrd outlived its timed-out section"
        if "serving" in log:
            break
    assert "serving" in log and pid_file.exists(), log


@pytest.mark.timeout(300)
def test_allgather_section_end_to_end(tmp_path: Path) -> None:
    """run_all's section runner on allgather.py: real gloo ranks, the three modes at DP 2."""
    argv = [str(REPO / "benchmarks" / "allgather.py"), "--size-mib", "16", "--dp", "2", "--passes", "1"]
    entry = run_all.run_section("allgather", argv, tmp_path, timeout=280)
    assert entry["rc"] == 0, (tmp_path / "allgather.log").read_text()[-3000:]
    runs = {r["mode"]: r for r in entry["result"]["runs"]}
    assert set(runs) == {"rank-local", "allgather-private", "allgather-lease"}
    assert runs["allgather-lease"]["shard_source"] == ["lease"] and runs["allgather-lease"]["host_shard_mib"] == 0
    assert runs["allgather-private"]["shard_source"] == ["private"]
    assert runs["allgather-private"]["host_shard_mib"] >= 15  # 16 MiB over two ranks, plus padding
    assert all(r["pass_s"] > 0 and r["start_to_first_forward_s"] > 0 for r in runs.values())
    assert len(entry["result"]["goals"]) == 3
    assert "| (c) AllGather from the lease | 2 |" in (tmp_path / "allgather.md").read_text()
