"""Checkpoint registration against hostile files, with a real hwrd: truncation mid-hash, FIFOs.

A client that owns a checkpoint file can truncate it while hwrd hashes it (a mapping would then
fault hwrd with SIGBUS), or name a FIFO ``*.safetensors`` (an open without ``O_NONBLOCK`` would
hang a worker thread forever). Either must give a typed error while hwrd keeps serving others.
"""

from __future__ import annotations

import ctypes
import os
import select
import struct
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hwr.client import connect
from hwr.client.errors import CheckpointModified, InvalidRequest
from hwr.client.safetensors_header import DEFAULT_METADATA, plan_file
from hwr.daemon.app.launcher import DaemonProcess

GIB = 1 << 30
HEADER_READS = 2  # read_header: the 8-byte length, then the header


def sparse_checkpoint(directory: Path, nbytes: int) -> Path:
    """A valid single-tensor safetensors file of ``nbytes`` data bytes, all of them a hole."""
    directory.mkdir()
    head, _entries, size = plan_file([("w", "U8", (nbytes,))], DEFAULT_METADATA)
    path = directory / "model.safetensors"
    with open(path, "wb") as fh:
        fh.write(head)
        fh.truncate(size)
    return path


class FileReads:
    """Counts the reads of one file by any process, from the kernel's ``IN_ACCESS`` inotify events.

    A signal of the reading itself: importing modules, mapping libraries or reading other files
    never counts. Identical events still queued are merged by the kernel, so the count is a lower
    bound on the reads (one per drain at least while reads go on), never more than happened.
    """

    IN_ACCESS = 0x1
    _EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)

    def __init__(self, path: Path) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        if libc.inotify_add_watch(self._fd, os.fsencode(path), self.IN_ACCESS) < 0:
            os.close(self._fd)
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {path}")
        self.count = 0

    def wait(self, timeout: float) -> int:
        """Drain the events that arrive within ``timeout`` s (returns as soon as some did): the count."""
        if select.select([self._fd], [], [], timeout)[0]:
            data = os.read(self._fd, 64 << 10)
            offset = 0
            while offset < len(data):
                _wd, mask, _cookie, name_len = self._EVENT.unpack_from(data, offset)
                self.count += bool(mask & self.IN_ACCESS)
                offset += self._EVENT.size + name_len
        return self.count

    def close(self) -> None:
        os.close(self._fd)


@pytest.mark.timeout(180)
def test_truncating_a_file_while_hwrd_hashes_it_is_checkpoint_modified(
        hwrd: DaemonProcess, short_tmp: Path) -> None:
    path = sparse_checkpoint(short_tmp / "ckpt", 16 * GIB)
    outcome: list[BaseException | dict[str, object]] = []

    def register() -> None:
        try:
            with connect(hwrd.socket, timeout=150) as client:
                outcome.append(client.add_checkpoint(path.parent))
        except BaseException as exc:
            outcome.append(exc)

    reads = FileReads(path)
    thread = threading.Thread(target=register)
    thread.start()
    deadline = time.monotonic() + 60
    try:
        # The header check reads the file twice (its length, then the header); the hash reads it
        # in 16 MiB chunks, 1024 of them. Past a few more reads than the header's, hwrd is hashing.
        while reads.wait(0.05) < HEADER_READS + 8:
            assert hwrd.proc is not None and hwrd.proc.poll() is None, "hwrd died before the hash"
            assert time.monotonic() < deadline and thread.is_alive(), (reads.count, outcome)
    finally:
        reads.close()
    os.truncate(path, 4096)
    thread.join(150)
    assert not thread.is_alive()
    assert hwrd.proc is not None and hwrd.proc.poll() is None, "hwrd died (SIGBUS)"
    (error,) = outcome
    assert isinstance(error, CheckpointModified), error
    assert error.details["file"] == "model.safetensors"
    with connect(hwrd.socket) as client:  # still serving
        assert client.status()["sessions"] == 1
        assert client.list_checkpoints() == []


@pytest.mark.timeout(120)
def test_a_fifo_named_safetensors_never_blocks_registration_or_other_calls(
        hwrd: DaemonProcess, short_tmp: Path) -> None:
    directory = short_tmp / "ckpt"
    directory.mkdir()
    save_file({"w": torch.ones(8)}, directory / "a.safetensors")
    os.mkfifo(directory / "b.safetensors")  # nobody ever opens its write end
    errors: list[BaseException | None] = []

    def register() -> None:
        try:
            with connect(hwrd.socket, timeout=60) as client:
                client.add_checkpoint(directory)
            errors.append(None)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=register) for _ in range(8)]
    for thread in threads:
        thread.start()
    # Answered while the adds run (a hung worker thread would make these time out: the bound
    # is loose because a loaded 2-core machine is slow, not because anything may block).
    with connect(hwrd.socket, timeout=20) as client:
        for _ in range(5):
            began = time.monotonic()
            client.status()
            client.list_checkpoints()
            assert time.monotonic() - began < 15.0
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads)
    assert len(errors) == 8 and all(isinstance(e, InvalidRequest) for e in errors), errors
    assert all(e.details == {"file": "b.safetensors"} for e in errors if e is not None)
    began = time.monotonic()
    assert hwrd.stop() == 0  # SIGTERM ends it: no thread is stuck in open()
    assert time.monotonic() - began < 15
