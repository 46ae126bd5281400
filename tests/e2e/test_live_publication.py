"""Publishing revisions for live updates: a large non-durable revision is laid out in several
files that the client hands over as it writes them (hwrd hashes each meanwhile), and the result
is exactly what a full hash at commit gives; a writer that keeps a handed-over file open or
mapped gets its commit refused. Real hwrd, the test process as a real client."""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable

import pytest
import torch

from hwr.client import ArtifactIdentity, connect
from hwr.client.errors import ChannelNotFound, InvalidRequest, PublicationFailed
from hwr.client.publisher import specs_for
from hwr.daemon.app.launcher import DaemonProcess

from .helpers import wait_until

MIB = 1 << 20


def revision(seed: int, count: int = 10, mib: int = 8) -> dict[str, torch.Tensor]:
    return {f"blocks.{i}.w": torch.arange(seed + i * mib * MIB // 4, seed + (i + 1) * mib * MIB // 4,
                                          dtype=torch.int32).view(torch.bfloat16)
            for i in range(count)}


@pytest.mark.timeout(240)
def test_a_large_revision_is_hashed_file_by_file_while_written(shared_hwrd: DaemonProcess) -> None:
    tensors = revision(1)  # 80 MiB: past the peer socket's size, several files
    with connect(shared_hwrd.socket) as client:
        handed: list[int] = []
        pub = client.publisher(ArtifactIdentity.simple("live/files"), specs_for(tensors), channel="live-files",
                               durable=False)
        real = pub._hand_over
        assert real is not None
        pub._hand_over = lambda pid, token, index: (handed.append(index), real(pid, token, index))[1]
        for name in pub.write_order(tensors):
            pub.write(name, tensors[name])
        key = pub.commit()
        info = client.inspect(key)
        assert len(info["files"]) > 1 and sorted(handed) == list(range(len(info["files"])))
        assert info["non_durable"] and info["channels"] == ["live-files"]
        verdict = client.verify(key)  # every byte re-hashed: the early digests were right
        assert verdict["ok"], verdict
        with client.acquire_channel("live-files") as lease:
            assert lease.key == key
            for name, t in tensors.items():
                assert torch.equal(lease.tensors[name].view(torch.int16), t.view(torch.int16)), name
        # publish() writes in file order and hands every file over the same way
        again = revision(2)
        key2 = client.publish(ArtifactIdentity.simple("live/files-2"), again, channel="live-files", durable=False)
        assert client.verify(key2)["ok"] and client.inspect_channel("live-files")["key"] == key2
        client.remove_channel("live-files")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("keep", ["descriptor", "mapping"])
def test_a_writer_that_keeps_a_handed_over_file_cannot_commit(shared_hwrd: DaemonProcess, keep: str) -> None:
    tensors = revision(3)
    with connect(shared_hwrd.socket) as client:
        pub = client.publisher(ArtifactIdentity.simple(f"live/keeps-{keep}"), specs_for(tensors),
                               channel="live-keeps", durable=False)
        order = pub.write_order(tensors)
        first = pub._placements[order[0]].file_index
        kept = os.dup(pub._fds[first])
        view = mmap.mmap(kept, 0) if keep == "mapping" else None
        if view is not None:
            os.close(kept)  # only the mapping holds the file now
        try:
            for name in order:
                pub.write(name, tensors[name])
            # hwrd hands out no writable descriptor of a publication with handed-over files
            with pytest.raises(PublicationFailed):
                client._connection.exchange({"op": "staging_fds", "publication_id": pub._publication_id,
                                             "publication_token": pub._token}, want_fds=True)
            with pytest.raises(PublicationFailed) as refused:
                pub.commit()
            assert "still holds" in refused.value.message
        finally:
            if view is not None:
                view.close()
            else:
                os.close(kept)
        with pytest.raises(ChannelNotFound):  # nothing was committed, so the channel was never set
            client.inspect_channel("live-keeps")


def small(seed: float) -> dict[str, torch.Tensor]:
    return {"a": torch.full((1000,), seed), "b": torch.arange(2000, dtype=torch.int64) + int(seed),
            "c": torch.full((3, 5), seed, dtype=torch.bfloat16)}


@pytest.mark.timeout(240)
def test_unchanged_tensors_are_taken_from_the_channels_revision_not_from_the_writer(
        shared_hwrd: DaemonProcess) -> None:
    with connect(shared_hwrd.socket) as client:
        first = small(1.0)
        base = client.publish(ArtifactIdentity.simple("live/reuse-1"), first, channel="live-reuse")
        second = {**first, "c": torch.full((3, 5), 2.0, dtype=torch.bfloat16)}
        with client.acquire(base) as lease:
            digests = {t.name: t.sha256 for t in lease.manifest.tensors}
        pub = client.publisher(ArtifactIdentity.simple("live/reuse-2"), specs_for(second), channel="live-reuse",
                               durable=False, verify=True, reuse_base=base,
                               reuse={"a": digests["a"], "b": digests["b"]})
        assert pub.reused == {"a", "b"}
        # A hostile writer puts other bytes where a reused tensor goes: they are not served.
        where = pub._placements["a"]
        os.pwrite(pub._fds[where.file_index], b"\xff" * where.nbytes, where.offset)
        for name in pub.write_order(second):
            pub.write(name, second[name])  # "a" and "b" are skipped
        key = pub.commit()
        assert client.verify(key)["ok"]
        with client.acquire(key) as lease:
            for name, tensor in second.items():
                assert torch.equal(lease.tensors[name], tensor), name
            mine = {t.name: t.sha256 for t in lease.manifest.tensors}
        assert mine["a"] == digests["a"] and mine["b"] == digests["b"] and mine["c"] != digests["c"]
        # client.publish finds the unchanged tensors itself; the artifact is the same either way
        third = {**second, "b": torch.arange(2000, dtype=torch.int64) * 3}
        key3 = client.publish(ArtifactIdentity.simple("live/reuse-3"), third, channel="live-reuse")
        plain = client.publish(ArtifactIdentity.simple("live/reuse-3"), third, reuse_unchanged=False)
        assert plain == key3 and client.verify(key3)["ok"]
        with client.acquire(key3) as lease:
            assert all(torch.equal(lease.tensors[n], t) for n, t in third.items())
        client.remove_channel("live-reuse")


@pytest.mark.timeout(240)
def test_a_file_of_unchanged_tensors_is_the_bases_file_and_not_hashed_again(shared_hwrd: DaemonProcess) -> None:
    first = revision(10)  # 80 MiB in several files
    second = {name: (t.clone() if i < 5 else t) for i, (name, t) in enumerate(sorted(first.items()))}
    for name in sorted(second)[:5]:
        second[name].view(torch.int16)[0] += 1  # the first half changes, the second does not
    with connect(shared_hwrd.socket) as client:
        base = client.publish(ArtifactIdentity.simple("live/whole-1"), first, channel="live-whole", durable=False)
        key = client.publish(ArtifactIdentity.simple("live/whole-2"), second, channel="live-whole", durable=False)
        old, new = client.inspect(base), client.inspect(key)
        shared = {f["sha256"] for f in old["files"]} & {f["sha256"] for f in new["files"]}
        assert shared, "no file was taken whole from the base"
        assert client.verify(key)["ok"]
        with client.acquire(key) as lease:
            for name, t in second.items():
                assert torch.equal(lease.tensors[name].view(torch.int16), t.view(torch.int16)), name
        client.remove_channel("live-whole")


@pytest.mark.timeout(120)
def test_reuse_that_does_not_fit_the_base_is_refused_and_a_missing_base_reuses_nothing(
        shared_hwrd: DaemonProcess) -> None:
    with connect(shared_hwrd.socket) as client:
        base = client.publish(ArtifactIdentity.simple("live/fit-1"), small(1.0))
        other = {"a": torch.full((999,), 1.0), "b": small(1.0)["b"]}
        with pytest.raises(InvalidRequest):
            client.publisher(ArtifactIdentity.simple("live/fit-2"), specs_for(other), reuse_base=base,
                             reuse={"a": "0" * 64})
        with pytest.raises(InvalidRequest):
            client.publisher(ArtifactIdentity.simple("live/fit-3"), specs_for(other), reuse_base=base,
                             reuse={"zzz": "0" * 64})
        pub = client.publisher(ArtifactIdentity.simple("live/fit-4"), specs_for(small(4.0)), reuse_base="0" * 64,
                               reuse={"a": "0" * 64})
        assert pub.reused == frozenset()  # no such base: the writer writes everything
        for name, tensor in small(4.0).items():
            pub.write(name, tensor)
        key = pub.commit()
        with client.acquire(key) as lease:
            assert torch.equal(lease.tensors["a"], small(4.0)["a"])


@pytest.mark.timeout(300)
def test_a_publisher_that_dies_while_its_files_are_hashed_leaves_hwrd_serving(
        spawn_daemon: Callable[..., DaemonProcess]) -> None:
    """The session's end aborts the publication, whose staging is truncated: never while hwrd
    still hashes a handed-over file of it (through a mapping: that would be a SIGBUS)."""
    daemon = spawn_daemon()
    tensors = revision(20, count=8, mib=32)  # 256 MiB: 8 files of 32 MiB, each hashed for a while
    for attempt in range(4):
        client = connect(daemon.socket)
        pub = client.publisher(ArtifactIdentity.simple(f"live/dies-{attempt}"), specs_for(tensors),
                               channel="live-dies", durable=False)
        order = pub.write_order(tensors)
        for name in order[: len(order) - 1]:  # every file but the last handed over
            pub.write(name, tensors[name])
        time.sleep(0.01 * attempt)
        client.close()  # the session ends now: hwrd aborts while it hashes the files handed over
        time.sleep(0.3)
        assert daemon.proc is not None and daemon.proc.poll() is None, f"hwrd died ({daemon.proc.returncode})"
    with connect(daemon.socket) as client:
        key = client.publish(ArtifactIdentity.simple("live/after-dies"), revision(21, count=2, mib=1))
        assert client.verify(key)["ok"]
        wait_until(lambda: client.status()["publications"] == 0, 30)
