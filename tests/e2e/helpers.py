"""Shared pieces of the end-to-end tests: worker processes, /proc measurements, tensor digests.

The test process imports this module for the helpers; worker processes run it as a script
(``python helpers.py COMMAND ARGS...``) and talk to the test over a line protocol: the worker
prints one line per step on stdout (``ready``, ``held``, a final JSON line ``result {...}``) and
waits for the test's go-ahead lines on stdin. That is the barrier that makes several workers hold
their leases at the same moment. Nothing here is mocked: workers are real processes that connect
to a real hwrd over its real sockets.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from hwr.daemon.app.launcher import DaemonProcess

SCRIPT = Path(__file__).resolve()
PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20


# ------------------------------------------------------------------------------------ tensors
def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The raw little-endian bytes of a CPU tensor (any dtype, any shape, 0-dim included)."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    return flat.view(torch.uint8).numpy().tobytes()


def digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """name -> sha256 of the bytes, dtype and shape: what two processes compare."""
    return {name: {"sha256": hashlib.sha256(tensor_bytes(t)).hexdigest(), "dtype": str(t.dtype),
                   "shape": list(t.shape)}
            for name, t in tensors.items()}


def patterned(nbytes: int, seed: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A deterministic, non-constant 1-D tensor of ``nbytes`` bytes, built fast (no RNG)."""
    words = torch.arange(seed, seed + nbytes // 8, dtype=torch.int64)
    words.mul_(0x9E3779B97F4A7C15 - (1 << 64)).add_(seed)
    return words.view(torch.uint8).view(dtype)


def touch_every_page(tensors: Mapping[str, torch.Tensor]) -> int:
    """Read one byte of every page each tensor spans (faults the shared pages in); returns a sum."""
    total = 0
    for t in tensors.values():
        flat = t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)
        if flat.numel():
            total += int(flat[::PAGE].sum()) + int(flat[-1])
    return total


# ------------------------------------------------------------------------------------ /proc
def pss_kib(pid: int) -> int:
    """Proportional set size of a process (kB, from /proc/PID/smaps_rollup)."""
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise AssertionError(f"no Pss line for pid {pid}")


def mapping_pss_kib(pid: int, under: Path) -> int:
    """Summed Pss (kB) of the mappings of ``pid`` whose backing file lies under ``under``."""
    prefix = str(Path(os.path.realpath(under))) + "/"
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            head = line.split(maxsplit=5)
            if head and "-" in head[0] and ":" not in head[0]:  # a mapping header line
                inside = len(head) == 6 and head[5].strip().startswith(prefix)
            elif inside and line.startswith("Pss:"):
                total += int(line.split()[1])
    return total


def count_mappings(pid: int, under: Path) -> int:
    prefix = str(Path(os.path.realpath(under))) + "/"
    with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as fh:
        return sum(1 for line in fh if line.rstrip().split(maxsplit=5)[-1].startswith(prefix))


def fd_count(pid: int | str) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> float:
    """Poll until ``predicate()`` is true; returns the seconds it took, raises on timeout."""
    start = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"condition not met within {timeout} s")
        time.sleep(interval)


def rpc_error(daemon: DaemonProcess, token: str, method: str, request: Any) -> Any:
    """The typed error (``HwrError``) that gRPC ``method`` answers ``request`` with in session ``token``."""
    import grpc

    from hwr.client.wire import SESSION_KEY, error_from_rpc
    from hwr.protos.hwr.v1 import hwr_pb2_grpc

    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        try:
            getattr(hwr_pb2_grpc.HostWeightRuntimeStub(channel), method)(
                request, metadata=((SESSION_KEY, token),), timeout=20)
        except grpc.RpcError as exc:
            return error_from_rpc(exc)
    raise AssertionError(f"{method} succeeded")


def peer_error(client: Any, request: dict[str, Any]) -> Any:
    """The typed error (``HwrError``) that the peer socket answers ``request`` with."""
    import pytest

    from hwr.client.errors import HwrError

    with pytest.raises(HwrError) as caught:
        client._connection.exchange(request, want_fds=True)
    return caught.value


def rot_a_byte(payload: Path, offset: int) -> None:
    """Bit rot: flip one byte of a store file in place, keeping its size and timestamps, so only
    a re-hash can tell (run it while the daemon is down: the chmod changes the ctime)."""
    st = os.stat(payload)
    os.chmod(payload, 0o644)
    with open(payload, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.chmod(payload, 0o444)
    os.utime(payload, ns=(st.st_atime_ns, st.st_mtime_ns))


def staging_entries(root: Path) -> list[str]:
    return sorted(os.listdir(root / "tmp"))


def artifact_entries(root: Path) -> list[str]:
    return sorted(os.listdir(root / "artifacts"))


# ------------------------------------------------------------------------------------ workers
class Worker:
    """A worker process running this script, with a line protocol over its stdin/stdout.

    ``forked``: forked from the tests' zygote (``zygote.popen``: torch and hwr imported once)
    instead of started as a fresh interpreter; it runs this script the same way. Tests that look
    at what a fresh process inherits or how it starts keep the default."""

    def __init__(self, *args: str, forked: bool = False) -> None:
        from zygote import popen  # the test side's (tests/ is on its path, not on a worker's)

        self.args = args
        self.proc = (popen if forked else subprocess.Popen)(
            [sys.executable, str(SCRIPT), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, bufsize=1,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self._lines), daemon=True).start()
        threading.Thread(target=self._drain, daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @staticmethod
    def _pump(stream: Any, lines: queue.Queue[str | None]) -> None:
        for line in stream:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)[-4000:]

    def expect(self, word: str, timeout: float = 60.0) -> str:
        """Wait for the next line starting with ``word``; returns the rest of it."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                line = self._lines.get(timeout=max(0.0, remaining))
            except queue.Empty:
                raise TimeoutError(f"worker {self.args[:1]} sent no {word!r} in {timeout} s; "
                                   f"stderr:\n{self.stderr}") from None
            if line is None:
                self.proc.wait(5)
                raise AssertionError(f"worker {self.args[:1]} exited ({self.proc.returncode}) before "
                                     f"{word!r}; stderr:\n{self.stderr}")
            if line == word or line.startswith(word + " "):
                return line[len(word):].strip()

    def result(self, timeout: float = 60.0) -> Any:
        return json.loads(self.expect("result", timeout))

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def close(self) -> None:
        # stdout/stderr belong to the reader threads, which finish at EOF.
        self.kill()
        with contextlib.suppress(Exception):
            self.proc.stdin.close()  # type: ignore[union-attr]


class FaultDaemon(DaemonProcess):
    """hwrd with a store fault hook: at publication step ``step`` it writes ``marker`` and blocks.

    The hook only stops the committing thread (the daemon keeps serving); the test then kills the
    daemon with SIGKILL at a known point of the commit, with no timing guesswork.
    """

    def __init__(self, root: Path, sock: Path, step: str, marker: Path, *extra: str) -> None:
        super().__init__(root, sock, *extra)
        self.step = step
        self.marker = marker

    def command(self) -> list[str]:
        return [sys.executable, str(SCRIPT), "hwrd-fault", self.step, str(self.marker),
                "--root", str(self.root), "--socket", str(self.socket), *self.extra]


@contextlib.contextmanager
def workers(*specs: tuple[str, ...], forked: bool = False) -> Iterator[list[Worker]]:
    started = [Worker(*spec, forked=forked) for spec in specs]
    try:
        yield started
    finally:
        for worker in started:
            worker.close()


# ------------------------------------------------------------------------------------ worker side
def _line() -> str:
    line = sys.stdin.readline()
    if not line:
        raise SystemExit(3)  # the test went away
    return line.strip()


def _say(*words: object) -> None:
    print(*words, flush=True)


def _result(obj: object) -> None:
    _say("result", json.dumps(obj))


def _error_report(exc: BaseException) -> dict[str, Any]:
    import grpc

    from hwr.client.errors import HwrError

    return {"type": type(exc).__name__, "hwr": isinstance(exc, HwrError), "grpc": isinstance(exc, grpc.RpcError),
            "code": getattr(exc, "code", None) if isinstance(exc, HwrError) else None, "message": str(exc)[:300]}


def publication_tensors(nbytes: int) -> dict[str, torch.Tensor]:
    """The tensors the publishing workers write (deterministic: every process builds the same)."""
    quarter = max(4096, nbytes // 4 // 4096 * 4096)
    return {
        "blocks.0.weight": patterned(quarter, 1, torch.bfloat16).reshape(-1, 64),
        "blocks.1.weight": patterned(quarter, 2, torch.bfloat16).reshape(-1, 64),
        "blocks.0.bias": patterned(quarter, 3, torch.float32),
        "embed.weight": patterned(quarter, 4),
    }


def main(argv: list[str]) -> int:
    command, args = argv[0], argv[1:]
    if command == "hwrd-fault":
        step, marker, rest = args[0], Path(args[1]), args[2:]
        from hwr.daemon.app.main import main as hwrd_main
        from hwr.daemon.store import root as store_module

        def hook(name: str) -> None:
            if name == step:
                marker.write_text(str(os.getpid()))
                time.sleep(3600)

        store_module.FAULT_HOOK = hook
        return hwrd_main(rest)

    from hwr.client import ArtifactIdentity, connect
    from hwr.client.errors import HwrError

    if command == "digest":  # SOCKET KEY: acquire by key, print each tensor's sha256
        with connect(args[0]) as client, client.acquire(args[1]) as lease:
            _result({"key": lease.key, "tensors": digests(lease.tensors)})
        return 0

    if command == "hold":  # SOCKET KEY: ready -> (acquire) -> held -> (release) -> done
        client = connect(args[0])
        _say("ready", os.getpid())
        _line()
        lease = client.acquire(args[1])
        touched = touch_every_page(lease.tensors)
        _say("held", lease.lease_id, touched)
        _line()
        lease.close()
        client.close()
        _say("done")
        return 0

    if command == "fork-close":  # SOCKET KEY: a forked child closes the inherited lease and client
        client = connect(args[0])
        lease = client.acquire(args[1])
        expected = digests(lease.tensors)
        child = os.fork()
        if child == 0:
            code = 1
            try:
                lease.close()
                lease.close()
                client.close()
                code = 0 if lease.closed else 4
            finally:
                os._exit(code)
        _, status = os.waitpid(child, 0)
        _say("forked", os.waitstatus_to_exitcode(status), lease.lease_id)
        _line()
        _result({"same_bytes": digests(lease.tensors) == expected,
                 "session_leases": client.keepalive()["lease_count"]})
        _line()
        lease.close()
        client.close()
        _say("done")
        return 0

    if command == "fork-orphan":  # SOCKET KEY: hold a lease, fork a long-lived child, wait to be killed
        client = connect(args[0])
        lease = client.acquire(args[1])
        child = os.fork()
        if child == 0:
            # The child keeps the inherited mapping (and would keep an inherited peer socket);
            # it lets go of the test's pipes so that only the parent talks to the test.
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            time.sleep(60)
            os._exit(0)
        _say("held", lease.lease_id, child)
        _line()
        return 0

    if command == "publish":  # SOCKET MODEL NBYTES WAIT: ready -> (go) -> result
        socket_path, model, nbytes, wait = args[0], args[1], int(args[2]), float(args[3])
        tensors = publication_tensors(nbytes)
        client = connect(socket_path)
        from hwr.client.publisher import specs_for

        _say("ready", os.getpid())
        _line()
        try:
            with client.publisher(ArtifactIdentity.simple(model), specs_for(tensors),
                                  wait_timeout=wait) as pub:
                if pub.staged:
                    for name, t in tensors.items():
                        pub.write(name, t)
                outcome = pub.outcome
                key = pub.commit()
            _result({"key": key, "outcome": outcome, "joined": pub.joined})
        except HwrError as exc:
            _result({"error": _error_report(exc)})
        client.close()
        return 0

    if command == "publish-killed":  # SOCKET MODEL NBYTES: partial -> (go) -> result
        socket_path, model, nbytes = args[0], args[1], int(args[2])
        tensors = publication_tensors(nbytes)
        client = connect(socket_path)
        from hwr.client.publisher import specs_for

        try:
            pub = client.publisher(ArtifactIdentity.simple(model), specs_for(tensors))
            names = list(tensors)
            pub.write(names[0], tensors[names[0]])
            _say("partial")
            _line()  # the test kills the daemon here
            for name in names[1:]:
                pub.write(name, tensors[name])
            _say("committing")
            pub.commit()
            _result({"error": None})
        except BaseException as exc:  # report whatever escaped: the test asserts it is typed
            _result({"error": _error_report(exc)})
        return 0

    if command == "unprivileged":  # REFUSING_SOCKET ALLOWING_SOCKET KEY: drop to nobody, connect to each
        import grpc  # loaded before the privileges go
        import grpc._channel  # noqa: F401 - grpc imports it lazily; the checkout may be 0700

        import hwr.client.lease  # noqa: F401

        os.setgid(65534)
        os.setgroups([])
        os.setuid(65534)
        report: dict[str, Any] = {"uid": os.getuid()}
        for name, socket_path in (("refusing", args[0]), ("allowing", args[1])):
            try:
                with connect(socket_path) as client, client.acquire(args[2]) as lease:
                    report[name] = {"connected": True, "tensors": digests(lease.tensors),
                                    "lease_uids": [x["uid"] for x in client.leases()]}
            except HwrError as exc:  # PermissionDeniedError expected from the refusing daemon
                report[name] = {"connected": False, "error": _error_report(exc)}
        _result(report)
        return 0

    raise SystemExit(f"unknown worker command {command!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
