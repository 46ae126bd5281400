"""The sole-opener check before a commit: granted when nobody else holds the file, refused with
the holders' pids when a writer (another process, or another descriptor of this one) does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hwr.client.errors import PublicationFailed
from hwr.daemon.system.exclusive import holders, open_sole, opened_elsewhere


def test_a_file_nobody_else_holds_is_opened(tmp_path: Path) -> None:
    path = tmp_path / "staging.safetensors"
    path.write_bytes(b"x" * 4096)
    fd = open_sole(path)
    try:
        assert os.pread(fd, 1, 0) == b"x"
        assert holders(path) == [os.getpid()]  # only the descriptor open_sole returned
    finally:
        os.close(fd)
    assert holders(path) == []


@pytest.mark.timeout(60)
def test_a_writer_in_another_process_is_refused_and_named(tmp_path: Path) -> None:
    path = tmp_path / "staging.safetensors"
    path.write_bytes(b"x" * 4096)
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; f = open(sys.argv[1], 'r+b'); print('open', flush=True); sys.stdin.read()",
         str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "open"
        with pytest.raises(PublicationFailed) as info:
            open_sole(path)
        assert info.value.details == {"file": path.name, "holder_pids": [child.pid]}
        assert str(child.pid) in info.value.message
    finally:
        child.communicate("", timeout=30)
    os.close(open_sole(path))  # let go: granted again


def test_another_descriptor_of_this_process_is_named_too(tmp_path: Path) -> None:
    path = tmp_path / "staging.safetensors"
    path.write_bytes(b"x" * 4096)
    writer = os.open(path, os.O_WRONLY)
    try:
        with pytest.raises(PublicationFailed) as info:
            open_sole(path)
        assert info.value.details["holder_pids"] == [os.getpid()]
    finally:
        os.close(writer)


@pytest.mark.timeout(60)
def test_opened_elsewhere_sees_a_mapping_whose_descriptor_was_closed(tmp_path: Path) -> None:
    """The eviction probe: a read-only mapping in another process (its descriptor closed) is an
    open file description; once that process is gone there is none."""
    path = tmp_path / "payload.safetensors"
    path.write_bytes(b"x" * 4096)
    st = os.stat(path)
    assert opened_elsewhere(str(path), st.st_dev, st.st_ino) is False
    child = subprocess.Popen(
        [sys.executable, "-c", "import mmap, os, sys\nfd = os.open(sys.argv[1], os.O_RDONLY)\n"
         "m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)\nos.close(fd)\nprint('mapped', flush=True)\nsys.stdin.read()",
         str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "mapped"
        assert opened_elsewhere(str(path), st.st_dev, st.st_ino) is True
    finally:
        child.communicate("", timeout=30)
    assert opened_elsewhere(str(path), st.st_dev, st.st_ino) is False


def test_opened_elsewhere_knows_nothing_of_another_file_at_the_path(tmp_path: Path) -> None:
    path = tmp_path / "payload.safetensors"
    path.write_bytes(b"x")
    st = os.stat(path)
    assert opened_elsewhere(str(path), st.st_dev, st.st_ino + 1) is None
    assert opened_elsewhere(str(tmp_path / "missing"), st.st_dev, st.st_ino) is None
