"""Live weight updates end to end: DLO workers follow an hwrd channel while revisions are published.

Real hwrd, real worker processes (``live_worker.py``: a DiT restored from a lease acquired
through the channel, streamed by DLO with ``live_updates=True``, following the channel), real
gloo groups for AllGather. Every pass's output is compared with a fresh model loaded with the
revision the worker says the pass ran on, and the keys must only move forward in publication
order: a pass never mixes revisions and never goes back.
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from zygote import popen

from hwr.client import ArtifactIdentity, connect
from hwr.daemon.app.launcher import DaemonProcess
from hwr.demo_model import DemoConfig, build_skeleton

from .helpers import wait_until
from .live_worker import digest, inputs

WORKER = Path(__file__).with_name("live_worker.py")
CONFIG = {"hidden": 32, "depth": 3, "heads": 2, "in_channels": 8}
REVISIONS = 20


# ------------------------------------------------------------------------------------ revisions
def revision_tensors(seed: int, *, broken: bool = False) -> dict[str, torch.Tensor]:
    """Revision ``seed`` of the tiny DiT (bf16, every tensor); ``broken``: one bias is shorter."""
    gen = torch.Generator().manual_seed(seed)
    skeleton = build_skeleton(DemoConfig(**CONFIG))
    tensors = {name: (torch.randn(tuple(t.shape), generator=gen) * 0.05).to(torch.bfloat16)
               for name, t in skeleton.state_dict().items()}
    if broken:
        tensors["blocks.1.mlp.fc1.bias"] = tensors["blocks.1.mlp.fc1.bias"][:-8].clone()
    return tensors


def expected_digests(tensors: dict[str, torch.Tensor], seeds: Sequence[int]) -> dict[int, str]:
    """What a fresh, unhooked model loaded with ``tensors`` outputs for each worker's input."""
    config = DemoConfig(**CONFIG)
    model = build_skeleton(config, device="cpu")
    model.load_state_dict(tensors)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: the same kernels, the same reduction order
    try:
        with torch.no_grad():
            return {seed: digest(model(*inputs(config, seed))) for seed in seeds}
    finally:
        torch.set_num_threads(threads)


class Publisher:
    """Commits revisions to ``channel`` and remembers each one's expected outputs."""

    def __init__(self, client: Any, channel: str, seeds: Sequence[int]) -> None:
        self.client, self.channel, self.seeds = client, channel, list(seeds)
        self.keys: list[str] = []  # good revisions, in publication order
        self.want: dict[str, dict[int, str]] = {}

    def publish(self, seed: int, *, broken: bool = False) -> str:
        tensors = revision_tensors(seed, broken=broken)
        identity = ArtifactIdentity.simple(f"live/{self.channel}", revision=f"r{seed}{'-broken' if broken else ''}")
        key = self.client.publish(identity, tensors, channel=self.channel)
        if not broken:
            self.keys.append(key)
            self.want[key] = expected_digests(tensors, self.seeds)
        return key


# ------------------------------------------------------------------------------------ workers
class LiveWorker:
    """A ``live_worker.py`` process (forked from the tests' zygote, which imported torch and hwr
    once: ``zygote.popen``); its stdout lines are read by a thread."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.proc = popen([sys.executable, str(WORKER), json.dumps(spec)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        self.on: str | None = None
        self.refused: list[str] = []
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()  # type: ignore[arg-type]

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            words = line.split()
            if words[:1] == ["on"]:
                self.on = words[1]
            elif words[:1] == ["refused"]:
                self.refused.append(words[1])
            self.lines.put(line.strip())

    def expect(self, word: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"worker {self.spec['seed']}: no {word!r}; stderr:\n{self.tail}") from None
            if line == word:
                return

    @property
    def tail(self) -> str:
        return "".join(self.stderr)[-3000:]

    def stop(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write("stop\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            # AllGather ranks stop together when any one is told to (live_worker.py), so a rank
            # may be gone by the time it is told; its exit status and output are checked below.
            pass
        assert self.proc.wait(120) == 0, self.tail
        return json.loads(Path(self.spec["out"]).read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)


@contextmanager
def live_workers(daemon: DaemonProcess, tmp: Path, channel: str, seeds: Sequence[int], *, allgather: bool = False,
                 **extra: Any) -> Iterator[list[LiveWorker]]:
    workers: list[LiveWorker] = []
    try:
        for rank, seed in enumerate(seeds):
            spec = {"socket": str(daemon.socket), "channel": channel, "config": CONFIG, "seed": seed,
                    "out": str(tmp / f"worker{seed}.json"), **extra.get(f"worker{rank}", {})}
            if allgather:
                spec.update(world=len(seeds), rank=rank, rdzv=str(tmp / "rdzv"))
            workers.append(LiveWorker(spec))
        for worker in workers:
            worker.expect("ready")
        yield workers
    finally:
        for worker in workers:
            worker.kill()


def until(predicate: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    try:
        wait_until(predicate, timeout)
    except AssertionError as exc:
        raise AssertionError(f"timed out waiting until {what}") from exc


def check_passes(result: dict[str, Any], seed: int, publisher: Publisher) -> None:
    """No failed pass; each equals a fresh model of its revision; revisions never go back."""
    assert result["failures"] == []
    order = {key: index for index, key in enumerate(publisher.keys)}
    last = -1
    for key, out, _, _ in result["passes"]:
        assert key in order, f"a pass ran on {key}, which was never a good revision"
        assert out == publisher.want[key][seed], f"worker {seed}: a pass on {key[:12]} differs from a fresh model"
        assert order[key] >= last, "a worker went back to an older revision"
        last = order[key]
    assert result["key"] == publisher.keys[-1]


def superseded_are_evictable(client: Any, publisher: Publisher, extra: Sequence[str] = ()) -> None:
    for key in [*publisher.keys[:-1], *extra]:
        client.evict(key)  # raises ActiveLease if any worker still held or mapped it
    present = {a["key"] for a in client.list_artifacts()}
    assert present & {*publisher.keys[:-1], *extra} == set()


# ------------------------------------------------------------------------------------ tests
@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize(("workers", "allgather"), [(2, False), (4, False), (2, True)],
                         ids=["2-rank-local", "4-rank-local", "allgather-dp2"])
def test_workers_follow_twenty_revisions_and_refuse_a_broken_one(
    hwrd: DaemonProcess, short_tmp: Path, workers: int, allgather: bool
) -> None:
    seeds = [11 + i for i in range(workers)]  # different inputs per worker (DP ranks: own requests)
    channel = f"live-{workers}{'-ag' if allgather else ''}"
    with connect(hwrd.socket) as client:
        publisher = Publisher(client, channel, seeds)
        publisher.publish(0)
        with live_workers(hwrd, short_tmp, channel, seeds, allgather=allgather) as running:
            bad = ""
            for seed in range(1, REVISIONS + 1):
                if seed == REVISIONS // 2:  # a revision that breaks the contract: every worker refuses it
                    bad = publisher.publish(1000, broken=True)
                    until(lambda key=bad: all(key in w.refused for w in running), "every worker refused the broken one")
                publisher.publish(seed)
                time.sleep(0.15)  # a few passes per revision; some revisions coalesce on slow workers
            newest = publisher.keys[-1]
            until(lambda: all(w.on == newest for w in running), "every worker runs the newest revision")
            held = client.leases()
            assert {lease["key"] for lease in held} == {newest}
            assert len(held) == workers
            superseded_are_evictable(client, publisher, [bad])
            results = [worker.stop() for worker in running]
    for seed, result in zip(seeds, results, strict=True):
        check_passes(result, seed, publisher)
        assert bad in result["refused"]
        assert result["switches"] >= 2
    if allgather:  # the ranks switched at the same pass: identical key sequences
        assert [p[0] for p in results[0]["passes"]] == [p[0] for p in results[1]["passes"]]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_worker_killed_mid_switch_costs_the_others_nothing(hwrd: DaemonProcess, short_tmp: Path) -> None:
    seeds = [21, 22, 23]
    with connect(hwrd.socket) as client:
        publisher = Publisher(client, "live-kill", seeds)
        publisher.publish(0)
        with live_workers(hwrd, short_tmp, "live-kill", seeds, worker0={"hold_switch": 2}) as running:
            victim, others = running[0], running[1:]
            publisher.publish(1)
            until(lambda: all(w.on == publisher.keys[-1] for w in running), "every worker runs revision 1")
            publisher.publish(2)
            victim.expect("holding")  # inside its second switch: old and new revision both leased
            victim.kill()
            for seed in (3, 4):
                publisher.publish(seed)
                time.sleep(0.15)
            until(lambda: all(w.on == publisher.keys[-1] for w in others), "the others run the newest revision")
            held = client.leases()
            assert {lease["key"] for lease in held} == {publisher.keys[-1]}
            assert {lease["pid"] for lease in held} == {w.proc.pid for w in others}
            superseded_are_evictable(client, publisher)
            results = [worker.stop() for worker in others]
    for seed, result in zip(seeds[1:], results, strict=True):
        check_passes(result, seed, publisher)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_workers_keep_serving_through_a_daemon_restart_and_follow_the_channel_again(
    spawn_daemon: Callable[..., DaemonProcess], short_tmp: Path
) -> None:
    daemon = spawn_daemon()
    seeds = [31, 32]
    with connect(daemon.socket) as client:
        publisher = Publisher(client, "live-restart", seeds)
        for seed in (0, 1):
            publisher.publish(seed)
        with live_workers(daemon, short_tmp, "live-restart", seeds) as running:
            until(lambda: all(w.on == publisher.keys[-1] for w in running), "every worker runs revision 1")
            daemon.kill()  # SIGKILL: sessions, watches and leases end with the process
            down = time.monotonic()
            time.sleep(0.5)
            spawn_daemon(daemon=daemon)
            up = time.monotonic()
            for seed in (2, 3):
                publisher.publish(seed)  # the test's client reconnects too
                time.sleep(0.15)
            until(lambda: all(w.on == publisher.keys[-1] for w in running), "every worker follows again")
            assert {lease["key"] for lease in client.leases()} == {publisher.keys[-1]}
            superseded_are_evictable(client, publisher)
            results = [worker.stop() for worker in running]
    for seed, result in zip(seeds, results, strict=True):
        check_passes(result, seed, publisher)
        # Passes went on while hwrd was down: the mappings stay valid without the daemon.
        assert any(down < ended < up for _, _, _, ended in result["passes"])
        assert result["watches"] >= 1
