"""Publishing, the use case: begin, stage, commit, abort; one publisher per identity, waiters
join, dead publishers are reclaimed. Both transports call it (``hwr.daemon.peer.publication_frames``,
``hwr.daemon.rpc.servicer``) and only encode its results; daemon-side builds (prewarm, pulls)
call it too. It hands out the staging descriptors (``staging_descriptors``), plans the payloads
once (the plan sizes the capacity claim and lays the staging out) and tells
``hwr.daemon.service.capacity`` when its claim's retired bytes may go.

States of one publication (enforced here)::

    STAGED --commit--> COMMITTING --ok--> COMMITTED
       |                    `--error--> FAILED      (staging removed by the store)
       `--abort | session end--> ABORTED            (staging removed)

A second ``begin`` for a key that is STAGED/COMMITTING waits (up to its timeout) for the first
to finish: COMMITTED -> it is answered JOINED; FAILED/ABORTED -> it takes over and stages its
own; timeout -> ``ActiveBuildTimeout``. Staging descriptors are handed out only while STAGED,
so once COMMITTING starts nobody can obtain a new writable descriptor.

A publication may name a channel (``hwr.daemon.service.channels``): it is pointed at the key as
part of the commit, after the artifact is installed and before the publication is finished (so
the key is never an eviction candidate in between: it is still being built), or at the answer
to ``begin`` when the artifact is already present or joined. A failed channel change fails the
call; the artifact stays committed (publishing again sets the channel). A non-durable
publication (``durable=False``) is committed without fsync (``hwr.daemon.store.volatile``).

Contract: called on the daemon's event loop; blocking store work runs in worker threads.
Limit: one daemon per store root (the store's lock), so "one publisher per identity" is node-wide.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import os
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hwr.client.channels import check_channel_name
from hwr.client.errors import (
    ActiveBuildTimeout,
    ArtifactNotFound,
    HwrError,
    InvalidRequest,
    PermissionDeniedError,
    PublicationFailed,
)
from hwr.client.identity import ArtifactIdentity
from hwr.client.wire import close_fds
from hwr.daemon.policy.channel_rights import Actor
from hwr.daemon.service import handover
from hwr.daemon.service.sessions import Session
from hwr.daemon.store.prehash import prehash
from hwr.daemon.store.reuse import ReuseSource, open_reuse
from hwr.daemon.store.staging import overlap_file_bytes, plan_payloads
from hwr.daemon.system.exclusive import open_sole

if TYPE_CHECKING:
    from hwr.daemon.service.capacity import Capacity, Claim
    from hwr.daemon.service.catalog import Catalog
    from hwr.daemon.service.channels import Channels
    from hwr.daemon.store.inspection import ArtifactRecord
    from hwr.daemon.store.root import Store
    from hwr.daemon.store.staging import ProducerDigests, StagedTensor, Staging
    from hwr.daemon.store.writer_bounds import MemfdStagings

__all__ = ["DAEMON_OWNER", "BeginResult", "PubState", "Publication", "Publishing"]

#: ``session_id`` of publications that daemon-side builds (prewarm producers) own.
DAEMON_OWNER = "hwrd"
#: Threads staging and committing at once, when the caller does not say (the daemon passes its
#: ``commit_threads`` setting): under churn each commit mostly waits to re-take the interpreter
#: lock after its system calls, and concurrent commits share the ``artifacts/`` directory fsync
#: (``store_io.GroupSync``), so more threads than cores finish more commits per second.
COMMIT_THREADS = 8


class PubState(enum.Enum):
    STAGED = "staged"
    COMMITTING = "committing"
    COMMITTED = "committed"
    FAILED = "failed"
    ABORTED = "aborted"


@dataclass
class Publication:
    publication_id: str
    token: str
    key: str
    session_id: str
    staging: Staging
    state: PubState = PubState.STAGED
    done: asyncio.Event = field(default_factory=asyncio.Event)
    started_at: float = 0.0  # loop time when staged (the stalled-publisher deadline counts from it)
    claim: Claim | None = None  # its admission + capacity reservation (``service.capacity``)
    channel: str | None = None  # pointed at the key as part of the commit
    channel_actor: Actor | None = None  # who sets it (the publishing uid and its role)
    durable: bool = True  # False: no fsync, removed at the next start (store.volatile)
    # Files handed over by the writer (``file_done``), by index: their hashing in flight or done
    # (``store.prehash``; a None result: the commit hashes that file itself).
    prehashed: dict[int, handover.Job] = field(default_factory=dict)
    reuse: ReuseSource | None = None  # the base whose tensors this publication takes (store.reuse)
    # The stall timeout's state (housekeeping): the progress marks last seen and when they changed.
    progress: tuple[int, ...] | None = None
    progress_at: float = 0.0


@dataclass(frozen=True)
class BeginResult:
    outcome: str  # "staged" | "already_present" | "joined"
    key: str
    publication: Publication | None = None

    @property
    def reused(self) -> list[str]:
        """Tensors hwrd takes from the base (the writer must not write them), by name."""
        pub = self.publication
        return sorted(pub.reuse.tensors) if pub is not None and pub.reuse is not None else []


def _root_is_operator(session: Session) -> bool:
    return session.cred.uid == 0


class Publishing:
    """Publications in flight of one store (see the module docstring)."""

    def __init__(self, store: Store, catalog: Catalog, *, on_commit: Callable[[str], None] | None = None,
                 capacity: Capacity | None = None, commit_threads: int = COMMIT_THREADS,
                 on_phase: Callable[[str, float], None] | None = None,
                 memfd_staging: MemfdStagings | None = None, channels: Channels | None = None,
                 is_operator: Callable[[Session], bool] | None = None) -> None:
        self._store = store  # writes: begin, commit, abort
        self._catalog = catalog  # reads: whether a key is present, a reuse base's record and payloads
        # ``on_phase(phase, seconds)`` after each successful phase of a publication (admission,
        # staging, writing, commit: ``hwr.daemon.system.metrics.PUBLICATION_PHASES``), on the loop.
        self._on_phase = on_phase
        # The store's capacity (None: unlimited, no admission): ``admit`` -> a claim before
        # staging, ``allocated`` once preallocated, ``finished`` at the end.
        self._capacity = capacity
        self._cancelled: dict[str, str] = {}
        self._by_id: dict[str, Publication] = {}
        self._by_key: dict[str, Publication] = {}
        self._on_commit = on_commit
        self._commit_pool = concurrent.futures.ThreadPoolExecutor(commit_threads, thread_name_prefix="hwr-commit")
        # Hashing of handed-over files (``file_done``): its own threads, so that a commit never
        # waits for a pool that its own publication's hashing occupies.
        self._prehash_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="hwr-prehash")
        self.committed = 0
        self.failed = 0
        # Sealed memfd staging of small client publications (hwr.daemon.store.writer_bounds);
        # None: every publication writes its staging files.
        self.memfd_staging = memfd_staging
        # The channels a publication may set (hwr.daemon.service.channels); None: a publication
        # that names a channel is refused.
        self.channels = channels
        # Whether a session's caller holds the operator role (the daemon's current roles, read at
        # each call): an operator's publication may repoint any channel (policy.channel_rights).
        self.is_operator: Callable[[Session], bool] = is_operator or _root_is_operator

    def active(self) -> list[Publication]:
        return list(self._by_id.values())

    def _exists(self, key: str) -> bool:
        try:
            self._catalog.record_blocking(key)
        except ArtifactNotFound:
            return False
        return True

    async def begin(
        self,
        session: Session | None,
        identity: ArtifactIdentity,
        specs: Sequence[StagedTensor],
        *,
        wait_timeout: float,
        format_metadata: dict[str, Any] | None = None,
        channel: str | None = None,
        durable: bool = True,
        overlap: bool = False,
        reuse_base: str | None = None,
        reuse: Sequence[str] = (),
    ) -> BeginResult:
        """Stage a publication of ``identity`` (or join/answer one already present; see the
        module docstring). ``channel``: point it at the key as part of the commit (or now, when
        the artifact is present); ``durable`` False: a non-durable publication; ``overlap``: lay
        it out in several files (``staging.overlap_file_bytes``) that the writer may hand over
        one by one to be hashed while it writes the next (``file_done``); ``reuse_base`` and
        ``reuse``: tensors equal to that artifact's, which hwrd takes from it
        (``store.reuse``; ``BeginResult.reused`` says which, none when the base is no longer
        there: then the writer writes every tensor)."""
        key = identity.key
        actor = None
        if channel is not None:
            check_channel_name(channel)
            if self.channels is None:
                raise InvalidRequest("this hwrd serves no channels", details={"field": "channel"})
            actor = Actor(None, True) if session is None else Actor(session.cred.uid, self.is_operator(session))
            self.channels.may_set(channel, actor)  # refused before anything is staged
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, wait_timeout)
        waited = False
        while True:
            # Provably absent (not validated, not denied, no directory): no thread hop.
            absent = self._catalog.absent_now(key)
            if not absent and await asyncio.to_thread(self._exists, key):
                if channel is not None and self.channels is not None and actor is not None:
                    await self.channels.set(channel, key, set_by="publication", check=True, actor=actor)
                return BeginResult("joined" if waited else "already_present", key)
            current = self._by_key.get(key)
            if current is None:
                break
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise ActiveBuildTimeout(
                    "another publisher of this identity is still building", details={"key": key}
                )
            waited = True
            try:
                await asyncio.wait_for(current.done.wait(), remaining)
            except TimeoutError:
                raise ActiveBuildTimeout(
                    "another publisher of this identity is still building", details={"key": key}
                ) from None
        # Reserve the key before the (slow) staging so a concurrent begin waits on us.
        # session None: a daemon-side build (prewarm); it is owned by its build task, not a session.
        owner = session.session_id if session is not None else DAEMON_OWNER
        raw = secrets.token_bytes(32)  # one getrandom for the id and the secret token
        pub = Publication(raw[:8].hex(), raw[8:].hex(), key, owner, None, channel=channel, channel_actor=actor,
                          durable=durable)
        max_file_bytes = overlap_file_bytes(sum(_nbytes(s) for s in specs)) if overlap else None
        self._by_key[key] = pub
        self._by_id[pub.publication_id] = pub
        phase = self._on_phase
        try:
            # Planned once (this validates the specs): capacity reserves its bytes, the store lays it out.
            plans = plan_payloads(list(specs), max_file_bytes)
            capacity = self._capacity
            if capacity is not None:
                began = loop.time()
                pub.claim = await capacity.admit(key, sum(p.size for p in plans), deadline - loop.time())
                if phase is not None:
                    phase("admission", loop.time() - began)
            claim = pub.claim

            def stage() -> tuple[Staging, ReuseSource | None]:  # one worker hop: free, stage, open the base
                if capacity is not None and claim is not None:
                    capacity.before_staging(claim)
                source = self._open_reuse(reuse_base, reuse, specs) if reuse_base and reuse else None
                try:
                    return self._store.installer.begin(identity, specs, format_metadata=format_metadata,
                                                       max_file_bytes=max_file_bytes, plans=plans), source
                except BaseException:
                    if source is not None:
                        source.close()
                    raise

            began = loop.time()
            pub.staging, pub.reuse = await loop.run_in_executor(self._commit_pool, stage)
            if capacity is not None and claim is not None:
                capacity.allocated(claim)
        except BaseException:
            self._finish(pub, PubState.FAILED)
            raise
        pub.started_at = loop.time()
        if phase is not None:
            phase("staging", pub.started_at - began)
        if session is not None:
            session.publications.add(pub.publication_id)
        return BeginResult("staged", key, pub)

    def _open_reuse(self, base: str, names: Sequence[str], specs: Sequence[StagedTensor]) -> ReuseSource | None:
        """The base's ``ReuseSource`` (blocking); None when the base cannot be read any more
        (evicted, denied): the writer then writes every tensor. A request that names tensors
        the base does not have as specified is ``InvalidRequest``."""
        try:
            record = self._catalog.record_blocking(base)
            fds = self._catalog.open_payloads(record)
        except InvalidRequest:
            raise
        except HwrError:
            return None
        return open_reuse(record, fds, list(names), {s.name: s for s in specs})

    def progress_marks(self, pub: Publication) -> tuple[int, ...]:
        """What changes while ``pub``'s writer writes (blocking: ``stat`` of its staging): per
        staging file and memfd its size, blocks and modification time, plus the files handed
        over. A file that cannot be looked at counts as -1s (it changes nothing by itself)."""
        marks: list[int] = [len(pub.prehashed)]
        for _name, path, _size in pub.staging.files:
            try:
                st = os.stat(path, follow_symlinks=False)
            except OSError:
                marks += [-1, -1, -1]
                continue
            marks += [st.st_size, st.st_blocks, st.st_mtime_ns]
        if self.memfd_staging is not None:
            marks += self.memfd_staging.progress_marks(pub.publication_id)
        return tuple(marks)

    def get(self, session: Session, publication_id: str, token: str | None = None) -> Publication:
        pub = self._by_id.get(publication_id)
        if pub is None and publication_id in self._cancelled:
            raise PublicationFailed(f"the publication was cancelled: {self._cancelled[publication_id]}",
                                    details={"publication_id": publication_id})
        if pub is None or pub.session_id != session.session_id:
            raise PermissionDeniedError("no such publication in the caller's session")
        if token is not None and not secrets.compare_digest(pub.token, token):
            raise PermissionDeniedError("wrong publication token")
        return pub

    def staged_publication(self, session: Session, publication_id: str, token: str) -> Publication:
        """The session's STAGED publication (its token checked): the only state that hands out
        writable staging descriptors."""
        pub = self.get(session, publication_id, token)
        if pub.state is not PubState.STAGED:
            raise PublicationFailed("the publication is no longer accepting writes")
        return pub

    def writable_publication(self, session: Session, publication_id: str, token: str) -> Publication:
        """``staged_publication`` whose writer has handed no file over: once one was (it is
        being hashed), no writable staging descriptor is handed out again (``store.prehash``)."""
        pub = self.staged_publication(session, publication_id, token)
        if pub.prehashed:
            raise PublicationFailed("files of this publication were handed over; its staging descriptors "
                                    "are not handed out again")
        return pub

    def file_done(self, session: Session, publication_id: str, token: str, index: int) -> None:
        """The writer handed file ``index`` over (it closed its descriptor of it): prove that and
        hash the file in the background while the rest is written (``store.prehash``; the
        commit uses the result). Returns at once. A memfd-staged (small) publication is hashed
        at commit only: it is refused here, as is a file handed over twice."""
        pub = self.staged_publication(session, publication_id, token)
        files = pub.staging.plans
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(files):
            raise InvalidRequest("file_index is out of range", details={"field": "file_index"})
        if self.memfd_staging is not None and self.memfd_staging.eligible(pub.staging):
            raise InvalidRequest("a small publication is hashed at its commit", details={"field": "file_index"})
        if index in pub.prehashed:
            raise InvalidRequest("that file was handed over already", details={"file_index": index})
        loop = asyncio.get_running_loop()
        pub.prehashed[index] = loop.run_in_executor(self._prehash_pool, prehash, pub.staging, index, pub.reuse)

    def staging_descriptors(self, session: Session, publication_id: str, token: str) -> list[int]:
        """Writable descriptors of a publication ``session`` staged (its token checked; see
        ``writable_publication``), in file order; the caller sends and closes them. A sealed
        memfd per file for a publication small enough (``store.writer_bounds``: it cannot grow
        by one byte), else the staging files opened ``O_RDWR|O_NOFOLLOW``."""
        pub = self.writable_publication(session, publication_id, token)
        memfds = self.memfd_staging
        if memfds is not None and memfds.eligible(pub.staging):
            return memfds.descriptors(pub.publication_id, pub.staging)
        fds: list[int] = []
        try:
            for _name, path, _size in pub.staging.files:
                fds.append(os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC))
        except BaseException:
            close_fds(fds)
            raise
        return fds

    async def commit(
        self, session: Session, publication_id: str, expected: Mapping[str, str]
    ) -> tuple[ArtifactRecord, bool]:
        return await self.commit_publication(self.get(session, publication_id), expected)

    async def commit_publication(self, pub: Publication, expected: Mapping[str, str], *,
                                 trusted_digests: ProducerDigests | None = None) -> tuple[ArtifactRecord, bool]:
        """Commit ``pub`` (already authorised: its session's, or a daemon-side build's).

        ``trusted_digests`` (``ProducerDigests``) only ever comes from a daemon-owned producer
        (``hwr.daemon.producers.build``); a client's commit never passes it.
        """
        if pub.state is not PubState.STAGED:
            raise PublicationFailed(f"the publication is {pub.state.value}")
        for name, digest in expected.items():
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise InvalidRequest("expected_sha256 values must be 64 lowercase hex digits",
                                     details={"tensor": name[:200]})
        pub.state = PubState.COMMITTING
        paths = [Path(path) for _n, path, _s in pub.staging.files]
        loop = asyncio.get_running_loop()
        began = loop.time()
        # Files hashed while the rest was written: the commit takes their descriptors (and
        # closes them, whatever happens); one whose hashing failed is hashed by the commit.
        jobs, pub.prehashed = list(pub.prehashed.values()), {}
        try:
            prehashed = await handover.collect(jobs)
        except BaseException:  # cancelled: the publication fails (collect released the rest)
            self._finish(pub, PubState.FAILED)
            raise

        def checks_and_commit() -> tuple[bool, Any]:
            """One worker hop: the quick checks, then the commit. A failed check leaves the
            publication STAGED (the writer may close its descriptor and retry); a failed commit
            fails it. Commits (hashing, fsyncs) run on their own threads: in the loop's default
            executor they would make every quick hop (acquire lookups) queue behind an fsync."""
            opened: dict[str, int] = {name: done.fd for name, done in prehashed.items()}
            try:
                if self.memfd_staging is not None:  # memfd staging: copy it into the files first
                    self.memfd_staging.drain(pub.publication_id, pub.staging)
                for index, path in enumerate(paths):
                    if path.name in opened:
                        continue
                    if pub.reuse is not None and pub.reuse.covers(pub.staging.plans[index]):
                        # hwrd's own copy of the reused tensors (after the sole-opener proof)
                        done = prehash(pub.staging, index, pub.reuse)
                        if done is None:
                            opened[path.name] = open_sole(path)  # raises when a writer holds it
                            raise PublicationFailed("the reused tensors could not be copied from the base",
                                                    details={"file": path.name, "base": pub.reuse.base_key})
                        prehashed[done.name] = done
                        opened[path.name] = done.fd
                    else:
                        opened[path.name] = open_sole(path)
                existed = self._exists(pub.key)
            except BaseException as exc:
                for fd in opened.values():
                    os.close(fd)
                return False, exc
            record = self._store.installer.commit(  # closes ``opened``
                pub.staging, expected_tensor_sha256=dict(expected) or None, trusted_digests=trusted_digests,
                opened=opened, durable=pub.durable, prehashed=prehashed)
            if self._capacity is not None and pub.claim is not None:
                self._capacity.after_commit(pub.claim)  # the retirements it waited for are durable now
            return True, (existed, record)

        try:
            checked, outcome = await loop.run_in_executor(self._commit_pool, checks_and_commit)
        except BaseException:
            self._finish(pub, PubState.FAILED)
            raise
        if not checked:
            pub.state = PubState.STAGED
            raise outcome
        existed, record = outcome
        if pub.channel is not None and self.channels is not None and pub.channel_actor is not None:
            try:  # still building: the key cannot be evicted before the channel protects it
                await self.channels.set(pub.channel, record.key, set_by="publication", actor=pub.channel_actor)
            except BaseException:
                self._finish(pub, PubState.COMMITTED)  # the artifact is committed all the same
                raise
        if self._on_phase is not None:  # with _finish below in one loop step: scrapes agree
            self._on_phase("writing", max(0.0, began - pub.started_at))
            self._on_phase("commit", loop.time() - began)
        self._finish(pub, PubState.COMMITTED)
        if self._on_commit is not None:
            self._on_commit(pub.key)
        return record, existed

    async def abort(self, session: Session, publication_id: str) -> bool:
        pub = self.get(session, publication_id)
        return await self._abort(pub)

    async def abort_publication(self, pub: Publication) -> bool:
        """Abort ``pub`` (a daemon-side build's); False if it was no longer STAGED."""
        return await self._abort(pub)

    async def _abort(self, pub: Publication) -> bool:
        if pub.state is not PubState.STAGED:
            return False
        pub.state = PubState.ABORTED
        try:
            if pub.prehashed:
                # The abort truncates the staging files: never under a file hwrd still hashes
                # (through a mapping, a truncated page is a SIGBUS) or copies reused bytes into.
                await asyncio.wait([asyncio.shield(f) for f in pub.prehashed.values()])
            await asyncio.to_thread(self._store.installer.abort, pub.staging)
        finally:
            self._finish(pub, PubState.ABORTED)
        return True

    def live_count(self, session: Session) -> int:
        """Publications of ``session`` still in flight; forgets the ids of finished ones."""
        session.publications.intersection_update(self._by_id)
        return len(session.publications)

    async def abort_session(self, session: Session) -> int:
        """Abort every STAGED publication of an ended session (its writer is gone)."""
        count = 0
        for pub_id in list(session.publications):
            pub = self._by_id.get(pub_id)
            if pub is not None and await self._abort(pub):
                count += 1
        session.publications.clear()
        return count

    async def cancel(self, publication_id: str, reason: str) -> bool:
        """Cancel a STAGED publication (stalled past its deadline); its writer's commit then fails."""
        pub = self._by_id.get(publication_id)
        if pub is None or pub.state is not PubState.STAGED:
            return False
        if len(self._cancelled) > 4096:
            self._cancelled.clear()
        self._cancelled[publication_id] = reason
        return await self._abort(pub)

    def _finish(self, pub: Publication, state: PubState) -> None:
        if pub.done.is_set():
            return
        jobs, pub.prehashed = list(pub.prehashed.values()), {}
        handover.release(jobs)  # an abort or cancel: nothing takes their descriptors
        if pub.reuse is not None:  # once no hashing job reads the base any more
            handover.after_all(jobs, pub.reuse.close)
        if self.memfd_staging is not None:
            self.memfd_staging.discard(pub.publication_id)
        if self._capacity is not None and pub.claim is not None:
            self._capacity.finished(pub.claim, state is PubState.COMMITTED)
        pub.state = state
        if state is PubState.COMMITTED:
            self.committed += 1
        elif state is PubState.FAILED:
            self.failed += 1
        self._by_id.pop(pub.publication_id, None)
        if self._by_key.get(pub.key) is pub:
            del self._by_key[pub.key]
        pub.done.set()


def _nbytes(spec: StagedTensor) -> int:
    count = 1
    for d in spec.shape:
        count *= d
    return count * spec.info.itemsize

