"""hwrd's NIXL transfer process: the data plane of the peer tier, in a process of its own.

hwrd never imports NIXL (nor the numpy it loads, nor UCX's threads): it starts this module as
``PYTHON -m hwr.daemon.fleet.peer_agent NAME`` (``PYTHON``: ``fleet_peer_python``, default hwrd's
own interpreter) and talks to it over its stdin/stdout with ``hwr.daemon.fleet.peer_wire``
frames. One request, one reply with the same ``id``; replies may come out of order (reads run
concurrently). Requests:

- ``hello`` -> ``metadata`` (this agent's NIXL metadata, base64) and ``name``.
- ``expose {path}`` -> ``addr``, ``size``, ``metadata`` (the agent's, now naming this file):
  the committed payload file mapped read-only (``PROT_READ``, ``MAP_SHARED``: the page cache's
  pages, the same immutable file that leases map) and registered with UCX, so that peers can
  READ it. Counted per path.
- ``release {path}``: one ``expose`` fewer; the last one deregisters and unmaps it.
- ``unexpose {path}``: deregistered now, whatever the count (a pulling node's staging file,
  before its commit, which refuses a file mapped elsewhere); its addresses are then backed by
  anonymous zero pages (never by the file again, never unmapped: a late read from a peer gets
  zeros, which it refuses, instead of faulting this process). Costs address space, no memory.
- ``connect {metadata}`` -> ``agent``: a peer's agent, for reads from it. ``disconnect {agent}``.
- ``read {agent, addr, length, path, offset}``: NIXL READ of ``length`` bytes at the peer's
  ``addr`` into one of this process's bounce buffers, then ``pwrite`` into the staging file
  ``path`` at ``offset``. At most ``BUFFERS`` reads run at once; others wait in order.
  ``abort {target}`` gives up a read (its reply is an error).
- ``close {path}``: the staging file's descriptor is closed.

The process is single-threaded: it polls its transfers between frames (NIXL's own progress
thread moves the bytes), so it needs no locking around the agent. Memory: ``BUFFERS`` x
``CHUNK`` bytes of bounce buffers plus NIXL/UCX themselves (measured in BENCHMARKS.md); the
exposed files are page cache, shared with the leases. It ends at end of input (hwrd closed it).
"""

from __future__ import annotations

import base64
import collections
import contextlib
import ctypes
import mmap
import os
import select
import stat
import sys
import time
from typing import Any

from hwr.daemon.fleet import peer_wire

__all__ = ["BUFFERS", "CHUNK", "POLL_S", "PROGRESS_DELAY_US", "main"]

#: One read moves at most this many bytes (hwrd's chunks are cut to it).
CHUNK = 4 << 20
#: Bounce buffers, so at most this many reads in flight.
BUFFERS = 16

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
#: Seconds between this loop's checks of its transfers while some run (a 4 MiB read takes ~35 ms
#: at 1 Gbit/s; a few of them in flight hide the check's delay). Idle, it waits for input.
POLL_S = 0.002
#: Microseconds NIXL's progress thread sleeps between passes. NIXL's Python API passes 0, and
#: the thread then spins: an idle transfer process took a quarter of a core here, and serving
#: 256 MiB cost the server 1.7 CPU-seconds; with 100 us, 2.6% idle and 0.6 CPU-seconds, and a
#: read over an unlimited veth went from 22-30 to 104 MB/s on the loaded 2-core test machine
#: (1000 us: 61 MB/s, the thread then sleeps longer than the socket buffers last).
PROGRESS_DELAY_US = 100


def _map(fd: int, size: int, prot: int, flags: int) -> int:
    addr = _libc.mmap(None, size, prot, flags, fd, 0)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(addr)


def _map_at(addr: int, size: int, prot: int, flags: int) -> None:
    got = _libc.mmap(addr, size, prot, flags, -1, 0)
    if got != addr:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class Agent:
    def __init__(self, name: str, out: Any) -> None:
        from nixl_cu12 import _api, nixl_agent, nixl_agent_config  # the optional `peers` extra

        bind = _api.nixlBind
        plain = bind.nixlAgentConfig

        class Config(plain):  # type: ignore[misc, valid-type]
            """NIXL's Python API sets the progress thread's delay to 0 (it spins: a quarter of a
            core while idle, measured here); the floor is ``PROGRESS_DELAY_US``."""

            pthrDelay = property(lambda c: plain.pthrDelay.__get__(c),  # NIXL's name for the delay
                                 lambda c, v: plain.pthrDelay.__set__(c, max(int(v), PROGRESS_DELAY_US)))

        bind.nixlAgentConfig = Config
        try:
            self.nixl = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        finally:
            bind.nixlAgentConfig = plain
        self.name = name
        self.buffers: list[int] = []
        anon = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        for _ in range(BUFFERS):
            self.buffers.append(_map(-1, CHUNK, mmap.PROT_READ | mmap.PROT_WRITE, anon))
        self.nixl.register_memory([(addr, CHUNK, 0, "") for addr in self.buffers], "DRAM")
        self.free = list(range(BUFFERS))
        self.exposed: dict[str, list[Any]] = {}  # path -> [addr, size, registration, count]
        self.dests: dict[str, int] = {}  # staging path -> write descriptor
        self.waiting: collections.deque[dict[str, Any]] = collections.deque()
        self.running: dict[Any, tuple[Any, int, dict[str, Any]]] = {}  # id -> (handle, buffer, request)
        self.out = out

    def reply(self, request: dict[str, Any], **fields: Any) -> None:
        self.out.write(peer_wire.encode({"id": request.get("id"), **fields}))
        self.out.flush()

    # ------------------------------------------------------------------ requests
    def handle(self, request: dict[str, Any]) -> None:
        op = request.get("op")
        try:
            if op == "hello":
                md = self.nixl.get_agent_metadata()
                self.reply(request, name=self.name, metadata=base64.b64encode(md).decode())
            elif op == "expose":
                self.reply(request, **self.expose(str(request["path"])))
            elif op == "release":
                self.release(str(request["path"]))
                self.reply(request, ok=True)
            elif op == "unexpose":
                self.unexpose(str(request["path"]))
                self.reply(request, ok=True)
            elif op == "connect":
                agent = self.nixl.add_remote_agent(base64.b64decode(request["metadata"]))
                self.reply(request, agent=agent.decode() if isinstance(agent, bytes) else str(agent))
            elif op == "disconnect":
                self.nixl.remove_remote_agent(str(request["agent"]))
                self.reply(request, ok=True)
            elif op == "read":
                if int(request["length"]) > CHUNK or int(request["length"]) <= 0:
                    raise ValueError(f"a read moves 1 to {CHUNK} bytes")
                self.waiting.append(request)
            elif op == "abort":
                self.abort(request.get("target"))
                self.reply(request, ok=True)
            elif op == "close":
                fd = self.dests.pop(str(request["path"]), None)
                if fd is not None:
                    os.close(fd)
                self.reply(request, ok=True)
            else:
                raise ValueError(f"unknown request {op!r}")
        except Exception as exc:  # one bad request never ends the process
            self.reply(request, error=f"{type(exc).__name__}: {exc}")

    def expose(self, path: str) -> dict[str, Any]:
        entry = self.exposed.get(path)
        if entry is None:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
                    raise ValueError("not a non-empty regular file")
                addr = _map(fd, st.st_size, mmap.PROT_READ, mmap.MAP_SHARED)
            finally:
                os.close(fd)  # the mapping keeps the file (and its bytes) alive
            registration = self.nixl.register_memory([(addr, st.st_size, 0, "")], "DRAM")
            entry = self.exposed[path] = [addr, st.st_size, registration, 0]
        entry[3] += 1
        # The metadata names every registered region: peers must load it after this exposure.
        return {"addr": entry[0], "size": entry[1],
                "metadata": base64.b64encode(self.nixl.get_agent_metadata()).decode()}

    def release(self, path: str) -> None:
        entry = self.exposed.get(path)
        if entry is None:
            return
        entry[3] -= 1
        if entry[3] <= 0:
            del self.exposed[path]
            self.nixl.deregister_memory(entry[2])
            _libc.munmap(entry[0], entry[1])

    def unexpose(self, path: str) -> None:
        entry = self.exposed.pop(path, None)
        if entry is None:
            return
        self.nixl.deregister_memory(entry[2])
        fixed = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x10  # MAP_FIXED: replaces the file's pages
        _map_at(entry[0], entry[1], mmap.PROT_READ, fixed)

    def abort(self, target: Any) -> None:
        for request in list(self.waiting):
            if request.get("id") == target:
                self.waiting.remove(request)
                self.reply(request, error="aborted")
                return
        running = self.running.pop(target, None)
        if running is not None:
            handle, buffer, request = running
            try:
                self.nixl.release_xfer_handle(handle)
                self.free.append(buffer)
            except Exception:  # the transfer could not be stopped: its buffer stays out of use
                pass
            self.reply(request, error="aborted")

    # ------------------------------------------------------------------ transfers
    def start_reads(self) -> None:
        while self.waiting and self.free:
            request = self.waiting.popleft()
            buffer = self.free.pop()
            try:
                length = int(request["length"])
                local = self.nixl.get_xfer_descs([(self.buffers[buffer], length, 0)], "DRAM")
                remote = self.nixl.get_xfer_descs([(int(request["addr"]), length, 0)], "DRAM")
                handle = self.nixl.initialize_xfer("READ", local, remote, str(request["agent"]))
                state = self.nixl.transfer(handle)
            except Exception as exc:
                self.free.append(buffer)
                self.reply(request, error=f"{type(exc).__name__}: {exc}")
                continue
            self.running[request.get("id")] = (handle, buffer, request)
            if state != "PROC":
                self.finish(request.get("id"), state)

    def poll(self) -> None:
        for rid in list(self.running):
            handle = self.running[rid][0]
            try:
                state = self.nixl.check_xfer_state(handle)
            except Exception:
                state = "ERR"
            if state != "PROC":
                self.finish(rid, state)

    def finish(self, rid: Any, state: str) -> None:
        handle, buffer, request = self.running.pop(rid)
        with contextlib.suppress(Exception):
            self.nixl.release_xfer_handle(handle)
        try:
            if state != "DONE":
                raise OSError(f"transfer from {request['agent']} failed ({state})")
            length = int(request["length"])
            path = str(request["path"])
            fd = self.dests.get(path)
            if fd is None:
                fd = self.dests[path] = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            view = memoryview((ctypes.c_char * length).from_address(self.buffers[buffer])).cast("B")
            offset = int(request["offset"])
            while view:
                n = os.pwrite(fd, view, offset)
                view, offset = view[n:], offset + n
            self.reply(request, ok=True)
        except Exception as exc:
            self.reply(request, error=f"{type(exc).__name__}: {exc}")
        finally:
            self.free.append(buffer)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    stdin = sys.stdin.buffer.fileno()
    # The frames get a descriptor of their own; fd 1 goes to stderr, so that what NIXL and UCX
    # print (they log to stdout) lands in hwrd's log instead of corrupting the frames.
    frames = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        agent = Agent(args[0] if args else f"hwr-peer-{os.getpid()}", frames)
    except Exception as exc:  # NIXL missing or UCX unusable: say so in the first reply
        frames.write(peer_wire.encode({"id": None, "fatal": f"{type(exc).__name__}: {exc}"}))
        frames.flush()
        return 2
    pending = b""
    while True:
        busy = bool(agent.running or agent.waiting)
        ready, _, _ = select.select([stdin], [], [], POLL_S if busy else 1.0)
        if ready:
            data = os.read(stdin, 1 << 16)
            if not data:
                return 0
            pending += data
            while len(pending) >= 4:
                length = int.from_bytes(pending[:4], "big")
                if length > peer_wire.MAX_FRAME:
                    return 3
                if len(pending) < 4 + length:
                    break
                body, pending = pending[4:4 + length], pending[4 + length:]
                agent.handle(peer_wire.decode(body))
        agent.start_reads()
        agent.poll()
        if not ready and busy:
            time.sleep(0)


if __name__ == "__main__":
    sys.exit(main())
