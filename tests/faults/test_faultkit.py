"""The fault suite's own harness must fail fast and say why, never wait for the pytest timeout."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from hwr.client import connect

from .faultkit import Worker, publish


@pytest.mark.timeout(60)
def test_a_holder_that_sees_changed_bytes_fails_the_test_at_once(forked_workers: None, spawn) -> None:
    """The holder answers ``bad`` when a byte under its lease changes; ``expect("ok")`` must
    raise with that answer (it used to skip the line and wait for an "ok" that never came).
    A worker that exits (here: an unknown mode) ends ``expect`` at once with its stderr; the
    zygote that forks these workers goes on forking after it."""
    daemon = spawn()
    with connect(daemon.socket) as client:
        key = publish(client, "m-3", 3)
    holder = Worker("hold", str(daemon.socket), "0", key, forked=True)
    try:
        holder.expect("held")
        payload = next((Path(daemon.root) / "artifacts" / key).glob("*.safetensors"))
        os.chmod(payload, 0o644)
        with open(payload, "r+b") as f:  # in place: the holder maps these very pages (shared)
            f.seek(4096)
            f.write(b"\x00\x00\x80\x7f")
        holder.send("check")
        began = time.monotonic()
        with pytest.raises(AssertionError, match="answered 'bad' instead of 'ok'"):
            holder.expect("ok")
        assert time.monotonic() - began < 10
    finally:
        holder.kill()
    for n in range(2):
        dead = Worker(f"no-such-mode-{n}", "/nonexistent.sock", "0", forked=True)
        began = time.monotonic()
        try:
            with pytest.raises(AssertionError, match=rf"(?s)exited .* before 'ready'.*unknown mode no-such-mode-{n}"):
                dead.expect("ready")
            assert time.monotonic() - began < 10
        finally:
            dead.kill()
