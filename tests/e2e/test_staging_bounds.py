"""Acceptance: a publisher cannot make the disk hold much more than its reservation.

The publisher is this test process holding its real staging descriptors. It allocates blocks
past the end of a staging file (``fallocate(FALLOC_FL_KEEP_SIZE)``: the size stays as planned),
keeps writing after its publication was cancelled, and only then lets go. hwrd must refuse the
commit, cancel the publication at the next housekeeping round, take the blocks back although the
descriptor stays open, and remove the file once the descriptor is closed. A small publication
stages in a sealed memfd instead, which cannot grow at all.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hwr.client import ArtifactIdentity, connect
from hwr.client.errors import ManifestCorrupt, PublicationFailed
from hwr.client.publisher import specs_for
from hwr.daemon.app.launcher import DaemonProcess

from .helpers import wait_until

MIB = 1 << 20
FALLOC_FL_KEEP_SIZE = 1
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def allocate_past_end(fd: int, nbytes: int) -> None:
    if _libc.fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, nbytes) != 0:
        code = ctypes.get_errno()
        if code == errno.EPERM:  # a sealed memfd
            raise PermissionError(code, os.strerror(code))
        pytest.skip(f"fallocate(KEEP_SIZE) unsupported here: {os.strerror(code)}")


def staged(client: object, name: str) -> tuple[object, int]:
    """A staged publication of one 1 MiB tensor and a duplicate of its staging descriptor."""
    tensors = {"w": torch.zeros(MIB // 4)}
    pub = client.publisher(ArtifactIdentity.simple(name), specs_for(tensors))  # type: ignore[attr-defined]
    pub.write("w", tensors["w"])
    return pub, os.dup(pub._fds[0])


def commit_raw(client: object, pub: object) -> str:
    """``publish_commit`` on the peer socket, keeping the publication if it fails (as
    ``Publisher.commit`` would not: it aborts on a failure)."""
    request = {"op": "publish_commit", "publication_id": pub._publication_id}  # type: ignore[attr-defined]
    reply, _fds, _tail = client._connection.exchange(request, want_fds=False)  # type: ignore[attr-defined]
    return str(reply["key"])


def tmp_entries(root: Path) -> list[str]:
    return sorted(os.listdir(root / "tmp"))


@pytest.mark.timeout(120)
def test_blocks_allocated_past_the_end_fail_the_commit(
        spawn_daemon: Callable[..., DaemonProcess], short_tmp: Path) -> None:
    # File staging (memfds off) and no housekeeping: only the commit's check acts.
    daemon = spawn_daemon("--housekeeping-interval-s", "3600", "--memfd-staging-max-bytes", "0")
    with connect(daemon.socket) as client:
        pub, fd = staged(client, "bounds/commit")
        allocate_past_end(fd, 64 * MIB)
        assert os.fstat(fd).st_size < 2 * MIB <= os.fstat(fd).st_blocks * 512  # size as planned
        os.close(fd)
        with pytest.raises(ManifestCorrupt) as refused:
            pub.commit()  # type: ignore[attr-defined]
        assert refused.value.details["allocated"] >= 64 * MIB
        assert client.status()["artifacts"] == 0
    assert tmp_entries(daemon.root) == []


@pytest.mark.timeout(120)
def test_an_overgrown_staging_is_cancelled_and_reclaimed_while_the_writer_holds_it(
        spawn_daemon: Callable[..., DaemonProcess], short_tmp: Path) -> None:
    daemon = spawn_daemon("--housekeeping-interval-s", "0.2", "--memfd-staging-max-bytes", "0")
    with connect(daemon.socket) as client:
        pub, fd = staged(client, "bounds/cancel")
        allocate_past_end(fd, 64 * MIB)
        wait_until(lambda: client.status()["publications"] == 0, 30)  # cancelled by housekeeping
        # Truncated by hwrd although this process still holds the descriptor: the blocks are back.
        wait_until(lambda: os.fstat(fd).st_blocks == 0 and os.fstat(fd).st_size == 0, 30)
        assert len(tmp_entries(daemon.root)) == 1  # kept (and watched) while a writer holds it
        os.pwrite(fd, b"\xff" * (8 * MIB), 0)  # the writer goes on after the cancellation
        wait_until(lambda: os.fstat(fd).st_size == 0, 30)  # ... and loses it again at the next round
        os.close(fd)
        pub._close_fds()  # type: ignore[attr-defined]  # the client library's own descriptor too
        wait_until(lambda: tmp_entries(daemon.root) == [], 30)  # let go: removed for good
        with pytest.raises(PublicationFailed):
            pub.commit()  # type: ignore[attr-defined]
        assert client.status()["artifacts"] == 0


@pytest.mark.timeout(120)
def test_a_small_publication_stages_in_a_sealed_memfd_that_cannot_grow(
        spawn_daemon: Callable[..., DaemonProcess], short_tmp: Path) -> None:
    daemon = spawn_daemon()
    with connect(daemon.socket) as client:
        pub, fd = staged(client, "bounds/memfd")
        planned = os.fstat(fd).st_size
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
        for grow in (lambda: allocate_past_end(fd, 64 * MIB), lambda: os.posix_fallocate(fd, 0, 64 * MIB),
                     lambda: os.pwrite(fd, b"x", planned), lambda: os.ftruncate(fd, 64 * MIB)):
            with pytest.raises(PermissionError):
                grow()
        assert os.fstat(fd).st_size == planned
        mapped = mmap.mmap(fd, planned)  # even a writable mapping held across the commit ...
        pub._close_fds()  # type: ignore[attr-defined]
        key = commit_raw(client, pub)
        mapped[planned - 16:] = b"\xff" * 16  # ... changes nothing that was committed
        mapped.close()
        os.close(fd)
        with client.acquire(key) as lease:
            assert bool((lease.tensors["w"] == 0).all())
