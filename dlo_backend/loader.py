"""The loader transaction: from an artifact identity to a model serving with layerwise offload.

``start_worker(...)`` is what a worker does at startup. States (enforced here, in order)::

    UNRESOLVED -> LEASE_OWNED_BY_LOADER -> RESTORE_PLANNED -> COMMIT_STARTED -> CARRIER_OWNED
               -> BACKEND_OWNED -> BACKEND_READY -> IN_SERVICE
    UNRESOLVED -> CANONICAL (disabled mode, a fallback, or recovery) -> IN_SERVICE

Failure rules:
- before COMMIT_STARTED (resolution or planning failed): the lease is closed; ``preferred`` loads
  the *untouched* skeleton path canonically, ``required`` raises ``StartupFailed``;
- from COMMIT_STARTED on (commit, carrier hand-off, backend enable): the model is discarded (it
  may be half bound), the lease is closed by its current owner (plan, carrier or backend);
  ``preferred`` builds a *fresh* model canonically bypassing hwr, ``required`` raises.

After a canonical start in ``preferred`` mode, the final layout is published to hwrd on a
background thread (``publication``); its outcome never changes the startup outcome.
A warm start (LOCAL_HIT) performs zero canonical loads: the skeleton is bound to lease views.

``fault`` is a test hook called with each state name as it is entered (to inject failures).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hwr.client.errors import StartupFailed
from hwr.client.identity import ArtifactIdentity
from hwr.client.post_load import PublicationHandle, publish_after_load
from hwr.client.resolver import Outcome, Resolution, RuntimeMode, resolve
from hwr.client.restore import plan_restore

__all__ = ["LoaderState", "WorkerStartup", "start_worker"]

log = logging.getLogger("hwr.loader")


class LoaderState(enum.StrEnum):
    UNRESOLVED = "unresolved"
    LEASE_OWNED_BY_LOADER = "lease_owned_by_loader"
    RESTORE_PLANNED = "restore_planned"
    COMMIT_STARTED = "commit_started"
    CARRIER_OWNED = "carrier_owned"
    BACKEND_OWNED = "backend_owned"
    BACKEND_READY = "backend_ready"
    CANONICAL = "canonical"
    IN_SERVICE = "in_service"


@dataclass
class WorkerStartup:
    model: nn.Module
    outcome: Outcome
    resolution: Resolution
    offload: Any = None
    publication: PublicationHandle | None = None
    states: list[LoaderState] = field(default_factory=list)
    recovered_from: str | None = None
    elapsed_s: float = 0.0

    def close(self) -> None:
        """Remove offload hooks (closing the lease) and end the hwrd session; idempotent."""
        if self.offload is not None:
            self.offload.close()
        if self.publication is not None and self.publication.thread is not None:
            self.publication.thread.join()
        client = self.resolution.client
        if client is not None:
            client.close()


def start_worker(
    *,
    identity: ArtifactIdentity,
    build_skeleton: Callable[[], nn.Module],
    load_canonical: Callable[[], nn.Module],
    mode: RuntimeMode | str,
    device: torch.device | str = "cpu",
    offload: bool = True,
    offload_kwargs: dict[str, Any] | None = None,
    socket: str | None = None,
    client: Any = None,
    publish: bool = True,
    background_publish: bool = True,
    fault: Callable[[LoaderState], None] | None = None,
) -> WorkerStartup:
    started = time.perf_counter()
    mode = RuntimeMode.parse(mode)
    states: list[LoaderState] = []
    kwargs = dict(offload_kwargs or {})

    def enter(state: LoaderState) -> None:
        states.append(state)
        if fault is not None:
            fault(state)

    def fail(message: str, resolution: Resolution, cause: BaseException | None = None) -> StartupFailed:
        if resolution.client is not None:
            resolution.client.close()
        details = {"outcome": resolution.outcome.value, "states": ",".join(s.value for s in states)}
        if cause is not None:
            details["cause"] = f"{type(cause).__name__}: {cause}"[:300]
        return StartupFailed(message, details=details, report=resolution.report)

    def recover(resolution: Resolution, exc: Exception, failed: str, fallback: str,
                recovered_from: str) -> WorkerStartup:
        """``required``: raise ``StartupFailed``; ``preferred``: a canonical start instead."""
        if mode is RuntimeMode.REQUIRED:
            raise fail(failed, resolution, exc) from exc
        log.warning("%s (%s); %s", failed, exc, fallback)
        return _canonical(identity, resolution, load_canonical, device, offload, kwargs, publish=False,
                          background=background_publish, states=states, enter=enter,
                          recovered_from=recovered_from, started=started)

    enter(LoaderState.UNRESOLVED)
    resolution = resolve(identity, mode, socket=socket, client=client)
    if resolution.outcome is Outcome.FAILED:
        raise fail(f"host weight runtime ({mode.value}) could not provide {identity.key[:12]}", resolution)

    if resolution.lease is not None:
        lease = resolution.lease
        owner = "loader"
        try:
            enter(LoaderState.LEASE_OWNED_BY_LOADER)
            skeleton = build_skeleton()
            plan = plan_restore(skeleton, lease)
            enter(LoaderState.RESTORE_PLANNED)
        except Exception as exc:
            lease.close()
            return recover(resolution, exc, "restore planning failed", "loading canonically", "planning")
        carrier: Any = None
        handle: Any = None
        try:
            enter(LoaderState.COMMIT_STARTED)
            carrier = plan.commit()
            owner = "carrier"
            enter(LoaderState.CARRIER_OWNED)
            if offload:
                owner = "backend"
                from hwr.dlo_backend.offload import apply_layerwise_offload

                handle = apply_layerwise_offload(skeleton, device=device, host_source=carrier, **kwargs)
                enter(LoaderState.BACKEND_OWNED)
                enter(LoaderState.BACKEND_READY)
            else:
                # Without offload the model keeps the lease views; the carrier's holder owns it.
                handle = _LeaseHolder(carrier.take())
            enter(LoaderState.IN_SERVICE)
            return WorkerStartup(skeleton, resolution.outcome, resolution, handle, None, states,
                                 elapsed_s=time.perf_counter() - started)
        except Exception as exc:
            # The lease is closed by whoever owns it now; the half-bound model is dropped.
            _close_owner(owner, lease, carrier, handle)
            del skeleton
            return recover(resolution, exc, "startup failed after restore commit began",
                           "building a fresh model canonically", "commit")

    return _canonical(identity, resolution, load_canonical, device, offload, kwargs,
                      publish=publish and mode is not RuntimeMode.DISABLED, background=background_publish,
                      states=states, enter=enter, recovered_from=None, started=started)


class _LeaseHolder:
    """Owns a lease for a model that is served without offload."""

    def __init__(self, lease: Any) -> None:
        self.lease = lease

    def close(self) -> None:
        self.lease.close()


def _close_owner(owner: str, lease: Any, carrier: Any, handle: Any) -> None:
    if owner == "backend" and handle is not None:
        handle.close()
    elif carrier is not None:
        carrier.close()
    lease.close()  # idempotent: covers the loader-owned and backend-failed cases


def _canonical(identity: ArtifactIdentity, resolution: Resolution, load_canonical: Callable[[], nn.Module],
               device: torch.device | str, offload: bool, kwargs: dict[str, Any], *, publish: bool,
               background: bool, states: list[LoaderState], enter: Callable[[LoaderState], None],
               recovered_from: str | None, started: float) -> WorkerStartup:
    enter(LoaderState.CANONICAL)
    model = load_canonical()
    # Capture the final layout before offload swaps block weights for placeholders; these CPU
    # tensors stay alive as the backend's host source, so publishing them copies nothing.
    final = {name: t for name, t in model.state_dict(keep_vars=False).items()}
    buffers = tuple(name for name, _ in model.named_buffers())
    handle = None
    if offload:
        from hwr.dlo_backend.offload import apply_layerwise_offload

        handle = apply_layerwise_offload(model, device=device, **kwargs)
    publication = None
    if publish and resolution.client is not None and recovered_from is None:
        publication = publish_after_load(resolution.client, identity, final, buffers=buffers, background=background)
    outcome = resolution.outcome if recovered_from is None else Outcome.CANONICAL_FALLBACK
    enter(LoaderState.IN_SERVICE)
    return WorkerStartup(model, outcome, resolution, handle, publication, states, recovered_from,
                         time.perf_counter() - started)
