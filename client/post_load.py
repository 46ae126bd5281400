"""Post-load publication: after a canonical start, publish the final layout for the next start.

``publish_after_load(client, identity, tensors)`` runs on a background thread by default (the
worker serves its first request meanwhile) and has its own report:

    outcome          | meaning
    -----------------+-------------------------------------------------------------
    RUNTIME_DISABLED | mode ``disabled``: nothing was published
    PUBLISHED        | this worker's bytes were committed
    ALREADY_PRESENT  | the artifact existed before this publication began
    JOINED           | another publisher of the same identity committed first
    FAILED           | anything went wrong; ``failure`` says what

A publication failure never changes the startup outcome: the worker already runs canonically;
only the next start stays cold. Contract: ``tensors`` must stay unmodified until the handle is
done (they are CPU tensors the worker keeps anyway, e.g. the offload backend's host copies).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hwr.client.errors import HwrError
from hwr.client.identity import ArtifactIdentity
from hwr.client.resolver import Failure, Stage, failure_of

__all__ = ["PublicationHandle", "PublicationOutcome", "PublicationReport", "publish_after_load"]


class PublicationOutcome(enum.StrEnum):
    RUNTIME_DISABLED = "runtime_disabled"
    PUBLISHED = "published"
    ALREADY_PRESENT = "already_present"
    JOINED = "joined"
    FAILED = "failed"


@dataclass(frozen=True)
class PublicationReport:
    key: str
    outcome: PublicationOutcome
    elapsed_s: float
    failure: Failure | None = None


class PublicationHandle:
    """A running or finished post-load publication."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._report: PublicationReport | None = None
        self.thread: threading.Thread | None = None

    def _finish(self, report: PublicationReport) -> None:
        self._report = report
        self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> PublicationReport:
        if not self._done.wait(timeout):
            raise TimeoutError("the post-load publication is still running")
        assert self._report is not None
        return self._report


def _publish(client: Any, identity: ArtifactIdentity, tensors: Mapping[str, torch.Tensor],
             buffers: tuple[str, ...], wait_timeout: float) -> PublicationReport:
    started = time.perf_counter()
    try:
        from hwr.client.publisher import specs_for

        with client.publisher(identity, specs_for(dict(tensors), buffers), wait_timeout=wait_timeout) as pub:
            if pub.outcome == "already_present":
                return PublicationReport(pub.key, PublicationOutcome.ALREADY_PRESENT, time.perf_counter() - started)
            if pub.outcome == "joined":
                return PublicationReport(pub.key, PublicationOutcome.JOINED, time.perf_counter() - started)
            for name, tensor in tensors.items():
                pub.write(name, tensor)
            key = pub.commit()
            outcome = PublicationOutcome.JOINED if pub.joined else PublicationOutcome.PUBLISHED
            return PublicationReport(key, outcome, time.perf_counter() - started)
    except HwrError as exc:
        return PublicationReport(identity.key, PublicationOutcome.FAILED, time.perf_counter() - started,
                                 failure_of(exc, Stage.PRODUCTION))
    except Exception as exc:  # a bug must not kill the serving worker; it is reported instead
        return PublicationReport(identity.key, PublicationOutcome.FAILED, time.perf_counter() - started,
                                 Failure(Stage.PRODUCTION, "PUBLICATION_FAILED", False, repr(exc)[:500]))


def publish_after_load(
    client: Any,
    identity: ArtifactIdentity,
    tensors: Mapping[str, torch.Tensor],
    *,
    buffers: tuple[str, ...] = (),
    background: bool = True,
    wait_timeout: float = 600.0,
) -> PublicationHandle:
    """Publish ``tensors`` as ``identity``'s final layout; ``client`` None means mode disabled."""
    handle = PublicationHandle()
    if client is None:
        handle._finish(PublicationReport(identity.key, PublicationOutcome.RUNTIME_DISABLED, 0.0))
        return handle

    def run() -> None:
        handle._finish(_publish(client, identity, tensors, buffers, wait_timeout))

    if background:
        handle.thread = threading.Thread(target=run, name="hwr-post-load-publish", daemon=True)
        handle.thread.start()
    else:
        run()
    return handle
