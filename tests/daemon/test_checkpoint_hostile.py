"""Checkpoint registration against hostile files, with a real hwrd: truncation mid-hash, FIFOs.

A client that owns a checkpoint file can truncate it while hwrd hashes it (a mapping would then
fault hwrd with SIGBUS), or name a FIFO ``*.safetensors`` (an open without ``O_NONBLOCK`` would
hang a worker thread forever). Either must give a typed error while hwrd keeps serving others.
"""

from __future__ import annotations

import os
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


def sparse_checkpoint(directory: Path, nbytes: int) -> Path:
    """A valid single-tensor safetensors file of ``nbytes`` data bytes, all of them a hole."""
    directory.mkdir()
    head, _entries, size = plan_file([("w", "U8", (nbytes,))], DEFAULT_METADATA)
    path = directory / "model.safetensors"
    with open(path, "wb") as fh:
        fh.write(head)
        fh.truncate(size)
    return path


def bytes_touched(pid: int) -> int:
    """Bytes ``pid`` has read (``rchar``) plus its resident file-backed pages (``RssFile``):
    grows while a file is hashed, whether through ``pread`` or through a mapping."""
    with open(f"/proc/{pid}/io", encoding="ascii") as fh:
        rchar = next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        rss_file_kib = next(int(line.split()[1]) for line in fh if line.startswith("RssFile:"))
    return rchar + rss_file_kib * 1024


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

    before = bytes_touched(hwrd.pid)
    thread = threading.Thread(target=register)
    thread.start()
    deadline = time.monotonic() + 60
    while bytes_touched(hwrd.pid) - before < 256 << 20:  # hwrd is reading the file: mid-hash
        assert time.monotonic() < deadline and thread.is_alive(), outcome
        time.sleep(0.01)
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
