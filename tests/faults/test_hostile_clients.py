"""Hostile local clients: each attack runs against a real hwrd while an innocent client keeps
acquiring, and must neither crash the daemon nor fail one of the innocent's operations.

The daemon runs without capabilities (``setpriv --bounding-set=-all``), as the shipped unit
runs it: with ``CAP_SYS_RESOURCE`` the kernel would not enforce the descriptors-in-flight limit
at all. Attackers are separate processes (``hostile_worker.py``), as uid ``nobody`` where a
per-uid bound is what protects the others; limits are lowered (flags, ``prlimit``) so that
each attack reaches them in seconds.

Counted after the checks, per attack: attacks tried, daemon crashes (gone, not answering, or a
traceback in its log), other clients' operations failed; printed at the end of the run
(``hwr hostile clients: ...``), with a total line: attack kinds, handled (the kind's test passed:
every defence it checks held), daemon crashes, innocent-client failures. A failing run prints
non-zero counts, or ``incomplete`` for a test that stopped before counting.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from daemon_proc import NOBODY as NOBODY_USER
from daemon_proc import STRANGER, RunAs, as_user, make_daemon, requested_user

from hwr.client import Client, connect
from hwr.client.errors import DaemonUnavailable, HwrError
from hwr.daemon.app.launcher import DaemonProcess

from .faultkit import publish

WORKER = Path(__file__).with_name("hostile_worker.py")
GRPC_ATTACKER = Path(__file__).with_name("grpc_attacker.py")
NOBODY = 65534
MIB = 1 << 20

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="attackers drop to another uid; needs root"),
    pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv to drop capabilities"),
]


# ------------------------------------------------------------------------------ the tally
@dataclass
class Attack:
    name: str
    tried: int = 0
    crashes: int = 0
    others_failed: int = 0
    complete: bool = False
    handled: bool = False  # the test passed: set at teardown


ATTACKS: list[Attack] = []


class _Summary:
    def pytest_terminal_summary(self, terminalreporter) -> None:  # type: ignore[no-untyped-def]
        if not ATTACKS:
            return
        terminalreporter.section("hwr hostile clients")
        for a in ATTACKS:
            terminalreporter.write_line(
                f"hwr hostile clients: {a.name}: {a.tried} attacks tried, daemon crashes {a.crashes}, "
                f"other clients' operations failed {a.others_failed}" + ("" if a.complete else " (incomplete)")
                + ("" if a.handled else " (NOT handled)"))
        terminalreporter.write_line(
            f"hwr hostile clients: total: {len(ATTACKS)} attack kinds, {sum(a.handled for a in ATTACKS)} handled, "
            f"daemon crashes {sum(a.crashes for a in ATTACKS)}, "
            f"innocent-client failures {sum(a.others_failed for a in ATTACKS)}")


@pytest.fixture(scope="module", autouse=True)
def _summary(request: pytest.FixtureRequest) -> None:
    manager = request.config.pluginmanager
    if not manager.has_plugin("hwr-hostile-summary"):
        manager.register(_Summary(), "hwr-hostile-summary")


@pytest.fixture
def attack(request: pytest.FixtureRequest) -> Iterator[Attack]:
    record = Attack(request.node.name.removeprefix("test_"))
    ATTACKS.append(record)
    yield record
    # The fault suite's conftest records the call's outcome (pytest_runtest_makereport).
    record.handled = record.complete and getattr(request.node, "hwr_call_outcome", "failed") == "passed"


# ------------------------------------------------------------------------------ the parts
class Uncapable(DaemonProcess):
    """hwrd without capabilities (as the systemd unit runs it)."""

    def command(self) -> list[str]:
        return ["setpriv", "--bounding-set=-all", "--inh-caps=-all", *super().command()]


@pytest.fixture
def open_dir(fault_tmp: Path) -> Path:
    fault_tmp.chmod(0o755)  # the store stays 0700; the sockets become reachable for nobody
    return fault_tmp


@pytest.fixture
def start(spawn: Callable[..., DaemonProcess], open_dir: Path,
          request: pytest.FixtureRequest) -> Callable[..., DaemonProcess]:
    """Start the attacked daemon: root without capabilities, or (a test that asks for
    ``daemon_user``) also the unit's unprivileged user, which has none either."""
    user = requested_user(request)

    def run(*extra: str) -> DaemonProcess:
        flags = ("--socket-mode", "666", "--allow-uid", str(NOBODY), *extra)
        if user is not None:
            return spawn(daemon=make_daemon(open_dir, *flags, user=user))
        return spawn(daemon=Uncapable(open_dir / "store", open_dir / "hwrd.sock", *flags))
    return run


class Innocent(threading.Thread):
    """A well-behaved client acquiring ``key`` (and checking a byte) in a loop, with a fresh
    connection every tenth operation; counts its operations and failures."""

    def __init__(self, daemon: DaemonProcess, key: str, value: float) -> None:
        super().__init__(daemon=True)
        self.socket, self.key, self.value = daemon.socket, key, value
        self.ops = 0
        self.failures: list[str] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        client: Client | None = None
        while not self._stop_event.is_set():
            try:
                if client is None or self.ops % 10 == 0:
                    if client is not None:
                        client.close()
                    client = connect(self.socket, timeout=10)
                with client.acquire(self.key) as lease:
                    if float(lease.tensors["w"][-1]) != self.value:
                        self.failures.append("wrong bytes")
            except HwrError as exc:
                self.failures.append(f"{exc.code}: {exc}")
                client = None
            self.ops += 1
            time.sleep(0.02)
        if client is not None:
            client.close()

    def finish(self) -> tuple[int, list[str]]:
        self._stop_event.set()
        self.join(30)
        return self.ops, self.failures


class Worker:
    def __init__(self, *args: str, as_nobody: bool = False) -> None:
        cmd = [sys.executable, str(WORKER), *(["--as-nobody"] if as_nobody else []), *args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ready(self, timeout: float = 60) -> None:
        line = _readline(self.proc, timeout)
        assert line.strip() == "ready", f"worker said {line!r}"

    def result(self, timeout: float = 60) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        line = _readline(self.proc, timeout)
        assert line.startswith("result "), f"worker said {line!r}"
        self.proc.wait(30)
        return json.loads(line[len("result "):])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _readline(proc: subprocess.Popen[str], timeout: float) -> str:
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(timeout)
    assert box, "the worker did not answer in time"
    return box[0]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def crashes(daemon: DaemonProcess) -> int:
    """1 when the daemon is gone, does not answer, or logged a traceback (a bug it survived)."""
    if daemon.proc is None or daemon.proc.poll() is not None:
        return 1
    try:
        with connect(daemon.socket, timeout=10) as client:
            answered = client.status()["pid"] == daemon.pid
    except HwrError:
        return 1
    return 0 if answered and "Traceback" not in daemon.log.read_text(errors="replace") else 1


@pytest.fixture
def artifact(start: Callable[..., DaemonProcess]) -> Iterator[Callable[..., tuple[DaemonProcess, str, str]]]:
    """``artifact(*flags)``: a started daemon, one published artifact's key and manifest digest."""
    def make(*extra: str) -> tuple[DaemonProcess, str, str]:
        daemon = start(*extra)
        with connect(daemon.socket) as client:
            key = publish(client, "hostile", 7, 4096)
            reply, fds, _tail = client._connection.exchange({"op": "acquire", "key": key}, want_fds=True)
            for fd in fds:
                os.close(fd)
            client._connection.exchange({"op": "release", "lease_id": reply["lease_id"]}, want_fds=False)
        return daemon, key, reply["manifest_sha256"]
    yield make


# ------------------------------------------------------------------------------ the attacks
@pytest.mark.timeout(180)
def test_acquires_without_reading_replies(artifact: Callable[..., tuple[DaemonProcess, str, str]],
                                          attack: Attack) -> None:
    """Descriptors in flight: nobody's unread acquire replies must not use up the daemon's
    budget of descriptors in flight (ETOOMANYREFS for everyone once past its open-files limit)."""
    daemon, key, digest = artifact("--max-inflight-fds-per-uid", "48")
    resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (200, 200))  # kernel bound: 200 in flight
    innocent = Innocent(daemon, key, 7.0)
    worker = Worker("unread", f"{daemon.socket}.peer", key, digest, "4", "200", as_nobody=True)
    try:
        worker.ready()
        innocent.start()
        time.sleep(3)
        ops, failures = innocent.finish()
        report = worker.result()
    finally:
        worker.kill()
    attack.tried = report["sent"]
    attack.crashes = crashes(daemon)
    attack.others_failed = len(failures)
    attack.complete = True
    print(f"\nunread acquires: {report}; innocent: {ops} operations, failures {failures[:3]}")
    assert ops > 10 and not failures
    assert report["sent"] > 300, f"the attack did not get far enough to test anything: {report}"
    assert attack.crashes == 0


@pytest.mark.timeout(180)
def test_partial_frames(artifact: Callable[..., tuple[DaemonProcess, str, str]], attack: Attack) -> None:
    """Partial frames: 200 connections each announcing 1 MiB and sending all but one byte must
    not make the daemon buffer 200 MiB, and a stalled frame must end its connection."""
    daemon, key, _digest = artifact("--peer-buffer-budget-bytes", str(8 * MIB), "--peer-frame-timeout-s", "3")
    before = rss_mib(daemon.pid)
    fds_before = len(os.listdir(f"/proc/{daemon.pid}/fd"))
    innocent = Innocent(daemon, key, 7.0)
    innocent.start()
    worker = Worker("partial", f"{daemon.socket}.peer", "200")
    peak = before
    try:
        deadline = time.monotonic() + 60
        while worker.proc.poll() is None and time.monotonic() < deadline:
            peak = max(peak, rss_mib(daemon.pid))
            line_ready = _poll_ready(worker)
            if line_ready:
                break
        # Past the frame timeout the daemon ends the stalled connections: sample its RSS until
        # their descriptors are gone (the innocent's few come and go), then the worker counts
        # which of its connections the daemon ended.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            peak = max(peak, rss_mib(daemon.pid))
            if len(os.listdir(f"/proc/{daemon.pid}/fd")) <= fds_before + 32:
                break
            time.sleep(0.1)
        ops, failures = innocent.finish()
        report = worker.result()
    finally:
        worker.kill()
    attack.tried = report["connections"]
    attack.crashes = crashes(daemon)
    attack.others_failed = len(failures)
    attack.complete = True
    grew = peak - before
    print(f"\npartial frames: {report}; daemon RSS {before:.0f} -> peak {peak:.0f} MiB; "
          f"innocent: {ops} operations, failures {failures[:3]}")
    assert report["connections"] == 200
    assert grew < 80, f"the daemon buffered {grew:.0f} MiB of partial frames"
    assert report["ended_by_daemon"] == 200, "stalled frames did not end their connections"
    assert ops > 10 and not failures
    assert attack.crashes == 0


def _poll_ready(worker: Worker) -> bool:
    import select

    assert worker.proc.stdout is not None
    readable, _, _ = select.select([worker.proc.stdout], [], [], 0.1)
    if readable:
        line = worker.proc.stdout.readline()
        assert line.strip() == "ready", line
        return True
    return False


@pytest.mark.timeout(180)
def test_connection_burst_past_the_open_files_limit(
        artifact: Callable[..., tuple[DaemonProcess, str, str]], attack: Attack) -> None:
    """Out of descriptors: with an open-files limit of 128, a burst of 130 held connections;
    every later client still gets a greeting or a typed refusal within 5 s, each time."""
    daemon, key, _digest = artifact()
    resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (128, 128))
    worker = Worker("hold", f"{daemon.socket}.peer", "130", as_nobody=True)
    answers: list[str] = []
    try:
        worker.ready(120)
        for _ in range(5):
            began = time.monotonic()
            try:
                connect(daemon.socket, timeout=5).close()
                answers.append("session")
            except DaemonUnavailable as exc:
                answers.append(exc.details.get("reason", "") if time.monotonic() - began < 5 else "timeout")
        report = worker.result()
    finally:
        worker.kill()
    innocent = Innocent(daemon, key, 7.0)  # once the burst is gone: served again
    innocent.start()
    time.sleep(1.5)
    ops, failures = innocent.finish()
    attack.tried = report["connections"]
    attack.crashes = crashes(daemon)
    attack.others_failed = sum(a not in ("session", "EMFILE") for a in answers) + len(failures)
    attack.complete = True
    print(f"\nburst: {report}; later clients: {answers}; afterwards {ops} operations, failures {failures[:3]}")
    assert all(a in ("session", "EMFILE") for a in answers), answers
    assert ops > 10 and not failures
    assert attack.crashes == 0


@pytest.mark.timeout(120)
def test_sessions_per_uid(artifact: Callable[..., tuple[DaemonProcess, str, str]], attack: Attack) -> None:
    """Held sessions: nobody may hold ``max_sessions_per_uid`` sessions, no more; the next get a
    typed refusal, and other uids are served."""
    daemon, key, _digest = artifact("--max-sessions-per-uid", "8")
    worker = Worker("hold", f"{daemon.socket}.peer", "20", as_nobody=True)
    innocent = Innocent(daemon, key, 7.0)
    try:
        worker.ready()
        innocent.start()
        time.sleep(1.5)
        ops, failures = innocent.finish()
        report = worker.result()
    finally:
        worker.kill()
    attack.tried = report["connections"]
    attack.crashes = crashes(daemon)
    attack.others_failed = len(failures)
    attack.complete = True
    print(f"\nsessions per uid: {report}; innocent: {ops} operations, failures {failures[:3]}")
    assert report["codes"] == {"ok": 8, "DAEMON_UNAVAILABLE": 12}, report
    assert ops > 10 and not failures
    assert attack.crashes == 0


@pytest.mark.timeout(120)
def test_full_listen_backlog(artifact: Callable[..., tuple[DaemonProcess, str, str]], attack: Attack) -> None:
    """A full listen backlog (the daemon stopped, the backlog filled by a flood of connects):
    ``connect(timeout=20)`` waits for room instead of failing at once with EAGAIN."""
    daemon, key, _digest = artifact()
    flood: list[socket.socket] = []
    result: dict[str, object] = {}

    def innocent_connect() -> None:
        began = time.monotonic()
        try:
            with connect(daemon.socket, timeout=20) as client, client.acquire(key) as lease:
                result["value"] = float(lease.tensors["w"][0])
        except HwrError as exc:
            result["error"] = f"{exc.code}: {exc}"
        result["took"] = time.monotonic() - began

    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        while True:  # until the backlog is full
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                sock.connect(f"{daemon.socket}.peer")
            except BlockingIOError:
                sock.close()
                break
            flood.append(sock)
            assert len(flood) < 100_000
        thread = threading.Thread(target=innocent_connect)
        thread.start()
        time.sleep(1.0)
        for sock in flood:
            sock.close()
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    thread.join(60)
    attack.tried = len(flood)
    attack.crashes = crashes(daemon)
    attack.others_failed = 0 if result.get("value") == 7.0 else 1
    attack.complete = True
    print(f"\nbacklog of {len(flood)} connections: the innocent connect: {result}")
    assert result.get("value") == 7.0, result
    assert float(result["took"]) >= 0.9  # type: ignore[arg-type]
    assert attack.crashes == 0


@pytest.mark.timeout(120)
def test_undecodable_protobuf(artifact: Callable[..., tuple[DaemonProcess, str, str]], attack: Attack) -> None:
    """Bytes that are no protobuf, to unary and streaming RPCs: a typed INVALID_ARGUMENT with its
    ``hwr-error-code``, no traceback in the daemon's log."""
    daemon, key, _digest = artifact()
    innocent = Innocent(daemon, key, 7.0)
    innocent.start()
    codes = []
    garbage = [b"\xff\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f", b"\x08" + b"\xff" * 11]
    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        for method in ("GetStatus", "Acquire", "InspectArtifact", "VerifyArtifact"):
            path = f"/hwr.v1.HostWeightRuntime/{method}"
            for data in garbage:
                call = (channel.unary_stream(path) if method == "VerifyArtifact" else channel.unary_unary(path))
                try:
                    result = call(data, timeout=10)
                    if method == "VerifyArtifact":
                        list(result)
                    codes.append((method, "OK", ""))
                except grpc.RpcError as exc:
                    metadata = dict(exc.trailing_metadata() or ())
                    codes.append((method, exc.code().name, metadata.get("hwr-error-code", "")))
    ops, failures = innocent.finish()
    attack.tried = len(codes)
    attack.crashes = crashes(daemon)
    attack.others_failed = len(failures)
    attack.complete = True
    log = daemon.log.read_text(errors="replace")
    print(f"\nundecodable requests: {sorted(set(codes))}; innocent: {ops} operations")
    assert all(c[1:] == ("INVALID_ARGUMENT", "INVALID_ARGUMENT") for c in codes), codes
    assert "Traceback" not in log and "Exception deserializing" not in log, log[-3000:]
    assert not failures and attack.crashes == 0


@pytest.mark.timeout(120)
def test_escape_sequences_in_client_strings(artifact: Callable[..., tuple[DaemonProcess, str, str]],
                                            attack: Attack) -> None:
    """A client name and a model id with terminal escape sequences (clear screen, colours, a
    carriage return, a right-to-left override): the operator's tables show them escaped."""
    daemon, _key, _digest = artifact()
    evil = "\x1b[2J\x1b[31mowned\r\u202e"
    with connect(daemon.socket) as client:
        evil_key = publish(client, f"model{evil}", 3, 1024)
    worker = Worker("named", f"{daemon.socket}.peer", f"client{evil}", evil_key, as_nobody=True)
    try:
        worker.ready()
        outputs = [subprocess.run([sys.executable, "-m", "hwr.daemon.ctl.cli", "--socket", str(daemon.socket), *args],
                                  capture_output=True, text=True, timeout=60)
                   for args in (["leases"], ["ls"], ["show", evil_key[:12]])]
        report = worker.result()
    finally:
        worker.kill()
    raw = [out.args[-1] for out in outputs if any(c in out.stdout for c in "\x1b\r\u202e")]
    attack.tried = len(outputs)
    attack.crashes = crashes(daemon)
    attack.others_failed = len(raw) + sum(out.returncode != 0 for out in outputs)
    attack.complete = True
    print(f"\nescape sequences: {report}; hwrctl printed raw control characters in: {raw}")
    assert report == {"named": True, "descriptors": 1}, report
    assert not raw and all(out.returncode == 0 for out in outputs), [out.stderr for out in outputs]
    assert "client\\x1b[2J" in outputs[0].stdout and "model\\x1b[2J" in outputs[1].stdout + outputs[2].stdout
    assert attack.crashes == 0


@pytest.mark.usefixtures("daemon_user")  # root without capabilities, and the unit's user
@pytest.mark.timeout(300)
@pytest.mark.parametrize("allowed", [False, True], ids=["uid-not-allowed", "uid-allowed"])
def test_large_grpc_messages_on_concurrent_calls(artifact: Callable[..., tuple[DaemonProcess, str, str]],
                                                 attack: Attack, allowed: bool) -> None:
    """32 connections at once, each sending a 60 MiB request without a session: from a uid the
    allow-list refuses, the connection is closed before a byte is read; from an admitted uid the
    request is refused at its length prefix (over the 16 MiB limit). Either way the daemon's
    memory stays flat (it grew by 70-86 MiB per call when it read them all)."""
    daemon, key, _digest = artifact()  # nobody is allowed, STRANGER is not
    before = rss_mib(daemon.pid)
    peak = [before]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_mib(daemon.pid))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    innocent = Innocent(daemon, key, 7.0)
    innocent.start()
    try:
        out = _grpc_attacker("flood", str(daemon.socket), "32", str(60 * MIB),
                             user=NOBODY_USER if allowed else STRANGER)
    finally:
        ops, failures = innocent.finish()
        done.set()
        watcher.join(10)
    report = out
    attack.tried = report["calls"]
    attack.crashes = crashes(daemon)
    attack.others_failed = len(failures)
    attack.complete = True
    grew = peak[0] - before
    print(f"\nlarge gRPC messages ({'allowed' if allowed else 'not allowed'}): {report}; daemon RSS {before:.0f} "
          f"-> peak {peak[0]:.0f} MiB; innocent: {ops} operations, failures {failures[:3]}")
    expected = "RESOURCE_EXHAUSTED" if allowed else "UNAVAILABLE"
    assert report["codes"] == {expected: 32}, report
    assert grew < 64, f"the daemon buffered {grew:.0f} MiB of requests"
    assert ops > 10 and not failures
    assert attack.crashes == 0


@pytest.mark.usefixtures("daemon_user")  # root without capabilities, and the unit's user
@pytest.mark.timeout(180)
def test_grpc_connections_per_uid(artifact: Callable[..., tuple[DaemonProcess, str, str]], attack: Attack) -> None:
    """An admitted uid holding ``max_grpc_connections_per_uid`` gRPC connections: one more is closed
    unread; other uids' calls are served."""
    daemon, _key, _digest = artifact("--allow-uid", str(NOBODY), "--max-grpc-connections-per-uid", "4")
    report = _grpc_attacker("hold", str(daemon.socket), "6")
    with connect(daemon.socket) as client:  # root: a budget of its own
        status = client.status()
    attack.tried = report["connections"]
    attack.crashes = crashes(daemon)
    attack.others_failed = 0 if status["pid"] == daemon.pid else 1
    attack.complete = True
    print(f"\ngRPC connections per uid: {report}")
    assert report["codes"] == {"open": 4, "closed": 2}, report
    assert attack.crashes == 0 and attack.others_failed == 0


def _grpc_attacker(*args: str, user: RunAs = NOBODY_USER) -> dict:
    out = subprocess.run(as_user(user, [sys.executable, str(GRPC_ATTACKER), *args]), capture_output=True,
                         text=True, timeout=240, cwd="/")
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1].removeprefix("result "))


LEASE_HOARDER = """
import json, sys
from hwr.client import connect
from hwr.client.errors import HwrError
sock, key, sessions = sys.argv[1], sys.argv[2], int(sys.argv[3])
held, refusals, clients = [], {}, []
for _ in range(sessions):
    client = connect(sock)
    clients.append(client)
    while True:
        try:
            held.append(client.acquire(key))
        except HwrError as exc:
            reason = f"{exc.code}:{exc.details.get('reason', 'LEASES_PER_SESSION')}"
            refusals[reason] = refusals.get(reason, 0) + 1
            break
print("result " + json.dumps({"held": len(held), "refusals": refusals}), flush=True)
"""


@pytest.mark.usefixtures("daemon_user")  # root without capabilities, and the unit's user
@pytest.mark.timeout(240)
def test_leases_per_uid(artifact: Callable[..., tuple[DaemonProcess, str, str]], attack: Attack) -> None:
    """One uid hoarding leases over several sessions stops at ``max_leases_per_uid`` with a typed
    refusal; another uid still acquires."""
    daemon, key, _digest = artifact("--max-leases-per-session", "40", "--max-leases-per-uid", "100")
    innocent = Innocent(daemon, key, 7.0)
    innocent.start()
    try:
        out = subprocess.run(as_user(NOBODY_USER, [sys.executable, "-c", LEASE_HOARDER, str(daemon.socket), key, "4"]),
                             capture_output=True, text=True, timeout=200, cwd="/")
    finally:
        ops, failures = innocent.finish()
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1].removeprefix("result "))
    attack.tried = report["held"] + sum(report["refusals"].values())
    attack.crashes = crashes(daemon)
    attack.others_failed = len(failures)
    attack.complete = True
    print(f"\nleases per uid: {report}; innocent: {ops} operations, failures {failures[:3]}")
    # 40 + 40 + 20 (the uid's cap) and refused; the fourth session is refused at once.
    assert report == {"held": 100, "refusals": {"INVALID_ARGUMENT:LEASES_PER_SESSION": 2,
                                                "INVALID_ARGUMENT:LEASES_PER_UID": 2}}, report
    assert ops > 10 and not failures
    assert attack.crashes == 0


SURROGATE_NAMER = r"""
import json, os, socket, struct, sys
path, key = sys.argv[1], sys.argv[2]
def frame(text):
    body = text.encode()
    return struct.pack(">I", len(body)) + body
def read(sock):
    head = b""
    while len(head) < 4:
        head += sock.recv(4 - len(head))
    n, body = struct.unpack(">I", head)[0], b""
    while len(body) < n:
        msg, anc, _f, _a = sock.recvmsg(n - len(body), socket.CMSG_SPACE(64 * 4))
        for _l, _k, data in anc:
            for i in range(0, len(data) - len(data) % 4, 4):
                os.close(struct.unpack("i", data[i:i + 4])[0])
        body += msg
    return json.loads(body)
sock = socket.socket(socket.AF_UNIX)
sock.connect(path)
read(sock)  # the greeting
codes = []
for name in ('"evil\\ud800"', '"\\udfff"', '"ok\\ud83d"'):  # lone surrogates, escaped as JSON allows
    sock.sendall(frame('{"op":"hello","client_name":' + name + ',"client_version":"1"}'))
    codes.append(read(sock).get("code", "ok"))
sock.sendall(frame(json.dumps({"op": "acquire", "key": key, "have": "0" * 64})))
codes.append(read(sock).get("code", "ok"))
print("ready", flush=True)
sys.stdin.readline()
print("result " + json.dumps({"codes": codes}), flush=True)
"""


@pytest.mark.usefixtures("daemon_user")  # root without capabilities, and the unit's user
@pytest.mark.timeout(180)
def test_lone_surrogates_in_a_client_name(artifact: Callable[..., tuple[DaemonProcess, str, str]],
                                          attack: Attack) -> None:
    """A session named with lone surrogates (``"\\ud800"``: valid JSON, not text) while holding a
    lease: the names are refused with a typed error, the session keeps serving, and the
    operator's listings work for everyone."""
    daemon, key, _digest = artifact()
    proc = subprocess.Popen(as_user(NOBODY_USER, [sys.executable, "-c", SURROGATE_NAMER, f"{daemon.socket}.peer",
                                                  key]), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd="/")
    try:
        assert _readline(proc, 60).strip() == "ready"
        outputs = [subprocess.run([sys.executable, "-m", "hwr.daemon.ctl.cli", "--socket", str(daemon.socket),
                                   *args, "--json"], capture_output=True, text=True, timeout=60)
                   for args in (["leases"], ["ls"], ["status"])]
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        report = json.loads(_readline(proc, 60).removeprefix("result "))
    finally:
        proc.kill()
        proc.wait(30)
    attack.tried = len(report["codes"])
    attack.crashes = crashes(daemon)
    attack.others_failed = sum(out.returncode != 0 for out in outputs)
    attack.complete = True
    print(f"\nlone surrogates: {report}; hwrctl exit codes {[out.returncode for out in outputs]}")
    assert report["codes"] == ["INVALID_ARGUMENT"] * 3 + ["ok"], report
    assert all(out.returncode == 0 for out in outputs), [out.stderr for out in outputs]
    assert NOBODY in [x["uid"] for x in json.loads(outputs[0].stdout)]
    assert attack.crashes == 0
