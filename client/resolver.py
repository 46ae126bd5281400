"""Resolution: what a worker does with its artifact identity at startup.

``resolve(identity, mode)`` returns a ``Resolution`` (a lease or none) and a typed
``ResolutionReport`` whose outcomes mean what vLLM-Omni's do:

    outcome            | when                                                       | lease
    -------------------+------------------------------------------------------------+------
    LOCAL_HIT          | hwrd had a valid artifact                                  | yes
    LOCAL_PRODUCTION   | the artifact was built during this resolution (a producer  | yes
                       | ran here, or another publisher's build was joined)         |
    CANONICAL_DIRECT   | mode ``disabled``: nothing was probed                      | no
    CANONICAL_FALLBACK | mode ``preferred`` and a miss, an invalid artifact or a    | no
                       | retryable failure (daemon unreachable, timeout, capacity)  |
    FAILED             | anything else, or any failure in mode ``required``         | no

The decision (``action_for``) is a pure function of the mode and the failure: preferred falls
back only for a miss, an invalid artifact or a retryable failure; identity collisions,
unsupported producers and configuration errors stay visible (FAILED) even in preferred mode;
required fails on anything but a lease. Mode ``disabled`` opens no socket and no file.

Limits: a resolution does not retry; a retryable failure in preferred mode falls back at once
(startup latency matters more than warming this start; ``publish_after_load`` warms the next).
"""

from __future__ import annotations

import enum
import os
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hwr.client.errors import (
    ArtifactDenied,
    ArtifactNotFound,
    ChecksumMismatch,
    HwrError,
    ManifestCorrupt,
    ManifestIncompatible,
)
from hwr.client.identity import ArtifactIdentity

__all__ = [
    "Action",
    "Attempt",
    "Failure",
    "Outcome",
    "Resolution",
    "ResolutionReport",
    "RuntimeMode",
    "Stage",
    "action_for",
    "failure_of",
    "resolve",
]


class RuntimeMode(enum.StrEnum):
    DISABLED = "disabled"
    PREFERRED = "preferred"
    REQUIRED = "required"

    @classmethod
    def parse(cls, value: RuntimeMode | str) -> RuntimeMode:
        try:
            return cls(value)
        except ValueError:
            from hwr.client.errors import ConfigError

            raise ConfigError(f"unknown host weight runtime mode {value!r}; use disabled, preferred or required",
                              details={"key": "mode"}) from None


class Outcome(enum.StrEnum):
    LOCAL_HIT = "local_hit"
    LOCAL_PRODUCTION = "local_production"
    CANONICAL_DIRECT = "canonical_direct"
    CANONICAL_FALLBACK = "canonical_fallback"
    FAILED = "failed"


class Stage(enum.StrEnum):
    CONFIGURATION = "configuration"
    DOMAIN = "domain"
    LOOKUP = "lookup"
    VALIDATION = "validation"
    PRODUCTION = "production"
    CAPACITY = "capacity"
    RESTORATION = "restoration"
    LIFECYCLE = "lifecycle"
    CANONICAL_LOADING = "canonical_loading"


class Action(enum.StrEnum):
    RETURN_LEASE = "return_lease"
    TRY_PRODUCER = "try_producer"
    CANONICAL_FALLBACK = "canonical_fallback"
    FAIL_STARTUP = "fail_startup"
    SKIP = "skip"


@dataclass(frozen=True)
class Failure:
    stage: Stage
    code: str
    retryable: bool
    message: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Attempt:
    stage: Stage
    result: str
    action: Action
    elapsed_s: float
    failure: Failure | None = None


@dataclass(frozen=True)
class ResolutionReport:
    id: str
    key: str
    mode: RuntimeMode
    outcome: Outcome
    attempts: tuple[Attempt, ...]
    elapsed_s: float

    @property
    def failure(self) -> Failure | None:
        for attempt in reversed(self.attempts):
            if attempt.failure is not None:
                return attempt.failure
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "key": self.key, "mode": self.mode.value, "outcome": self.outcome.value,
            "elapsed_s": self.elapsed_s,
            "attempts": [{"stage": a.stage.value, "result": a.result, "action": a.action.value,
                          "elapsed_s": a.elapsed_s,
                          "failure": None if a.failure is None else {
                              "stage": a.failure.stage.value, "code": a.failure.code,
                              "retryable": a.failure.retryable, "message": a.failure.message}}
                         for a in self.attempts],
        }


@dataclass
class Resolution:
    """The result of ``resolve``: ``lease`` is set exactly for LOCAL_HIT and LOCAL_PRODUCTION.

    ``client`` is the session the lease lives in (kept open for post-load publication too).
    """

    report: ResolutionReport
    lease: Any = None
    client: Any = None

    @property
    def outcome(self) -> Outcome:
        return self.report.outcome


_INVALID = (ArtifactDenied, ManifestCorrupt, ChecksumMismatch, ManifestIncompatible)
_STAGE_BY_CODE = {
    "LOCAL_MISS": Stage.LOOKUP, "ARTIFACT_DENIED": Stage.VALIDATION, "MANIFEST_CORRUPT": Stage.VALIDATION,
    "MANIFEST_INCOMPATIBLE": Stage.VALIDATION, "CHECKSUM_MISMATCH": Stage.VALIDATION,
    "DAEMON_UNAVAILABLE": Stage.DOMAIN, "DOMAIN_UNAVAILABLE": Stage.DOMAIN, "SESSION_INVALID": Stage.DOMAIN,
    "UNTRUSTED_DAEMON": Stage.DOMAIN,
    "PERMISSION_DENIED": Stage.DOMAIN, "DOMAIN_POLICY_MISMATCH": Stage.DOMAIN, "REMOTE_UNAVAILABLE": Stage.DOMAIN,
    "REMOTE_DENIED": Stage.DOMAIN,
    "ENOSPC": Stage.CAPACITY, "ARTIFACT_TOO_LARGE": Stage.CAPACITY, "STORE_LIMIT_EXCEEDED": Stage.CAPACITY,
    "INSUFFICIENT_CAPACITY": Stage.CAPACITY, "EXCEEDS_FILESYSTEM": Stage.CAPACITY,
    "INVALID_CONFIG": Stage.CONFIGURATION,
    "INVALID_IDENTITY": Stage.CONFIGURATION, "IDENTITY_COLLISION": Stage.PRODUCTION,
    "UNSUPPORTED": Stage.PRODUCTION, "PRODUCER_FAILED": Stage.PRODUCTION, "ACTIVE_BUILD_TIMEOUT": Stage.PRODUCTION,
}  # fmt: skip


def failure_of(exc: HwrError, stage: Stage | None = None) -> Failure:
    return Failure(stage or _STAGE_BY_CODE.get(exc.code, Stage.LOOKUP), exc.code, exc.retryable,
                   exc.message, dict(exc.details))


def action_for(mode: RuntimeMode, error: HwrError | None, *, can_produce: bool = False) -> Action:
    """The pure terminal rule (see the module table)."""
    if mode is RuntimeMode.DISABLED:
        return Action.SKIP
    if error is None:
        return Action.RETURN_LEASE
    if isinstance(error, (ArtifactNotFound, *_INVALID)):
        if can_produce:
            return Action.TRY_PRODUCER
        return Action.CANONICAL_FALLBACK if mode is RuntimeMode.PREFERRED else Action.FAIL_STARTUP
    if mode is RuntimeMode.PREFERRED and error.retryable:
        return Action.CANONICAL_FALLBACK
    return Action.FAIL_STARTUP


@dataclass(frozen=True)
class Producer:
    """An in-process producer for ``resolve``: the final layout's specs, then its tensors.

    ``specs`` must be known before producing (from the model skeleton) so that only the one
    publisher the daemon admits runs ``produce``; the others join its artifact.
    """

    specs: Sequence[Any]
    produce: Callable[[], Iterable[tuple[str, torch.Tensor]]]


class _Clock:
    def __init__(self) -> None:
        self.start = self.mark = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        lap, self.mark = now - self.mark, now
        return lap


def resolve(
    identity: ArtifactIdentity,
    mode: RuntimeMode | str,
    *,
    socket: str | os.PathLike[str] | None = None,
    client: Any = None,
    producer: Producer | None = None,
    timeout: float = 30.0,
    wait_timeout: float = 600.0,
) -> Resolution:
    """Resolve ``identity`` under ``mode``; never raises for a resolution failure (see the report).

    ``client``: an open ``hwr.client.Client`` to use (else one is connected and kept in the
    result). ``producer``: lets a miss build the artifact here (LOCAL_PRODUCTION) instead of
    falling back.
    """
    mode = RuntimeMode.parse(mode)
    clock = _Clock()
    rid = uuid.uuid4().hex[:12]
    key = identity.key
    attempts: list[Attempt] = []

    def done(outcome: Outcome, lease: Any = None, session: Any = None) -> Resolution:
        report = ResolutionReport(rid, key, mode, outcome, tuple(attempts), time.perf_counter() - clock.start)
        return Resolution(report, lease, session)

    if mode is RuntimeMode.DISABLED:
        attempts.append(Attempt(Stage.CONFIGURATION, "disabled", Action.SKIP, clock.lap()))
        return done(Outcome.CANONICAL_DIRECT)

    owned = client is None
    try:
        if client is None:
            from hwr.client.client import connect

            client = connect(Path(socket) if socket is not None else None, timeout=timeout)
        lease = client.acquire(identity, timeout=timeout)
        attempts.append(Attempt(Stage.LOOKUP, "hit", Action.RETURN_LEASE, clock.lap()))
        return done(Outcome.LOCAL_HIT, lease, client)
    except HwrError as exc:
        action = action_for(mode, exc, can_produce=producer is not None and client is not None)
        attempts.append(Attempt(failure_of(exc).stage, "miss" if isinstance(exc, ArtifactNotFound) else "error",
                                action, clock.lap(), failure_of(exc)))
    if action is Action.TRY_PRODUCER:
        assert producer is not None
        try:
            lease = _produce(client, identity, producer, wait_timeout=wait_timeout, timeout=timeout)
            attempts.append(Attempt(Stage.PRODUCTION, "built", Action.RETURN_LEASE, clock.lap()))
            return done(Outcome.LOCAL_PRODUCTION, lease, client)
        except HwrError as exc:
            action = action_for(mode, exc) if exc.retryable else Action.FAIL_STARTUP
            attempts.append(Attempt(Stage.PRODUCTION, "error", action, clock.lap(), failure_of(exc, Stage.PRODUCTION)))
    if owned and client is not None and action is not Action.CANONICAL_FALLBACK:
        client.close()
        client = None
    if action is Action.CANONICAL_FALLBACK:
        return done(Outcome.CANONICAL_FALLBACK, None, client)
    return done(Outcome.FAILED)


def _produce(client: Any, identity: ArtifactIdentity, producer: Producer, *, wait_timeout: float,
             timeout: float) -> Any:
    with client.publisher(identity, producer.specs, wait_timeout=wait_timeout) as pub:
        if pub.staged:
            for name, tensor in producer.produce():
                pub.write(name, tensor)
        key = pub.commit()
    return client.acquire(key, timeout=timeout)
