"""The files a writer handed over before its commit: their hashing jobs, collected or released.

A publication laid out for overlap (``Publishing.begin(overlap=True)``) has its files handed
over one by one (``Publishing.file_done``); each becomes a job in a pool of its own
(``hwr.daemon.store.prehash``) whose result holds a read-only descriptor. Exactly one party takes
each result's descriptor: the commit (``collect``: it passes them on to the store, which closes
them), or, when the publication ends otherwise, ``release`` (closes each once its job is done).
``after_all`` defers what must wait for every job (closing the base a job copies from, and the
abort's truncation of the staging: never under a file a job still maps).

On the daemon's event loop; the jobs run in worker threads.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence

from hwr.daemon.store.prehash import PreHashed

__all__ = ["Job", "after_all", "collect", "release"]

Job = asyncio.Future[PreHashed | None]


async def collect(jobs: Sequence[Job]) -> dict[str, PreHashed]:
    """Every job's result by file name (a job that failed is left out: the commit hashes that
    file itself). Cancelled meanwhile: what was collected is closed, the rest ``release``d."""
    results: dict[str, PreHashed] = {}
    for taken, job in enumerate(jobs):
        try:
            done = await asyncio.shield(job)
        except Exception:
            continue
        except BaseException:
            for result in results.values():
                os.close(result.fd)
            release(jobs[taken:])
            raise
        if done is not None:
            results[done.name] = done
    return results


def release(jobs: Sequence[Job]) -> None:
    """Close each job's descriptor once it is done (nothing will take it)."""
    def close(job: Job) -> None:
        if not job.cancelled() and job.exception() is None:
            done = job.result()
            if done is not None:
                os.close(done.fd)

    for job in jobs:
        job.add_done_callback(close)


def after_all(jobs: Sequence[Job], then: Callable[[], None]) -> None:
    """``then()`` once every job is done (now, when none is pending)."""
    pending = [job for job in jobs if not job.done()]
    if not pending:
        then()
        return
    left = [len(pending)]

    def one_done(_job: Job) -> None:
        left[0] -= 1
        if left[0] == 0:
            then()

    for job in pending:
        job.add_done_callback(one_done)
