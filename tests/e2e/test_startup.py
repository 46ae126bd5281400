"""Worker startup end to end: modes, cold -> warm, fallbacks, injected failures, concurrent cold starts."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hwr.client import ArtifactIdentity, connect
from hwr.client.errors import StartupFailed
from hwr.client.post_load import PublicationOutcome
from hwr.client.resolver import Outcome, resolve
from hwr.demo_model import DemoConfig, build_skeleton, canonical_checkpoint, load_canonical
from hwr.dlo_backend.loader import LoaderState, start_worker

CFG = DemoConfig(hidden=64, depth=3, heads=4)
IDENTITY = ArtifactIdentity.simple("test/dit", dtype="bfloat16")
X = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(1))
T = torch.tensor([3.0, 700.0])


@pytest.fixture
def checkpoint(short_tmp: Path) -> Path:
    return canonical_checkpoint(CFG, short_tmp / "ckpt" / "model.safetensors")


class Counter:
    def __init__(self, checkpoint: Path) -> None:
        self.checkpoint = checkpoint
        self.calls = 0

    def __call__(self) -> torch.nn.Module:
        self.calls += 1
        return load_canonical(CFG, self.checkpoint)


def _start(mode: str, socket: Path | str, canonical: Counter, **kw) -> object:  # type: ignore[no-untyped-def]
    return start_worker(identity=IDENTITY, build_skeleton=lambda: build_skeleton(CFG), load_canonical=canonical,
                        mode=mode, socket=str(socket), **kw)


def _lease_count(socket: Path) -> int:
    with connect(socket) as c:
        return len(c.leases())


@pytest.mark.timeout(120)
def test_cold_then_warm_is_bit_identical_and_warm_loads_nothing(hwrd, checkpoint: Path) -> None:  # type: ignore[no-untyped-def]
    reference = load_canonical(CFG, checkpoint)(X, T)
    canonical = Counter(checkpoint)
    cold = _start("preferred", hwrd.socket, canonical)
    assert cold.outcome is Outcome.CANONICAL_FALLBACK
    assert cold.resolution.report.failure.code == "LOCAL_MISS"
    cold_out = [cold.model(X, T) for _ in range(3)]
    report = cold.publication.result(60)
    assert report.outcome is PublicationOutcome.PUBLISHED and report.key == IDENTITY.key
    cold.close()
    assert canonical.calls == 1

    with connect(hwrd.socket) as c:
        created = {a["key"]: a["created_at"] for a in c.list_artifacts()}
    warm = _start("required", hwrd.socket, canonical)
    assert warm.outcome is Outcome.LOCAL_HIT
    assert warm.states[-1] is LoaderState.IN_SERVICE and LoaderState.BACKEND_READY in warm.states
    assert canonical.calls == 1, "a warm start must not materialize canonical tensors"
    assert warm.publication is None
    # On a CPU device the running block computes on the hwrd lease's mapped pages (zero copy).
    regions = warm.offload.backend._revisions.lease.mapped_regions
    assert warm.offload.stats.mode == "bind" and warm.offload.stats.slot_bytes == 0
    bound: list[bool] = []
    for block in warm.model.blocks:
        block.attn.register_forward_pre_hook(lambda *_, block=block: bound.append(all(
            any(r.address <= p.data_ptr() < r.address + r.length for r in regions) for p in block.parameters())))
    warm_out = [warm.model(X, T) for _ in range(3)]
    assert bound == [True] * (3 * CFG.depth)
    for out in (*cold_out, *warm_out):
        assert torch.equal(out, reference)
    assert _lease_count(hwrd.socket) == 1
    warm.close()
    assert _lease_count(hwrd.socket) == 0
    with connect(hwrd.socket) as c:
        assert {a["key"]: a["created_at"] for a in c.list_artifacts()} == created  # nothing rebuilt


@pytest.mark.timeout(60)
def test_preferred_with_the_daemon_down_falls_back_and_says_why(short_tmp: Path, checkpoint: Path) -> None:
    canonical = Counter(checkpoint)
    started = _start("preferred", short_tmp / "absent.sock", canonical)
    assert started.outcome is Outcome.CANONICAL_FALLBACK
    failure = started.resolution.report.failure
    assert failure.code == "DAEMON_UNAVAILABLE" and failure.retryable
    assert started.publication is None  # nowhere to publish
    assert torch.equal(started.model(X, T), load_canonical(CFG, checkpoint)(X, T))
    started.close()


@pytest.mark.timeout(60)
def test_required_with_the_daemon_down_fails_typed(short_tmp: Path, checkpoint: Path) -> None:
    canonical = Counter(checkpoint)
    with pytest.raises(StartupFailed) as info:
        _start("required", short_tmp / "absent.sock", canonical)
    assert info.value.report.outcome is Outcome.FAILED
    assert info.value.report.failure.code == "DAEMON_UNAVAILABLE"
    assert canonical.calls == 0


@pytest.mark.timeout(60)
def test_required_on_a_miss_fails(hwrd, checkpoint: Path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(StartupFailed) as info:
        _start("required", hwrd.socket, Counter(checkpoint))
    assert info.value.report.failure.code == "LOCAL_MISS"


PLANNING = [LoaderState.LEASE_OWNED_BY_LOADER, LoaderState.RESTORE_PLANNED]
AFTER_COMMIT = [LoaderState.COMMIT_STARTED, LoaderState.CARRIER_OWNED, LoaderState.BACKEND_OWNED,
                LoaderState.BACKEND_READY, LoaderState.IN_SERVICE]


@pytest.mark.timeout(180)
def test_failure_at_every_transaction_state_follows_the_rules(hwrd, checkpoint: Path) -> None:  # type: ignore[no-untyped-def]
    reference = load_canonical(CFG, checkpoint)(X, T)
    with connect(hwrd.socket) as c:
        c.publish(IDENTITY, load_canonical(CFG, checkpoint).state_dict())
    for state in PLANNING + AFTER_COMMIT:
        fired: list[LoaderState] = []

        def inject(entered: LoaderState, state: LoaderState = state, fired: list[LoaderState] = fired) -> None:
            if entered is state and not fired:  # once: the recovery path enters IN_SERVICE again
                fired.append(entered)
                raise OSError(f"injected at {state.value}")

        canonical = Counter(checkpoint)
        with pytest.raises(StartupFailed) as info:
            _start("required", hwrd.socket, canonical, fault=inject)
        assert "injected" in info.value.details["cause"], state
        assert canonical.calls == 0
        assert _lease_count(hwrd.socket) == 0, f"lease left open after a failure at {state.value}"

        fired.clear()
        canonical = Counter(checkpoint)
        started = _start("preferred", hwrd.socket, canonical, fault=inject)
        assert started.outcome is Outcome.CANONICAL_FALLBACK, state
        assert started.recovered_from == ("planning" if state in PLANNING else "commit"), state
        assert canonical.calls == 1
        assert started.publication is None
        assert torch.equal(started.model(X, T), reference), state
        assert _lease_count(hwrd.socket) == 0, f"lease left open after recovering from {state.value}"
        started.close()


DISABLED_PROBE = textwrap.dedent(
    """
    import json, sys
    import torch
    from hwr.client import ArtifactIdentity
    from hwr.client.resolver import resolve
    from hwr.dlo_backend.loader import start_worker
    from hwr.demo_model import DemoConfig, build_skeleton

    cfg = DemoConfig(hidden=64, depth=3, heads=4)
    weights = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in build_skeleton(cfg).state_dict().items()}

    def canonical():
        m = build_skeleton(cfg)
        m.load_state_dict(weights, assign=True)
        return m

    events = []
    sys.addaudithook(lambda ev, args: events.append(ev) if ev in ("open", "socket.__new__", "socket.connect",
                                                                  "os.open") else None)
    ident = ArtifactIdentity.simple("test/dit")
    r = resolve(ident, "disabled", socket=sys.argv[1])
    s = start_worker(identity=ident, build_skeleton=lambda: build_skeleton(cfg), load_canonical=canonical,
                     mode="disabled", socket=sys.argv[1])
    s.close()
    print(json.dumps({"events": events, "outcome": r.outcome.value, "worker": s.outcome.value}))
    """
)


@pytest.mark.timeout(60)
def test_disabled_mode_opens_no_socket_and_no_file(short_tmp: Path) -> None:
    from hwr.daemon.app.launcher import DaemonProcess

    daemon = DaemonProcess(short_tmp / "store", short_tmp / "d.sock", "--log-level", "debug").start()
    try:
        proc = subprocess.Popen([sys.executable, "-c", DISABLED_PROBE, str(daemon.socket)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        result = json.loads(out.strip().splitlines()[-1])
        assert result["outcome"] == "canonical_direct" and result["worker"] == "canonical_direct"
        assert result["events"] == [], result["events"]
    finally:
        daemon.stop()
    # The daemon's debug log records every session with its peer pid: the probe made none.
    log = daemon.log.read_text()
    assert " ended: " in log, "the daemon did not log sessions; the check below would prove nothing"
    assert f"(pid {proc.pid})" not in log


COLD_WORKER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from hwr.client import ArtifactIdentity
    from hwr.dlo_backend.loader import start_worker
    from hwr.demo_model import DemoConfig, build_skeleton, load_canonical

    cfg = DemoConfig(hidden=64, depth=3, heads=4)
    go = Path(sys.argv[3])
    while not go.exists():
        time.sleep(0.01)
    s = start_worker(identity=ArtifactIdentity.simple("test/dit", dtype="bfloat16"),
                     build_skeleton=lambda: build_skeleton(cfg),
                     load_canonical=lambda: load_canonical(cfg, Path(sys.argv[2])),
                     mode="preferred", socket=sys.argv[1])
    # A worker that resolved after the other's commit is warm and publishes nothing.
    publication = s.publication.result(60).outcome.value if s.publication is not None else "none"
    s.close()
    print(json.dumps({"outcome": s.outcome.value, "publication": publication}))
    """
)


@pytest.mark.timeout(120)
def test_two_workers_starting_cold_publish_once(hwrd, checkpoint: Path, short_tmp: Path) -> None:  # type: ignore[no-untyped-def]
    go = short_tmp / "go"
    procs = [subprocess.Popen([sys.executable, "-c", COLD_WORKER, str(hwrd.socket), str(checkpoint), str(go)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    go.touch()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=100)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    cold = [r for r in results if r["outcome"] == "canonical_fallback"]
    assert cold, results  # the first to resolve always starts cold
    assert all(r["outcome"] in ("canonical_fallback", "local_hit") for r in results), results
    publications = sorted(r["publication"] for r in results)
    assert publications.count("published") == 1, publications
    assert set(publications) <= {"published", "joined", "already_present", "none"}
    assert all(r["publication"] == "none" for r in results if r["outcome"] == "local_hit")
    with connect(hwrd.socket) as c:
        assert [a["key"] for a in c.list_artifacts()] == [IDENTITY.key]


@pytest.mark.timeout(60)
def test_resolve_returns_a_report_with_attempts(hwrd) -> None:  # type: ignore[no-untyped-def]
    res = resolve(IDENTITY, "preferred", socket=str(hwrd.socket))
    try:
        report = res.report.to_dict()
        assert report["outcome"] == "canonical_fallback"
        assert report["attempts"][0]["stage"] == "lookup" and report["attempts"][0]["result"] == "miss"
        assert report["attempts"][0]["action"] == "canonical_fallback"
        assert report["elapsed_s"] >= report["attempts"][0]["elapsed_s"] >= 0
    finally:
        if res.client is not None:
            res.client.close()
