"""Channels as a node service: set, remove, resolve, protect from eviction, and watch.

``Channels`` owns the channels of one store root (``<root>/channels.json``) and the watches of
the live sessions. The transitions are pure (``hwr.daemon.policy.channel_state``); this module
orders them with the file writes and the watchers:

- ``set``: (with ``check``) ``lookup`` the key, which waits out an eviction round that marked it;
  from then on the key counts as protected (``protects``), before any other await, so no later
  eviction round can choose it. Under ``_lock`` (one change at a time) the new state is written
  (``_write``: temp file, rename; fsynced with its directory when the change is durable, not
  fsynced otherwise) and only then made current and announced to the watchers. A failed write
  changes nothing.
- A change is durable when its key is a durable artifact (``volatile(key)`` False). The file
  always holds each channel's durable part; after a non-durable change it also records that the
  channel is past it (``volatile_generation``), written without fsync: enough for a daemon
  restart (the page cache survives it) to know the channel must fall back; after a host crash
  no client that saw the non-durable change survives either.
- Watches (``watch``): one per (session, channel) subscription; each has an event set at every
  change of its channel and when its session ends (``session_ended``) or hwrd stops
  (``close``). A watcher reads the newest state when it wakes, so a slow one skips states
  (coalesced), never queues them.

Who may create or repoint a channel, and how many one uid may create: ``channel_rights``.

Contract: on the daemon's event loop (the file writes run in worker threads); ``open`` is
blocking (at start). Limits: ``MAX_CHANNELS`` channels (publishers stop earlier),
``MAX_WATCHES_PER_SESSION`` watches per session; a change costs one fsynced file write (a few
ms), a non-durable one a plain write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from hwr.client.channels import check_channel_name
from hwr.client.errors import ChannelNotFound, DaemonUnavailable, InvalidRequest, SessionInvalid
from hwr.client.identity import canonical_json
from hwr.daemon.policy.channel_rights import MAX_CHANNELS, Actor, owner_after
from hwr.daemon.policy.channel_state import ChannelState, document, moved, protected_keys, restored
from hwr.daemon.store import fileio as store_io

__all__ = ["MAX_CHANNELS", "MAX_WATCHES_PER_SESSION", "Channels", "Watch"]

log = logging.getLogger("hwrd.channels")

MAX_WATCHES_PER_SESSION = 64
FILE_NAME = "channels.json"
#: A change hwrd makes on its own (no caller): it may change any channel.
DAEMON = Actor(None, operator=True)


class Watch:
    """One session's subscription to one channel; ``states`` yields the newest state after
    each change (see the module docstring). ``close`` unsubscribes (idempotent)."""

    def __init__(self, channels: Channels, session_id: str, name: str) -> None:
        self.channels = channels
        self.session_id = session_id
        self.name = name
        self.event = asyncio.Event()
        self.ended: str | None = None  # why the watch ended: "session" | "stopping"

    async def states(self) -> AsyncIterator[ChannelState | None]:
        """The state at subscription (None: no such channel yet), then each newer state.
        Raises ``SessionInvalid`` when the session ends, ``DaemonUnavailable`` when hwrd stops."""
        last = -1
        first = True
        while True:
            self.event.clear()
            if self.ended == "session":
                raise SessionInvalid("the watching session ended")
            if self.ended is not None:
                raise DaemonUnavailable("hwrd is stopping")
            state = self.channels.get(self.name)
            generation = state.generation if state is not None else -1
            if first or generation > last:
                first = False
                last = max(last, generation)
                yield state
            await self.event.wait()

    def close(self) -> None:
        self.channels._unwatch(self)


class Channels:
    """The channels of one store root and their watches (see the module docstring).

    ``volatile(key)``: whether ``key`` is a non-durable artifact (``VolatileSet.marked``);
    ``lookup(key)``: the ready artifact's record, waiting out an eviction round that marked it
    (``Catalog.record_settled``); typed errors (``ArtifactNotFound``, ``ArtifactDenied``, ...).
    """

    def __init__(self, path: Path, states: dict[str, ChannelState], counter: int,
                 volatile: Callable[[str], bool], lookup: Callable[[str], Awaitable[object]]) -> None:
        self.path = path
        self._states = states
        self._counter = counter
        self._volatile = volatile
        self._lookup = lookup
        self._protected: set[str] = protected_keys(states.values())
        self._pending: Counter[str] = Counter()  # keys of changes in progress: protected too
        self._lock = asyncio.Lock()  # one change at a time (the file is rewritten whole)
        self._watches: dict[str, set[Watch]] = {}
        self._by_session: dict[str, set[Watch]] = {}
        self.switches = 0  # changes since start (metrics)

    @classmethod
    def open(cls, root: Path, volatile: Callable[[str], bool],
             lookup: Callable[[str], Awaitable[object]]) -> Channels:
        """Load ``<root>/channels.json`` (blocking). Channels that pointed to a non-durable
        revision fall back to their last durable key (written durably here); an unreadable file
        (not JSON, nested too deeply, not a schema 1 document; or a symlink, FIFO or other
        non-regular file, or one over 32 MiB, which is never read: ``fileio.read_state_file``)
        is kept aside as ``channels.json.corrupt-<unique>`` and hwrd starts without channels."""
        path = root / FILE_NAME
        states: dict[str, ChannelState] = {}
        counter = 0
        try:
            raw = store_io.read_state_file(path)
            unreadable: Exception | None = None
        except OSError as exc:  # a symlink, a FIFO, a device, too large: never read
            raw, unreadable = b"", exc
        if raw is not None:
            try:
                if unreadable is not None:
                    raise unreadable
                result = restored(store_io.parse_json(raw), time.time())
            except (OSError, ValueError) as exc:
                aside = path.with_name(f"{FILE_NAME}.corrupt-{uuid.uuid4().hex[:12]}")
                store_io.rename(path, aside)
                log.error("channels file unreadable (%s): kept as %s; starting without channels", exc, aside.name)
            else:
                states, counter = result.states, result.counter
                for name in result.fell_back:
                    log.warning("channel %s fell back to its last durable key %s (its non-durable revision "
                                "did not survive the restart)", name, states[name].key[:16])
                for name in result.vanished:
                    log.warning("channel %s is gone: it only ever pointed to non-durable revisions", name)
                for name in result.malformed:
                    log.error("channel entry %r in %s is malformed: dropped", name, FILE_NAME)
                if result.fell_back or result.vanished or result.malformed:
                    _write(path, document(states.values(), counter), durable=True)
        return cls(path, states, counter, volatile, lookup)

    # reads ------------------------------------------------------------------------------------
    def get(self, name: str) -> ChannelState | None:
        return self._states.get(name)

    def states(self) -> list[ChannelState]:
        """Every channel, by name."""
        return [self._states[name] for name in sorted(self._states)]

    def resolve(self, name: str) -> str:
        """The key ``name`` points to now; ``ChannelNotFound`` when there is no such channel."""
        state = self._states.get(check_channel_name(name))
        if state is None:
            raise ChannelNotFound(f"no channel named {name!r}", details={"channel": name})
        return state.key

    def named(self, key: str) -> list[str]:
        """The channels that point to ``key`` now."""
        return sorted(name for name, state in self._states.items() if state.key == key)

    def protects(self, key: str) -> bool:
        """Whether ``key`` must not be evicted (a channel's current or last durable key, or the
        key of a change in progress)."""
        return key in self._protected or self._pending[key] > 0

    def watcher_count(self, name: str | None = None) -> int:
        if name is None:
            return sum(len(w) for w in self._watches.values())
        return len(self._watches.get(name, ()))

    # changes ----------------------------------------------------------------------------------
    def may_set(self, name: str, actor: Actor) -> None:
        """Refuse now (typed, as ``set`` would) when ``actor`` may not set ``name``: a publication
        learns it at its begin, before it stages anything. ``set`` decides again."""
        current = self._states.get(check_channel_name(name))
        owner_after(actor, name, current is not None, current.owner if current else None,
                    (s.owner for s in self._states.values()))

    async def set(self, name: str, key: str, *, set_by: str, actor: Actor = DAEMON,
                  check: bool = False) -> tuple[ChannelState, bool]:
        """Point ``name`` at ``key`` as ``actor``: (its state, whether it changed). Who may create
        or repoint which channel, and the quotas, are ``channel_rights.owner_after``'s (typed
        refusals); the change is recorded under the actor's uid. ``check``: prove the key is a
        ready artifact first (``lookup``; its typed errors). Without it the caller vouches that
        nothing can evict the key before this call protects it (a publication's commit: the key
        is still being built)."""
        check_channel_name(name)
        if check:
            await self._lookup(key)
        self._pending[key] += 1  # protected from here on (no await since the lookup)
        try:
            async with self._lock:
                current = self._states.get(name)
                owner = owner_after(actor, name, current is not None, current.owner if current else None,
                                    (s.owner for s in self._states.values()))
                if current is not None and current.key == key:
                    return current, False
                durable = not self._volatile(key)
                generation = self._counter + 1
                state = moved(current, name, key, generation, time.time(), set_by, durable, uid=actor.uid,
                              owner=owner)
                states = {**self._states, name: state}
                await asyncio.to_thread(_write, self.path, document(states.values(), generation), durable)
                self._counter = generation
                self._commit(states)
                self.switches += 1
        finally:
            self._pending[key] -= 1
            if self._pending[key] <= 0:
                del self._pending[key]
        log.info("channel %s -> %s (generation %d, %s, by %s, uid %s)", name, key[:16], state.generation,
                 "durable" if state.durable else "non-durable", set_by, "hwrd" if actor.uid is None else actor.uid)
        self._wake(name)
        return state, True

    async def remove(self, name: str) -> ChannelState:
        """Remove a channel (durably); returns its last state. ``ChannelNotFound``."""
        check_channel_name(name)
        async with self._lock:
            current = self._states.get(name)
            if current is None:
                raise ChannelNotFound(f"no channel named {name!r}", details={"channel": name})
            states = {n: s for n, s in self._states.items() if n != name}
            await asyncio.to_thread(_write, self.path, document(states.values(), self._counter), True)
            self._commit(states)
        log.info("channel %s removed (it pointed to %s)", name, current.key[:16])
        return current

    def _commit(self, states: dict[str, ChannelState]) -> None:
        self._states = states
        self._protected = protected_keys(states.values())

    # watches ----------------------------------------------------------------------------------
    def watch(self, session_id: str, name: str) -> Watch:
        """Subscribe ``session_id`` to ``name`` (which may not exist yet)."""
        check_channel_name(name)
        mine = self._by_session.setdefault(session_id, set())
        if len(mine) >= MAX_WATCHES_PER_SESSION:
            raise InvalidRequest(f"a session may watch at most {MAX_WATCHES_PER_SESSION} channels at once",
                                 details={"limit": MAX_WATCHES_PER_SESSION})
        watch = Watch(self, session_id, name)
        mine.add(watch)
        self._watches.setdefault(name, set()).add(watch)
        return watch

    def _unwatch(self, watch: Watch) -> None:
        for table, key in ((self._watches, watch.name), (self._by_session, watch.session_id)):
            group = table.get(key)
            if group is not None:
                group.discard(watch)
                if not group:
                    del table[key]

    def _wake(self, name: str) -> None:
        for watch in self._watches.get(name, ()):
            watch.event.set()

    def session_ended(self, session_id: str) -> None:
        """End the watches of a session that ended (their streams end with SESSION_INVALID)."""
        for watch in list(self._by_session.get(session_id, ())):
            watch.ended = "session"
            watch.event.set()

    def close(self) -> None:
        """End every watch (hwrd is stopping: their streams end with UNAVAILABLE)."""
        for group in list(self._watches.values()):
            for watch in group:
                watch.ended = watch.ended or "stopping"
                watch.event.set()


def _write(path: Path, doc: dict[str, object], durable: bool) -> None:
    """Replace ``path`` with ``doc`` (temp file and rename); durable: fsync the file before the
    rename and the directory after it."""
    tmp = path.with_name(f".{FILE_NAME}.{uuid.uuid4().hex}.tmp")
    try:
        fd = store_io.create_file(tmp, canonical_json(doc), mode=0o600)
        try:
            if durable:
                store_io.fsync(fd)
        finally:
            os.close(fd)
        store_io.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if durable:
        store_io.fsync_dir(path.parent)
