"""The ranks of a diffusion job agree on one resolution outcome before any of them loads.

Without it a cold start's ranks race the publication: the first rank to finish its canonical load
publishes the final layout into hwrd, and a rank that resolves after that gets a LOCAL_HIT while
its peers loaded canonically. A DP group then mixes paths (leased views on one rank, private
tensors on another), and DLO's AllGather, which must run one transport on every rank, falls back
to vLLM-Omni's own private shards for that start.

So every hwrd-backed ``HostWeightRuntime.resolve`` (the loader's one lookup, before any restore or
weight load) is followed by an exchange of each rank's outcome over all ranks of the job
(``torch.distributed``'s world: every diffusion worker loads the pipeline at the same point of its
startup), and each rank then takes the agreed one:

    every rank LOCAL_HIT (a lease)               -> LOCAL_HIT everywhere (unchanged)
    some rank did not hit, preferred mode         -> the ranks that hit close their lease and take
                                                     CANONICAL_FALLBACK (loaded canonically; the
                                                     post-load publication then finds the artifact
                                                     already present or joins it)
    some rank did not hit, required mode          -> the ranks that hit close their lease and fail
                                                     the start naming the ranks that did not
    this rank did not hit                         -> its own outcome (unchanged)

On a cold start all ranks therefore miss, because no rank can publish before every rank has
resolved (each waits for the others' outcomes first): all load canonically, one publishes, the
next start is a LOCAL_HIT on every rank.

How: not a collective on any process group. Each rank writes its outcome under a key of the job's
``torch.distributed`` store and waits for every rank's key (``store.wait`` with a timeout), so
nothing is issued on a communicator the model or the caller uses for their own collectives on
the same ranks, whatever thread issues those and in whatever order. Keys are numbered per process
(every rank resolves the same number of times in the same order) and deleted by the last reader.
A rank whose ``resolve`` raises still writes (a failure) before re-raising, so its peers never wait
for it; a peer that died is waited for at most ``timeout_s`` (the runtime's coordination timeout
plus ``SKEW_S``), then the start fails naming the ranks that never answered.

Without ``torch.distributed`` initialized, or with one rank, ``resolve`` is unchanged.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["FAILED", "HIT", "MISS", "SKEW_S", "decide", "exchange", "install_on"]

log = logging.getLogger("hwr.vllm_plugin")

FAILED, MISS, HIT = 0, 1, 2  # this rank's outcome, as exchanged (the agreed one is the minimum)
#: How much later than the slowest rank's resolve a peer may reach the exchange (model
#: construction before the lookup differs between ranks on a loaded node).
SKEW_S = 300.0
_PREFIX = "hwr-vllm-omni-resolve"
_sequence = itertools.count()


def decide(codes: list[int]) -> tuple[int, list[int]]:
    """The agreed outcome (the lowest of every rank's) and the ranks below ``HIT``; pure."""
    return min(codes), [rank for rank, code in enumerate(codes) if code < HIT]


def _world() -> tuple[int, int] | None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    return dist.get_rank(), dist.get_world_size()


def exchange(code: int, rank: int, world: int, timeout_s: float) -> list[int]:
    """Every rank's ``code`` in rank order, through the job's store (see the module docstring).

    Raises ``RuntimeError`` naming the ranks that did not answer within ``timeout_s``.
    """
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()  # the job's rendezvous store (no collective)
    prefix = f"{_PREFIX}/{next(_sequence)}/"
    keys = [f"{prefix}{r}" for r in range(world)]
    store.set(keys[rank], str(code))
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as exc:  # torch raises its DistStoreError (a RuntimeError) on timeout
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise RuntimeError(f"Host Weight Runtime: ranks {missing} did not report their hwrd lookup within "
                           f"{timeout_s:.0f} s ({exc}); every rank must resolve before any loads") from exc
    codes = [int(store.get(key)) for key in keys]
    if store.add(f"{prefix}read", 1) == world:  # the last reader removes the round's keys
        for key in (*keys, f"{prefix}read"):
            store.delete_key(key)
    return codes


def _code(resolution: Any) -> int:
    from vllm_omni.host_weight_runtime import ResolutionOutcome

    outcome = resolution.report.outcome
    if resolution.lease is not None:
        return HIT
    return FAILED if outcome is ResolutionOutcome.FAILED else MISS


def _overruled(runtime: Any, resolution: Any, others: list[int], started: float) -> Any:
    """This rank's resolution when it hit but ranks ``others`` did not: its lease closed, and
    CANONICAL_FALLBACK (preferred) or FAILED (required), with an attempt that says why."""
    from vllm_omni.host_weight_runtime import (
        AttemptResult,
        CanonicalJson,
        FailureCode,
        HostWeightFailure,
        HostWeightResolution,
        ResolutionAction,
        ResolutionAttempt,
        ResolutionOutcome,
        ResolutionReport,
        ResolutionStage,
        RuntimeMode,
    )

    resolution.lease.close()
    preferred = runtime.config.mode is RuntimeMode.PREFERRED
    message = (f"ranks {others} of this job did not get a lease from hwrd for this start; every rank takes one "
               "path (a DP group never mixes leased and canonically loaded weights)")
    failure = HostWeightFailure(stage=ResolutionStage.LOOKUP, code=FailureCode.PRODUCER_UNAVAILABLE,
                                retryable=preferred, message=message,
                                details=CanonicalJson.from_value({"ranks": [str(r) for r in others]}))
    attempt = ResolutionAttempt(
        stage=ResolutionStage.LOOKUP, result=AttemptResult.SKIPPED,
        action=ResolutionAction.CANONICAL_FALLBACK if preferred else ResolutionAction.FAIL_STARTUP,
        elapsed_seconds=0.0, failure=failure)
    report = ResolutionReport(
        resolution_id=uuid.uuid4().hex,
        outcome=ResolutionOutcome.CANONICAL_FALLBACK if preferred else ResolutionOutcome.FAILED,
        attempts=(*resolution.report.attempts, attempt), elapsed_seconds=time.monotonic() - started)
    log.info("Host Weight Runtime: %s; this rank's lease is released", message)
    return HostWeightResolution(report=report)


def _agreed(runtime: Any, original: Callable[..., Any], identity: Any, producer: Any) -> Any:
    world = _world()
    if world is None:
        return original(identity, producer=producer)
    rank, size = world
    wait = getattr(runtime.config, "wait", None)
    timeout_s = float(getattr(wait, "coordination_timeout_seconds", 600.0)) + SKEW_S
    started = time.monotonic()
    try:
        resolution = original(identity, producer=producer)
    except BaseException:
        with contextlib.suppress(Exception):  # the resolve's own error is the one to report
            exchange(FAILED, rank, size, timeout_s)  # peers must not wait for a rank that failed
        raise
    mine = _code(resolution)
    try:
        agreed, below = decide(exchange(mine, rank, size, timeout_s))
    except BaseException:
        if resolution.lease is not None:
            resolution.lease.close()
        raise
    if mine == HIT and agreed < HIT:
        return _overruled(runtime, resolution, below, started)
    return resolution


def install_on(runtime: Any) -> Any:
    """Make ``runtime.resolve`` (one hwrd-backed ``HostWeightRuntime``) agree across ranks."""
    original = runtime.resolve

    def resolve(identity: Any = None, *, producer: Any = None) -> Any:
        return _agreed(runtime, original, identity, producer)

    resolve.__wrapped__ = original  # type: ignore[attr-defined]
    runtime.resolve = resolve
    return runtime
