"""Filesystem-type and permission verdicts (pure), plus the real statfs of this machine."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hwr.client.errors import UntrustedStore
from hwr.daemon.system import fsguard


@pytest.mark.parametrize(("magic", "allowed"), [(0xEF53, True), (0x01021994, True), (0x58465342, True),
                                                (0x794C7630, True), (0x6969, False), (0xFF534D42, False),
                                                (0x0BD00BD0, False), (0x00C36400, False), (0x65735546, False),
                                                (0x12345678, False)])  # fmt: skip
def test_classify_filesystem(magic: int, allowed: bool) -> None:
    assert fsguard.classify_filesystem(magic).allowed is allowed


def test_allow_list_can_be_narrowed() -> None:
    assert not fsguard.classify_filesystem(0xEF53, ["tmpfs"]).allowed
    assert fsguard.classify_filesystem(0x01021994, ["tmpfs"]).allowed


def test_this_machine_is_local(tmp_path: Path) -> None:
    assert fsguard.check_filesystem(tmp_path).allowed
    with pytest.raises(OSError):
        fsguard.statfs_magic(tmp_path / "missing")


def test_permission_problem() -> None:
    d = stat.S_IFDIR
    assert fsguard.permission_problem(d | 0o700, 5, 5) is None
    assert "writable" in fsguard.permission_problem(d | 0o775, 5, 5)
    assert "owned" in fsguard.permission_problem(d | 0o700, 6, 5)
    assert "symlink" in fsguard.permission_problem(stat.S_IFLNK | 0o777, 5, 5)


def test_symlinked_directory_is_untrusted(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(UntrustedStore):
        fsguard.check_trusted_dir(tmp_path / "link")
