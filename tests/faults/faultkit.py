"""What every fault test ends with: the store's invariants, checked from outside the daemon.

``check_invariants`` asserts, after a fault:

- **no partial artifact visible**: every entry of ``artifacts/`` is a 64-hex key with a READY
  marker, a manifest that parses, and payloads whose SHA-256 matches the manifest (hashed here,
  independently of the daemon); and everything the daemon lists is such an entry;
- **no leased artifact lost**: each ``held`` key is still listed and its bytes are intact;
- **no leaked lease, staging file or descriptor**: the daemon's leases belong only to
  ``live_pids``, no publication is in flight and ``tmp/`` is empty (waited for: session ends are
  asynchronous), and no descriptor of the daemon points into ``artifacts/`` or ``tmp/``;
- **daemon serving**: it answers status and a fresh acquire.

Also ``Control`` (the ``HWR_TEST_FAULTS`` file, see ``hwr.daemon.app.fault_injection``), ``Worker``
(a ``fault_worker.py`` process, started afresh or forked from the tests' shared zygote,
``tests/zygote.py``) and ``Outcome`` (what a test tried and lost, for the summary).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hwr.client import ArtifactIdentity, connect
from hwr.client.identity import is_key
from hwr.client.manifest import Manifest

if TYPE_CHECKING:
    from zygote import Forked

WORKER = Path(__file__).with_name("fault_worker.py")


@dataclass
class Outcome:
    """What one fault test tried and found, printed by conftest's terminal summary.

    ``tried``: faults injected; ``lost``: losses the checks found, counted *before* the assertion
    that fails on them; ``failed``: set at teardown from the test's own result, so a failing run
    never prints "nothing lost" (the ``outcome`` fixture records it)."""

    kind: str = ""
    tried: int = 0
    lost: int = 0
    failed: bool = False


OUTCOMES: list[Outcome] = []

N = 1 << 16  # float32 elements of the test artifacts' one tensor (256 KiB)


def tensors(n: int, numel: int = N) -> dict[str, torch.Tensor]:
    """The content of model ``m-<n>``: every element equals ``n`` (a reader can check any byte)."""
    return {"w": torch.full((numel,), float(n), dtype=torch.float32)}


def publish(client, name: str, n: int, numel: int = N) -> str:  # type: ignore[no-untyped-def]
    return client.publish(ArtifactIdentity.simple(name), tensors(n, numel))


def wait_for(predicate, timeout: float, what) -> None:  # type: ignore[no-untyped-def]
    """Poll ``predicate``; ``what`` (text, or a callable giving text) names it in the failure."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")
        time.sleep(0.05)


def store_fds(pid: int, root: Path) -> list[str]:
    """Descriptors of ``pid`` that point into the store's artifacts/ or tmp/."""
    inside = (str(Path(os.path.realpath(root)) / "artifacts") + "/", str(Path(os.path.realpath(root)) / "tmp") + "/")
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(inside):
            out.append(target)
    return out


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def check_on_disk(root: Path) -> list[str]:
    """Every artifact directory is complete and its bytes match its manifest; returns the keys.

    Artifacts with a deny marker are skipped (a test corrupted them on purpose; the daemon must
    not serve them, which ``check_invariants`` asserts through the listing).
    """
    keys = []
    for entry in sorted(os.listdir(root / "artifacts")):
        path = root / "artifacts" / entry
        assert is_key(entry), f"stray entry {entry} in artifacts/"
        if (root / "deny" / f"{entry}.json").exists():
            continue
        names = set(os.listdir(path))
        assert "READY.json" in names and "manifest.json" in names, f"{entry} is partial: {sorted(names)}"
        manifest = Manifest.from_json((path / "manifest.json").read_bytes())
        assert manifest.key == entry
        for record in manifest.files:
            digest = hashlib.sha256((path / record.name).read_bytes()).hexdigest()
            assert digest == record.sha256, f"{entry}/{record.name} does not match its manifest"
        keys.append(entry)
    return keys


def model_number(lease) -> int:  # type: ignore[no-untyped-def]
    return int(lease.manifest.identity.source.model_id.rsplit("-", 1)[1])


def check_invariants(daemon, *, held: Iterable[str] = (), live_pids: Iterable[int] = (),  # type: ignore[no-untyped-def]
                     settle_s: float = 20.0, outcome: Outcome | None = None) -> dict[str, Any]:
    """The invariants above; held artifacts found missing or changed are added to
    ``outcome.lost`` before the assertion that fails on them."""
    outcome = outcome or Outcome()
    root = Path(daemon.root)
    held, live = set(held), set(live_pids)
    with connect(daemon.socket) as client:
        me = os.getpid()

        state: dict[str, Any] = {}

        def settled() -> bool:
            state["publications"] = client.status()["publications"]
            state["foreign_leases"] = [x for x in client.leases() if x["pid"] not in live | {me}]
            state["tmp"] = os.listdir(root / "tmp")
            return not (state["publications"] or state["foreign_leases"] or state["tmp"])

        wait_for(settled, settle_s, lambda: f"dead clients' leases, publications and staging to go: {state}")
        on_disk = set(check_on_disk(root))
        listed = {a["key"] for a in client.list_artifacts()}
        assert listed <= on_disk, f"the daemon lists artifacts that are not complete on disk: {listed - on_disk}"
        lost = held - listed
        outcome.lost += len(lost)
        assert not lost, f"leased artifacts were lost: {lost}"
        for key in held:
            with client.acquire(key) as lease:
                intact = bool((lease.tensors["w"] == float(model_number(lease))).all())
                outcome.lost += not intact
                assert intact, f"{key} bytes changed"
        probe = publish(client, f"probe-{uuid.uuid4().hex[:8]}", 5, 1024)
        with client.acquire(probe) as lease:
            assert float(lease.tensors["w"][0]) == 5.0
        client.evict(probe)
    leaked = store_fds(daemon.pid, root)
    assert not leaked, f"the daemon still holds store descriptors: {leaked}"
    return {"artifacts": len(on_disk), "held": len(held)}


class Control:
    """The fault-injection control file of one daemon (rewritten atomically)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "faults.json"
        self.log = directory / "faults.log"
        self.set()

    def set(self, **rules: Any) -> None:
        rules.setdefault("log", str(self.log))
        self.log.write_text("")
        tmp = self.path.with_name(f".faults.{uuid.uuid4().hex}")
        tmp.write_text(json.dumps(rules))
        os.rename(tmp, self.path)
        time.sleep(0.01)  # distinct mtime_ns even on coarse-timestamp filesystems

    def calls(self) -> list[tuple[int, str, str]]:
        out = []
        for line in self.log.read_text().splitlines():
            n, op, verdict = line.split()
            out.append((int(n), op, verdict))
        return out


class Worker:
    """A ``fault_worker.py`` process (line protocol on stdin/stdout; stderr goes to a file),
    started afresh, or with ``forked`` from the tests' shared zygote (``tests/zygote.py``: torch
    and the client imported once; a process of its own to hwrd, without an interpreter start and
    a torch import each; a fresh interpreter where the zygote cannot serve).

    ``expect(word)`` returns the rest of the worker's next line, which must start with ``word``:
    any other answer (a holder's ``bad``), the worker's exit, or ``timeout`` seconds of silence
    fail the test with a message that quotes the worker's stderr, instead of waiting for the
    pytest timeout."""

    def __init__(self, *args: str, timeout: float = 60.0, forked: bool = False) -> None:
        self.timeout = timeout
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in kill()
        start: Callable[..., subprocess.Popen[str] | Forked] = subprocess.Popen
        if forked:
            # Imported here: the attack programs that import this module run without tests/ on
            # their path, and never fork workers.
            import zygote
            start = zygote.popen
        self.proc = start(
            [sys.executable, str(WORKER), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._stderr, text=True, bufsize=1)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()[-3000:]

    def expect(self, word: str, timeout: float | None = None) -> str:
        try:
            line = self._lines.get(timeout=self.timeout if timeout is None else timeout)
        except queue.Empty:
            raise AssertionError(f"worker {self.pid} gave no {word!r} line in time; stderr: {self.stderr()}") from None
        if line is None:
            self.proc.wait(10)
            raise AssertionError(f"worker exited ({self.proc.returncode}) before {word!r}: {self.stderr()}")
        if not line.startswith(word):
            raise AssertionError(f"worker {self.pid} answered {line.strip()!r} instead of {word!r}; "
                                 f"stderr: {self.stderr()}")
        return line[len(word):].strip()

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self._stderr.close()

    def stop(self) -> dict[str, Any]:
        """Ask a churn worker to finish; returns its counts (``ops``, ``typed``, ``bad``, ...)."""
        self.send("stop")
        result = json.loads(self.expect("result"))
        self.proc.wait(30)
        return result
