"""The tests' zygote (``tests/zygote.py``) runs a worker as a fresh interpreter would, and refuses
to fork while it has another thread. Real server processes, real forks, real pipes; the server
preloads only ``json`` here, so each start is cheap."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zygote
from zygote import Zygote

pytestmark = pytest.mark.timeout(60)

WORKER = """\
import atexit, json, os, sys, threading, time
atexit.register(lambda: print("atexit ran", flush=True))
print(json.dumps({"name": __name__, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
                  "env": os.environ.get("ZYGOTE_TEST"), "pid": os.getpid(), "ppid": os.getppid()}), flush=True)
line = sys.stdin.readline().strip()
if line == "raise":
    raise ValueError("from the worker")
if line == "thread":  # a non-daemon thread: the worker ends only after it
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread done", flush=True))).start()
print("echo", line, file=sys.stderr, flush=True)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Zygote]:
    started = Zygote.start(["json"], tmp_path / "zygote.log")
    assert started is not None, (tmp_path / "zygote.log").read_text()
    yield started
    started.close()


def _worker(tmp_path: Path, server: Zygote, code: int, line: str) -> tuple[subprocess.CompletedProcess[str], int]:
    script = tmp_path / "scripts" / "worker.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(WORKER)
    proc = server.popen([sys.executable, str(script), str(code)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True, bufsize=1, cwd=tmp_path,
                        env={**os.environ, "ZYGOTE_TEST": "yes"})
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    proc.stdin.write(line + "\n")
    proc.stdin.close()
    returncode = proc.wait(30)
    return subprocess.CompletedProcess(proc.args, returncode, proc.stdout.read(), proc.stderr.read()), proc.pid


def test_a_forked_worker_runs_the_script_as_main_with_its_argv_env_cwd_and_pipes(
    tmp_path: Path, server: Zygote
) -> None:
    done, pid = _worker(tmp_path, server, 7, "hello")
    first, *rest = done.stdout.splitlines()
    seen = json.loads(first)
    script = str(tmp_path / "scripts" / "worker.py")
    assert seen == {"name": "__main__", "argv": [script, "7"], "path0": str(tmp_path / "scripts"),
                    "cwd": str(tmp_path), "env": "yes", "pid": pid, "ppid": server.proc.pid}
    assert pid != os.getpid() and pid != server.proc.pid
    assert done.returncode == 7 and done.stderr == "echo hello\n"
    assert rest == ["atexit ran"]


def test_a_worker_ends_as_an_interpreter_ends(tmp_path: Path, server: Zygote) -> None:
    failed, _ = _worker(tmp_path, server, 0, "raise")
    assert failed.returncode == 1
    assert "Traceback" in failed.stderr and "ValueError: from the worker" in failed.stderr
    threaded, _ = _worker(tmp_path, server, 3, "thread")
    assert threaded.returncode == 3
    assert threaded.stdout.splitlines()[1:] == ["thread done", "atexit ran"]  # joined, then atexit


def test_a_killed_worker_reports_the_signal(tmp_path: Path, server: Zygote) -> None:
    proc = server.popen([sys.executable, "-m", "json.tool"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.1)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    proc.kill()  # after its exit: nothing to signal, no error


def _rank(rank: int, out: str, extra: tuple[int, str]) -> None:
    Path(out, f"rank{rank}").write_text(f"{os.getpid()} {extra[0]} {extra[1]}")


def test_a_call_runs_a_module_function_with_pickled_arguments(tmp_path: Path, server: Zygote) -> None:
    procs = [server.popen([], stdin=subprocess.DEVNULL, call=(_rank, (rank, str(tmp_path), (rank * 10, "x"))))
             for rank in range(2)]
    assert [proc.wait(30) for proc in procs] == [0, 0]
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == [f"{procs[0].pid} 0 x", f"{procs[1].pid} 10 x"]


def test_the_fresh_interpreter_form_of_a_call_runs_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zygote, "shared", lambda: None)  # as where the zygote cannot serve
    proc = zygote.start_call(_rank, 5, str(tmp_path), (1, "y"))
    assert isinstance(proc, subprocess.Popen) and proc.wait(60) == 0
    assert (tmp_path / "rank5").read_text() == f"{proc.pid} 1 y"


THREAD_AT_IMPORT = """\
import threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
"""
THREAD_LATER = """\
import signal, threading, time
# A thread that starts after the server said it was ready (a SIGALRM handler runs in its loop).
signal.signal(signal.SIGALRM, lambda *_: threading.Thread(target=time.sleep, args=(60,), daemon=True).start())
signal.setitimer(signal.ITIMER_REAL, 0.2)
"""


def test_a_zygote_with_another_thread_does_not_fork(tmp_path: Path) -> None:
    (tmp_path / "thread_at_import.py").write_text(THREAD_AT_IMPORT)
    (tmp_path / "thread_later.py").write_text(THREAD_LATER)
    assert Zygote.start(["thread_at_import"], tmp_path / "a.log", home=tmp_path) is None
    later = Zygote.start(["thread_later"], tmp_path / "b.log", home=tmp_path)
    assert later is not None
    try:
        deadline = time.monotonic() + 10
        while zygote.threads_of(later.proc.pid) == 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(RuntimeError, match="2 threads alive: not forking"):
            later.popen([sys.executable, "-m", "json.tool"], stdin=subprocess.DEVNULL)
    finally:
        later.close()


def test_a_command_line_it_cannot_run_is_refused(server: Zygote) -> None:
    for args in ([sys.executable], [sys.executable, "-c", "pass"], [sys.executable, "-m"]):
        with pytest.raises(ValueError, match="a zygote runs"):
            server.popen(args)


def test_the_server_kills_its_workers_when_its_client_goes(tmp_path: Path) -> None:
    started = Zygote.start(["json"], tmp_path / "zygote.log")
    assert started is not None
    proc = started.popen([sys.executable, "-m", "json.tool"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    os.kill(proc.pid, 0)  # running, waiting for its stdin
    started.close()  # the server kills and reaps it before it exits
    assert started.proc.returncode == 0
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)
