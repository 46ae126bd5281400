"""The persistent lease registry: who held which artifact, surviving a daemon restart.

File ``<root>/leases.journal``, append-only JSON lines (one ``os.write`` of one line each, with
``O_APPEND``, so a SIGKILL leaves whole lines; a torn or unknown line is ignored)::

    {"op": "acquire", "lease": ID, "key": KEY, "pid": PID, "start": TICKS, "uid": UID}
    {"op": "release", "lease": ID}
    {"op": "forget", "key": KEY}            # the artifact is gone: drop its lessee uids

``start`` is the process start time (field 22 of ``/proc/<pid>/stat``, clock ticks since boot):
with the pid it names one process, so a recycled pid never inherits a hold.

At open the journal is replayed: every acquire without a release whose process is still the same
live process becomes a *hold* (``recovered``); the file is then rewritten (temp file, rename)
with just those holds and the lessee uids, and is compacted the same way whenever it grows past
a bound. The daemon treats a held artifact as in use until the process exits or reattaches
(acquires the key again from a new session).

Compaction while the daemon serves runs off the event loop (a journal of a million leases
takes seconds to rewrite): the loop takes a snapshot of the live holds and lessee uids (a list
copy), a worker thread writes it to a temp file, and back on the loop the records written
meanwhile (to the old file, which stays the journal until then) are appended to the temp file
before it replaces the old one. A crash at any point leaves the old file, complete; a stale temp
file is removed at the next open.

No fsync, on purpose: the journal must survive the daemon's death, not the machine's; the page
cache outlives a killed process, and after a machine crash there is no process left to protect.

Group commit: records are buffered in memory and written with one ``os.write`` per ``flush``.
The daemon flushes (a) before any payload descriptor leaves it (``hwr.daemon.service.leasing`` calls
``flush`` right before the peer socket sends descriptors) and (b) once per event-loop tick for
whatever else was buffered (``schedule`` arms a ``call_soon``). Why that keeps the lease
guarantee (a restart, clean or SIGKILL, never lets eviction remove an artifact that a live
process maps): a process can only map an artifact through descriptors, and no descriptor is sent
before its ``acquire`` record is in the file (a), so after any crash the replay knows every
process that could map it. A SIGKILL can lose only records buffered since the last flush: an
``acquire`` whose descriptors were never sent (nobody can map those bytes through it), or a
``release`` (the restarted daemon then keeps a hold for a process that no longer needs it until
that process exits or re-acquires: conservative). Besides, eviction scans ``/proc/*/maps`` of every
process before removing anything (``hwr.daemon.system.mappings``), so even a lost record would not let a
mapped artifact go.
Limits: the lessee-uid sets only grow (one entry per uid that ever leased a key) until the key
is forgotten; a process that exits and whose pid is reused within the same clock tick of start
time would be mistaken for the original (practically impossible).

Holds (``LeaseHolds``, the journal's owner in the daemon): every lease's acquire and release
is journaled here, and the recovered holds are kept: a held key counts as in use (never
evicted) until its process exits (``prune``, each housekeeping tick) or acquires the key again
from a new session (``acquired`` then releases the hold: the new lease protects the key from now
on). On the daemon's event loop only (the registry's lease observer, housekeeping, eviction), so
it has no lock. A process's start time is read once per session (cached, the cache dropped
whole past 65,536 sessions); a hold of a process that exited is found only at the next
``prune``, which keeps it conservative (held a little too long, never too short).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hwr.client.identity import is_key
from hwr.daemon.store import fileio as store_io

if TYPE_CHECKING:
    from hwr.daemon.service.sessions import LeaseRecord

__all__ = ["Hold", "LeaseHolds", "LeaseJournal", "process_start", "same_process"]

COMPACT_SLACK = 4096
#: A journal larger than this is not read at start (set aside): about 2 million live leases.
JOURNAL_MAX_BYTES = 512 * 1024 * 1024
#: Strings that need no JSON escaping (ids, hex keys, "checkpoint:<id>"): formatted directly.
_PLAIN = re.compile(r"[A-Za-z0-9:_.-]{1,200}").fullmatch
log = logging.getLogger("hwrd.journal")


def _write_all(fd: int, data: bytes) -> tuple[bytes, OSError | None]:
    """Write ``data`` to ``fd`` until done or an error: (the bytes not written, the error)."""
    view, done = memoryview(data), 0
    try:
        while done < len(data):
            done += os.write(fd, view[done:])
    except OSError as exc:
        return bytes(view[done:]), exc
    return b"", None


@dataclass(frozen=True)
class Hold:
    lease_id: str
    key: str
    pid: int
    start: int
    uid: int


def process_start(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot, or None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = data[data.rfind(b")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def same_process(pid: int, start: int) -> bool:
    return process_start(pid) == start


class LeaseJournal:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._live: dict[str, Hold] = {}
        self._uids: dict[str, set[int]] = {}
        self._lines = 0
        self._pending: list[bytes] = []
        self._scheduled = False
        self._since: list[bytes] | None = None  # written while a compaction runs (None: none runs)
        self.recovered: list[Hold] = []
        self.writes = 0  # os.write calls for records (a benchmark/diagnostic counter)
        self.failures = 0  # failed flushes since the last one that succeeded

    @classmethod
    def open(cls, path: Path) -> LeaseJournal:
        journal = cls(path)
        for stale in path.parent.glob(f".{path.name}.*.tmp"):  # a compaction a crash interrupted
            with contextlib.suppress(OSError):
                stale.unlink()
        journal._replay()
        journal.recovered = [h for h in journal._live.values() if same_process(h.pid, h.start)]
        journal._live = {h.lease_id: h for h in journal.recovered}
        journal._compact()
        return journal

    def _replay(self) -> None:
        try:
            data = store_io.read_state_file(self.path, JOURNAL_MAX_BYTES)
        except OSError as exc:  # a symlink, a FIFO, a device, too large: never read
            aside = self.path.with_name(f"{self.path.name}.corrupt-{uuid.uuid4().hex[:12]}")
            store_io.rename(self.path, aside)
            log.error("lease journal unreadable (%s): kept as %s; starting without recovered leases",
                      exc.strerror or exc, aside.name)
            return
        if data is None:
            return
        for line in data.splitlines():
            try:
                entry = store_io.parse_json(line)
                op = entry["op"]
                if op == "acquire" and is_key(entry["key"]):
                    hold = Hold(str(entry["lease"]), entry["key"], int(entry["pid"]), int(entry["start"]),
                                int(entry["uid"]))
                    self._live[hold.lease_id] = hold
                    self._uids.setdefault(hold.key, set()).add(hold.uid)
                elif op == "release":
                    self._live.pop(str(entry["lease"]), None)
                elif op == "forget":
                    self._uids.pop(entry["key"], None)
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line or a foreign one (or one nested too deeply): ignore it

    def _snapshot(self) -> tuple[list[Hold], dict[str, tuple[int, ...]]]:
        """What a compacted journal holds, copied (cheap: the holds are immutable)."""
        return list(self._live.values()), {key: tuple(sorted(uids)) for key, uids in self._uids.items()}

    def _write_snapshot(self, live: list[Hold], uids: dict[str, tuple[int, ...]]) -> tuple[Path, int]:
        """Write a compacted journal of ``live`` and ``uids`` to a new temp file beside the
        journal (any thread; touches no state of this object): (its path, its line count)."""
        lines = [self._line({"op": "acquire", "lease": h.lease_id, "key": h.key, "pid": h.pid,
                             "start": h.start, "uid": h.uid}) for h in live]
        # Lessee uids of keys without a live hold travel as acquire+release pairs.
        for key, key_uids in uids.items():
            for uid in key_uids:
                marker = f"uid-{uuid.uuid4().hex[:12]}"
                lines.append(self._line({"op": "acquire", "lease": marker, "key": key, "pid": 0, "start": 0,
                                         "uid": uid}))
                lines.append(self._line({"op": "release", "lease": marker}))
        tmp = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            try:
                _rest, error = _write_all(fd, b"".join(lines))
            finally:
                os.close(fd)
            if error is not None:
                raise error
        except BaseException:  # a full disk: the journal stays as it was, nothing half-written replaces it
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return tmp, len(lines)

    def _install(self, tmp: Path, lines: int, since: list[bytes]) -> None:
        """Append ``since`` (records written after the snapshot) to ``tmp`` and make it the journal."""
        try:
            if since:
                fd = os.open(tmp, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW)
                try:
                    _rest, error = _write_all(fd, b"".join(since))
                finally:
                    os.close(fd)
                if error is not None:
                    raise error
            os.rename(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        old, self._fd = self._fd, os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW)
        if old is not None:
            os.close(old)
        self._lines = lines + sum(chunk.count(b"\n") for chunk in since)

    def _compact(self) -> None:
        """Compact now, in this thread (at open, or without an event loop)."""
        tmp, lines = self._write_snapshot(*self._snapshot())
        self._install(tmp, lines, [])

    def _start_compaction(self) -> None:
        """Compact off the event loop (module docstring); inline when there is no loop."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            try:
                self._compact()
            except OSError as exc:
                log.warning("lease journal compaction failed, journal kept as it is: %s", exc)
            return
        self._since = []
        log.debug("compacting the lease journal (%d records, %d live)", self._lines, len(self._live))
        future = loop.run_in_executor(None, self._write_snapshot, *self._snapshot())
        future.add_done_callback(self._finish_compaction)

    def _finish_compaction(self, future: asyncio.Future[tuple[Path, int]]) -> None:
        since, self._since = self._since or [], None
        try:
            tmp, lines = future.result()
        except OSError as exc:
            log.warning("lease journal compaction failed, journal kept as it is: %s", exc)
            return
        if self._fd is None:  # closed meanwhile: the old file is the journal
            with contextlib.suppress(OSError):
                tmp.unlink()
            return
        try:
            self._install(tmp, lines, since)
        except OSError as exc:
            log.warning("lease journal compaction failed, journal kept as it is: %s", exc)

    @staticmethod
    def _line(entry: dict[str, object]) -> bytes:
        return json.dumps(entry, separators=(",", ":")).encode() + b"\n"

    def _append(self, entry: dict[str, object]) -> None:
        self._append_line(self._line(entry))

    def _append_line(self, line: bytes) -> None:
        if self._fd is None:
            return
        self._pending.append(line)
        self._schedule()

    def _schedule(self) -> None:
        """Arm one flush at the end of the current event-loop tick (no loop: flush now)."""
        if self._scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        self._scheduled = True
        loop.call_soon(self._tick_flush)

    def _tick_flush(self) -> None:
        self._scheduled = False
        with contextlib.suppress(OSError):  # logged by flush; the records stay buffered
            self.flush()

    def _failed(self, exc: OSError) -> None:
        """Log a failed write once per episode (a full disk fails every flush until freed)."""
        self.failures += 1
        if self.failures == 1:
            log.error("lease journal write failed (records kept in memory and retried; acquires "
                      "are refused meanwhile): %s", exc)

    def flush(self) -> None:
        """Write every buffered record (``O_APPEND``, normally one ``os.write``: whole lines).

        On a failed write (``OSError``, e.g. ENOSPC) the records not yet written stay buffered,
        in order, for the next flush, and the error is raised: nothing is dropped, and a write
        that stopped mid-line is completed by the next one (one writer, ``O_APPEND``). A failed
        compaction leaves the journal as it was (logged; retried at the next flush)."""
        if not self._pending or self._fd is None:
            return
        data, n = b"".join(self._pending), len(self._pending)
        self._pending = []
        rest, error = _write_all(self._fd, data)
        if error is not None:
            self._pending = [rest]
            self._failed(error)
            raise error
        if self.failures:
            log.warning("lease journal writable again after %d failed writes", self.failures)
            self.failures = 0
        self.writes += 1
        self._lines += n
        if self._since is not None:
            self._since.append(data)
        elif self._lines > 2 * (len(self._live) + len(self._uids)) + COMPACT_SLACK:
            self._start_compaction()

    # ------------------------------------------------------------------ recording
    def acquired(self, lease_id: str, key: str, pid: int, start: int, uid: int) -> None:
        self._live[lease_id] = Hold(lease_id, key, pid, start, uid)
        self._uids.setdefault(key, set()).add(uid)
        if _PLAIN(lease_id) and _PLAIN(key):  # the hot path: the same line json.dumps would write
            self._append_line(f'{{"op":"acquire","lease":"{lease_id}","key":"{key}","pid":{int(pid)},'
                              f'"start":{int(start)},"uid":{int(uid)}}}\n'.encode())
        else:
            self._append({"op": "acquire", "lease": lease_id, "key": key, "pid": pid, "start": start, "uid": uid})

    def released(self, lease_id: str) -> None:
        if self._live.pop(lease_id, None) is not None:
            if _PLAIN(lease_id):
                self._append_line(f'{{"op":"release","lease":"{lease_id}"}}\n'.encode())
            else:
                self._append({"op": "release", "lease": lease_id})

    def forget(self, key: str) -> None:
        if self._uids.pop(key, None) is not None:
            self._append({"op": "forget", "key": key})

    def lessee_uids(self, key: str) -> set[int]:
        return set(self._uids.get(key, ()))

    def live(self) -> list[Hold]:
        return list(self._live.values())

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.flush()
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


# --------------------------------------------------------------------------- holds
_holds_log = logging.getLogger("hwrd.store")  # the holds' lines, where operators read eviction's


class LeaseHolds:
    """The journal of leases and the holds recovered from it (see the module contract)."""

    def __init__(self, journal: LeaseJournal) -> None:
        self.journal = journal
        self.holds: list[Hold] = list(journal.recovered)
        self._starts: dict[str, int] = {}  # session id -> its process's start time (0: unknown)
        if self.holds:
            _holds_log.info("recovered %d lease holds of live processes from before the restart", len(self.holds))

    def acquired(self, lease: LeaseRecord) -> None:
        """Journal a new lease; a hold of the same process on the same key ends (reattached)."""
        start = self._starts.get(lease.session_id)
        if start is None:
            if len(self._starts) > 65536:
                self._starts.clear()
            start = process_start(lease.pid) or 0
            self._starts[lease.session_id] = start
        self.journal.acquired(lease.lease_id, lease.key, lease.pid, start, lease.uid)
        self._reattach(lease.key, lease.pid)

    def released(self, lease: LeaseRecord) -> None:
        self.journal.released(lease.lease_id)

    def _reattach(self, key: str, pid: int) -> None:
        if not self.holds:
            return
        keep = []
        for hold in self.holds:
            if hold.key == key and hold.pid == pid:
                self.journal.released(hold.lease_id)
            else:
                keep.append(hold)
        self.holds = keep

    def prune(self) -> None:
        """Drop holds of processes that exited (or whose pid now names another process)."""
        keep = []
        for hold in self.holds:
            if same_process(hold.pid, hold.start):
                keep.append(hold)
            else:
                self.journal.released(hold.lease_id)
        self.holds = keep

    def held_pids(self, key: str) -> list[int]:
        return sorted({h.pid for h in self.holds if h.key == key})

    def lessee_uids(self, key: str) -> set[int]:
        """The uids that ever leased ``key`` (kept across restarts until the artifact goes)."""
        return self.journal.lessee_uids(key)

    def forget(self, key: str) -> None:
        """The artifact is gone: its lessee uids go too."""
        self.journal.forget(key)

    def close(self) -> None:
        self.journal.close()
