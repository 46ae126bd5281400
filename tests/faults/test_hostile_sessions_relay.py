"""Hostile and careless clients against sessions, the gRPC relay and publications: each runs
against a real hwrd (root without capabilities, and the unit's unprivileged user where the
daemon's rights matter) and is counted in the hostile summary of ``test_hostile_clients.py``
(``hwr hostile clients: ...``), with the same tally.

- A session holding as many channel watches as the README allows (64) still gets its unary
  calls answered at once, and one more watch is refused with a typed error.
- A publisher stopped (SIGSTOP) mid-staging, as another uid, gives its reservation back once it
  made no progress for ``publication_stall_timeout_s``: an innocent publication that needs the
  room then succeeds, and the stopped one, resumed, fails with a typed error; nothing leaks.
- Many uids each holding many idle gRPC relay connections, or peer sessions, cannot exhaust
  hwrd's descriptors: each kind shares one node-wide budget (half, and a quarter, of the
  open-files limit), an innocent uid gets in by shedding a connection of the biggest holder,
  and a gRPC connection that never sends a byte is closed.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from daemon_proc import NOBODY, RunAs, as_user, requested_user

from hwr.client import ArtifactIdentity, connect
from hwr.client.errors import InvalidRequest
from hwr.daemon.app.launcher import DaemonProcess

from . import test_hostile_clients as hostile
from .faultkit import publish
from .test_hostile_clients import Attack, _readline, crashes, rss_mib

# The hostile suite's fixtures (the tally and its summary, the attacked daemon), shared so that
# these attacks are counted with the others.
_summary, attack, artifact, start, open_dir = (hostile._summary, hostile.attack, hostile.artifact, hostile.start,
                                               hostile.open_dir)
pytestmark = hostile.pytestmark  # root (attackers drop to other uids) and setpriv

WATCHES_PER_SESSION = 64  # the README's promise
UNARY_BOUND_S = 5.0  # a unary call behind 64 open watches: answered well before the client's timeout


@pytest.mark.usefixtures("daemon_user")  # root without capabilities, and the unit's user
@pytest.mark.timeout(240)
def test_watches_per_session(artifact: Callable[..., tuple[DaemonProcess, str, str]], attack: Attack) -> None:
    """64 watches open on one session: ``list_channels``, ``set_channel`` and a publication are
    answered at once (a watch once held one of the 8 calls a gRPC connection has in flight, so
    8 watches froze the session for 10 s), every watch hears the change, and a 65th watch is
    refused (``InvalidRequest``, ``details.limit`` 64)."""
    daemon, key, _digest = artifact()
    timings: dict[str, float] = {}
    with connect(daemon.socket, timeout=10) as client:
        names = [f"w{i:02d}" for i in range(WATCHES_PER_SESSION)]
        for name in names:
            client.set_channel(name, key)
        watches = [client.watch_channel(name) for name in names]
        try:
            assert all(w.wait(30) is not None for w in watches)  # the state at subscription
            began = time.monotonic()
            listed = client.list_channels()
            timings["list_channels"] = time.monotonic() - began
            assert {c["name"] for c in listed} >= set(names)
            other = publish(client, "hostile-watches", 3)
            began = time.monotonic()
            client.set_channel(names[-1], other)
            timings["set_channel"] = time.monotonic() - began
            update = watches[-1].wait(30)
            assert update is not None and update.key == other
            with pytest.raises(InvalidRequest) as refused:
                client.watch_channel("one-too-many")
            assert refused.value.details.get("limit") == WATCHES_PER_SESSION
            began = time.monotonic()
            client.status()
            timings["status"] = time.monotonic() - began
            assert client.inspect_channel(names[0])["watchers"] == 1
        finally:
            for watch in watches:
                watch.close()
    attack.tried = WATCHES_PER_SESSION + 1
    attack.crashes = crashes(daemon)
    slow = {call: t for call, t in timings.items() if t > UNARY_BOUND_S}
    attack.others_failed = len(slow)
    attack.complete = True
    print(f"\nwatches per session: {WATCHES_PER_SESSION} open, one more refused; unary calls took "
          + ", ".join(f"{call} {t * 1000:.0f} ms" for call, t in timings.items()))
    assert not slow, f"unary calls were held up behind the watches: {slow}"
    assert attack.crashes == 0


STALLER = """
import json, sys
import torch
from hwr.client import ArtifactIdentity, connect
from hwr.client.errors import HwrError
from hwr.client.publisher import TensorSpec
sock, numel = sys.argv[1], int(sys.argv[2])
client = connect(sock)
pub = client.publisher(ArtifactIdentity.simple("hostile/stalled"),
                       [TensorSpec("a", torch.float32, (numel,)), TensorSpec("b", torch.float32, (numel,))])
pub.write("a", torch.ones(numel))
print("staged", flush=True)
sys.stdin.readline()  # stopped here (SIGSTOP), then resumed and told to go on
try:
    pub.write("b", torch.ones(numel))
    print("result " + json.dumps({"committed": pub.commit()}), flush=True)
except HwrError as exc:
    print("result " + json.dumps({"code": exc.code, "type": type(exc).__name__, "message": str(exc)}), flush=True)
client.close()
"""
#: ``publication_stall_timeout_s``: long enough for the staller to write its first tensor right
#: after opening its publication (progress is sampled each 0.3 s housekeeping tick), short
#: because the innocent waits it out.
STALL_TIMEOUT_S = 1.5
NUMEL = 256 * 1024  # two tensors of 1 MiB each: the staller's reservation is 2 MiB
STORE_LIMIT = 3 << 20  # room for one such publication at a time


@pytest.mark.usefixtures("daemon_user")  # root without capabilities, and the unit's user
@pytest.mark.timeout(240)
@pytest.mark.parametrize("staging", ["memfd", "files"])
def test_publisher_stopped_mid_staging(artifact: Callable[..., tuple[DaemonProcess, str, str]], attack: Attack,
                                       staging: str) -> None:
    """uid nobody stages a 2 MiB publication, writes half of it and is stopped (SIGSTOP): its
    session stays open, so only the stall timeout can take its reservation back. The innocent's
    publication that needs the room waits for it and succeeds; the staller, resumed, gets
    ``PUBLICATION_FAILED``; no reservation, staging or publication is left."""
    flags = ["--store-limit-bytes", str(STORE_LIMIT), "--publication-stall-timeout-s", str(STALL_TIMEOUT_S),
             "--housekeeping-interval-s", "0.3"]
    if staging == "files":
        flags += ["--memfd-staging-max-bytes", "0"]
    daemon, _key, _digest = artifact(*flags)
    staller = subprocess.Popen(as_user(NOBODY, [sys.executable, "-c", STALLER, str(daemon.socket), str(NUMEL)]),
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        assert _readline(staller, 60).strip() == "staged"
        os.kill(staller.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        with connect(daemon.socket, timeout=30) as client:
            assert client.store_usage()["reserved_bytes"] >= 2 * NUMEL * 4
            innocent = client.publish(ArtifactIdentity.simple("hostile/innocent"), {"w": torch.full((2 * NUMEL,), 5.0)})
            waited = time.monotonic() - stopped_at
            with client.acquire(innocent) as lease:
                assert float(lease.tensors["w"][-1]) == 5.0
            os.kill(staller.pid, signal.SIGCONT)
            assert staller.stdin is not None
            staller.stdin.write("go\n")
            staller.stdin.flush()
            line = _readline(staller, 60)
            assert line.startswith("result "), line
            resumed = json.loads(line[len("result "):])
            assert staller.wait(30) == 0
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and (client.status()["publications"]
                                                   or os.listdir(Path(daemon.root) / "tmp")):
                time.sleep(0.1)
            leftovers = {"publications": client.status()["publications"],
                         "reserved_bytes": client.store_usage()["reserved_bytes"],
                         "staging": os.listdir(Path(daemon.root) / "tmp")}
    finally:
        if staller.poll() is None:
            os.kill(staller.pid, signal.SIGCONT)
            staller.kill()
            staller.wait()
    attack.tried = 1
    attack.crashes = crashes(daemon)
    attack.others_failed = 0  # the innocent's publication succeeded (it raised otherwise)
    attack.complete = True
    print(f"\npublisher stopped mid-staging ({staging}): the innocent's publication succeeded after "
          f"{waited:.1f} s (stall timeout {STALL_TIMEOUT_S:g} s); the resumed staller got {resumed}; "
          f"left: {leftovers}")
    assert resumed.get("code") == "PUBLICATION_FAILED", resumed
    assert "no progress" in resumed["message"]
    assert waited < STALL_TIMEOUT_S + 20
    assert leftovers == {"publications": 0, "reserved_bytes": 0, "staging": []}
    assert attack.crashes == 0


HOLDER = """
import json, select, socket, sys, time
path, conns, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
# gRPC: an HTTP/2 client preface and an empty SETTINGS frame, a connection that looks like a
# gRPC client's; peer: nothing (the session opens at connect). Then idle for good.
PREFACE = b"PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
socks = []
for _ in range(conns):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        if kind == "grpc":
            sock.sendall(PREFACE)
    except OSError:
        sock.close()
        continue
    socks.append(sock)
print("holding", flush=True)
sys.stdin.readline()
open_now = 0
for sock in socks:  # open: no end of file and no reset after what gRPC sent is read
    state = "open"
    try:
        while select.select([sock], [], [], 0)[0]:
            if not sock.recv(65536, socket.MSG_DONTWAIT):
                state = "closed"
                break
    except OSError:
        state = "closed"
    open_now += state == "open"
print("result " + json.dumps({"connections": conns, "connected": len(socks), "open": open_now}), flush=True)
"""
ATTACKER_GID = 64399
ATTACKER_UIDS = [64400 + i for i in range(24)]
PER_UID = 32  # max_grpc_connections_per_uid's default: each uid holds all it may
NOFILE = 1024
#: ``grpc_first_bytes_timeout_s`` of the attacked daemon: short, so that waiting for the silent
#: connection's end costs seconds (its default is 10 s), and still far
#: above the moment between a client's connect and its first bytes, even on a loaded machine
#: (the attackers and the innocent send theirs at once).
FIRST_BYTES_S = 3.0


def lower_nofile(daemon: DaemonProcess, user: RunAs | None) -> None:
    """Give the running daemon an open-files limit of ``NOFILE`` (soft and hard). As its own uid
    when it runs as another user: lowering one's own limits needs no capability."""
    if user is None:
        resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (NOFILE, NOFILE))
        return
    code = "import resource, sys; resource.prlimit(int(sys.argv[1]), resource.RLIMIT_NOFILE, (int(sys.argv[2]),) * 2)"
    subprocess.run(as_user(user, [sys.executable, "-c", code, str(daemon.pid), str(NOFILE)]), check=True,
                   timeout=60, cwd="/")


def silent_connection_closed_after(daemon: DaemonProcess) -> float:
    """Seconds until hwrd closes a gRPC connection that never sends a byte."""
    import socket

    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        silent.connect(str(daemon.socket))
        silent.settimeout(60)
        began = time.monotonic()
        try:
            return time.monotonic() - began if silent.recv(1) == b"" else -1.0
        except OSError:
            return time.monotonic() - began
    finally:
        silent.close()


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.usefixtures("daemon_user")  # root without capabilities, and the unit's user
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["grpc", "peer"])
def test_idle_connections_of_many_uids(artifact: Callable[..., tuple[DaemonProcess, str, str]],
                                       attack: Attack, request: pytest.FixtureRequest, kind: str) -> None:
    """24 uids of one admitted gid each hold 32 idle connections against an hwrd limited to
    1,024 descriptors: gRPC connections (an HTTP/2 preface, then nothing) or peer sessions
    (nothing at all). hwrd holds at most its budget of them, its descriptors stay well below the
    limit, and an innocent client (another uid) opens sessions, lists, sets and watches channels,
    publishes and acquires throughout. A gRPC connection that sends no byte at all is closed
    after ``grpc_first_bytes_timeout_s`` (set to ``FIRST_BYTES_S``)."""
    from hwr.daemon.peer.server import SESSION_SHARE
    from hwr.daemon.system.grpc_peers import FDS_PER_CONNECTION, SHARE

    daemon, key, _digest = artifact("--allow-gid", str(ATTACKER_GID),
                                    "--grpc-first-bytes-timeout-s", str(FIRST_BYTES_S))
    lower_nofile(daemon, requested_user(request))
    if kind == "grpc":
        budget, target = int(NOFILE * SHARE) // FDS_PER_CONNECTION, str(daemon.socket)
    else:
        budget, target = int(NOFILE * SESSION_SHARE), f"{daemon.socket}.peer"
    holders = [subprocess.Popen(as_user(RunAs(uid, ATTACKER_GID, umask=0o022),
                                        [sys.executable, "-c", HOLDER, target, str(PER_UID), kind]),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
               for uid in ATTACKER_UIDS]
    innocent_ops: list[str] = []
    failures: list[str] = []
    peak_fds = 0
    try:
        for holder in holders:
            assert _readline(holder, 120).strip() == "holding"
        peak_fds = fd_count(daemon.pid)
        for round_ in range(3):  # innocent work while every attacker holds what it got
            try:
                with connect(daemon.socket, timeout=10) as client:
                    client.status()
                    client.set_channel("innocent", key)
                    with client.watch_channel("innocent") as watch:
                        assert watch.wait(10) is not None
                        client.list_channels()
                        fresh = publish(client, f"hostile-relay-{round_}", 9)
                        client.set_channel("innocent", fresh)
                        update = watch.wait(10)
                        assert update is not None and update.key == fresh
                    with client.acquire(key) as lease:
                        assert float(lease.tensors["w"][-1]) == 7.0
                innocent_ops.append("ok")
            except Exception as exc:  # counted: an innocent failure is the finding
                failures.append(f"{type(exc).__name__}: {exc}")
            peak_fds = max(peak_fds, fd_count(daemon.pid))
        reports = []
        for holder in holders:
            assert holder.stdin is not None
            holder.stdin.write("go\n")
            holder.stdin.flush()
            line = _readline(holder, 60)
            assert line.startswith("result "), line
            reports.append(json.loads(line[len("result "):]))
        closed_after = silent_connection_closed_after(daemon) if kind == "grpc" else 0.0
    finally:
        for holder in holders:
            if holder.poll() is None:
                holder.kill()
            holder.wait()
    held = sum(r["open"] for r in reports)
    log = daemon.log.read_text(errors="replace")
    shed = log.count("shed the least recently active gRPC connection") + log.count("ended the least recently active "
                                                                                     "session")
    refused = log.count("its budget, and")
    attack.tried = sum(r["connections"] for r in reports)
    attack.crashes = crashes(daemon)
    attack.others_failed = len(failures)
    attack.complete = True
    print(f"\nidle {kind} connections of {len(ATTACKER_UIDS)} uids x {PER_UID}: {held} still open at the end "
          f"(budget {budget}; {shed} shed, {refused} refused), per uid {[r['open'] for r in reports]}, "
          f"daemon descriptors at most {peak_fds} of {NOFILE}, RSS {rss_mib(daemon.pid):.0f} MiB; "
          f"innocent rounds {innocent_ops}, failures {failures[:3]}"
          + (f"; a silent connection closed after {closed_after:.1f} s" if kind == "grpc" else ""))
    assert not failures, failures
    assert held <= budget
    assert peak_fds < NOFILE - 64, "the attack came close to hwrd's open-files limit"
    if kind == "grpc":
        assert FIRST_BYTES_S - 1 <= closed_after <= FIRST_BYTES_S + 10
    assert attack.crashes == 0
