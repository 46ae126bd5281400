"""Eviction adapters at the OS boundary: the /proc maps scan and the lease journal."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

from hwr.daemon.service.lease_journal import LeaseJournal, process_start
from hwr.daemon.system import mappings


def test_scan_finds_a_mapping_by_dev_inode_and_reports_unreadable(tmp_path: Path) -> None:
    path = tmp_path / "payload"
    path.write_bytes(b"x" * 8192)
    target = mappings.file_id(os.stat(path))
    child = subprocess.Popen([sys.executable, "-c", (
        "import mmap,sys;f=open(sys.argv[1],'rb');m=mmap.mmap(f.fileno(),0,prot=mmap.PROT_READ);f.close();"
        "print('ready',flush=True);sys.stdin.readline()"), str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        result = mappings.scan([target])
        assert child.pid in result.mapped[target]

        def deny(pid: int) -> bytes:
            if pid == child.pid:
                raise PermissionError(13, "denied")
            return mappings.read_maps(pid)

        result = mappings.scan([target], reader=deny)
        assert child.pid not in result.mapped.get(target, set())
        assert result.unreadable[child.pid] == os.getuid()
        assert mappings.scan([target], skip_pids={child.pid}).mapped.get(target) is None
    finally:
        child.kill()
        child.wait()
    assert target not in mappings.scan([target]).mapped
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ):
        assert os.getpid() in mappings.scan([target]).mapped[target]


def test_journal_recovers_live_holds_and_drops_dead_or_reused_pids(tmp_path: Path) -> None:
    path = tmp_path / "leases.journal"
    key = "a" * 64
    journal = LeaseJournal.open(path)
    me = os.getpid()
    journal.acquired("l1", key, me, process_start(me) or 0, 1000)
    journal.acquired("l2", key, me, (process_start(me) or 0) + 1, 1000)  # same pid, other start: reused
    journal.acquired("l3", key, 2**22 + 17, 5, 1001)  # no such process
    journal.acquired("l4", key, me, process_start(me) or 0, 1000)
    journal.released("l4")
    with open(path, "ab") as f:
        f.write(b'{"op":"acquire","lease":"torn"')  # a SIGKILL mid-line never happens, but be tolerant
    journal.close()
    again = LeaseJournal.open(path)
    assert [h.lease_id for h in again.recovered] == ["l1"]
    assert again.lessee_uids(key) == {1000, 1001}
    again.forget(key)
    again.close()
    assert LeaseJournal.open(path).lessee_uids(key) == set()
