"""Ordered lanes of asynchronous work and the signals between them (streams and events).

A ``Lane`` is where work runs in order: on CUDA a ``torch.cuda.Stream`` (kernels are enqueued
by the calling thread), on CPU a worker thread (so copies and collectives overlap compute on
CPU exactly as they do on a GPU, and every ordering rule is exercised by CPU tests). The
compute lane is the caller's current stream on CUDA and the calling thread on CPU.

Contract (identical on both devices):
- ``submit(fn)`` runs ``fn`` after everything submitted before it on the lane.
- ``record()`` returns a ``Signal`` that completes when all prior work on the lane has.
- ``wait(signal)`` makes later work on the lane start after ``signal`` completed.
- ``drain()`` blocks the host until the lane is idle; it raises the lane's first error.
- A failed task makes the lane *sticky-failed*: later tasks are skipped and every signal
  recorded afterwards carries the error (a failed collective leaves the group in an unknown
  state, so nothing after it may run). On CUDA, Python-side errors raise in ``submit``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Protocol

import torch

__all__ = [
    "CudaLane",
    "CurrentStreamLane",
    "DeferredSignal",
    "InlineLane",
    "Lane",
    "LaneError",
    "Signal",
    "ThreadLane",
    "completed_signal",
]


class LaneError(RuntimeError):
    """Work on a lane failed; ``__cause__`` is the original error."""


class Signal(Protocol):
    def wait_host(self) -> None:
        """Block the host until the signal completes; raise ``LaneError`` if it carries an error."""

    def query(self) -> bool:
        """True once completed (never blocks)."""


class Lane(Protocol):
    def submit(self, fn: Callable[[], None]) -> None: ...

    def record(self) -> Signal: ...

    def wait(self, signal: Signal | None) -> None: ...

    def drain(self) -> None: ...

    def close(self) -> None: ...


class _HostSignal:
    def __init__(self) -> None:
        self._event = threading.Event()
        self._error: BaseException | None = None

    def set(self, error: BaseException | None) -> None:
        self._error = error
        self._event.set()

    def wait_host(self) -> None:
        self._event.wait()
        if self._error is not None:
            raise LaneError(str(self._error)) from self._error

    def query(self) -> bool:
        return self._event.is_set()


class DeferredSignal:
    """A signal that is known only later (``resolve``), or a failure (``fail``).

    Work that another thread submits to a lane (the staged transfer's packer enqueues each
    H2D copy once its host pack is done) gets its lane signal only then; whoever waits on a
    ``DeferredSignal`` first blocks the host until it is known. Every lane accepts it.
    """

    def __init__(self) -> None:
        self._known = threading.Event()
        self._signal: Signal | None = None
        self._error: BaseException | None = None

    def resolve(self, signal: Signal) -> None:
        self._signal = signal
        self._known.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._known.set()

    def result(self) -> Signal:
        """Block until known; the lane signal, or ``LaneError`` for a failure."""
        self._known.wait()
        if self._error is not None:
            raise LaneError(str(self._error)) from self._error
        assert self._signal is not None
        return self._signal

    def wait_host(self) -> None:
        self.result().wait_host()

    def query(self) -> bool:
        if not self._known.is_set():
            return False
        return self._error is not None or (self._signal is not None and self._signal.query())


def completed_signal() -> Signal:
    signal = _HostSignal()
    signal.set(None)
    return signal


class InlineLane:
    """The compute lane on CPU: work runs in the calling thread, so it is always complete."""

    def submit(self, fn: Callable[[], None]) -> None:
        fn()

    def record(self) -> Signal:
        return completed_signal()

    def wait(self, signal: Signal | None) -> None:
        if signal is not None:
            signal.wait_host()

    def drain(self) -> None:
        return None

    def close(self) -> None:
        return None


class ThreadLane:
    """A CPU lane: one daemon worker thread running tasks in submission order."""

    def __init__(self, name: str) -> None:
        self._tasks: queue.SimpleQueue[tuple[Callable[[], None], bool] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"hwr-dlo-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._tasks.get()) is not None:
            fn, always = item
            if self._error is not None and not always:
                continue
            try:
                fn()
            except BaseException as exc:  # the error travels to every later signal
                self._error = self._error or exc

    def submit(self, fn: Callable[[], None]) -> None:
        if self._closed:
            raise LaneError("lane is closed")
        self._tasks.put((fn, False))

    def record(self) -> Signal:
        signal = _HostSignal()
        if self._closed:
            signal.set(self._error)
            return signal
        self._tasks.put((lambda: signal.set(self._error), True))
        return signal

    def wait(self, signal: Signal | None) -> None:
        if signal is not None:
            self.submit(signal.wait_host)

    def drain(self) -> None:
        self.record().wait_host()

    def close(self) -> None:
        """Finish queued work and stop the worker; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._tasks.put(None)
        self._thread.join()


class _CudaSignal:
    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def wait_host(self) -> None:
        self.event.synchronize()

    def query(self) -> bool:
        return bool(self.event.query())


class CudaLane:
    """A dedicated CUDA stream; ``submit`` enqueues ``fn``'s kernels on it."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device=device)

    def _stream(self) -> torch.cuda.Stream:
        return self.stream

    def submit(self, fn: Callable[[], None]) -> None:
        with torch.cuda.stream(self._stream()):
            fn()

    def record(self) -> Signal:
        event = torch.cuda.Event()
        event.record(self._stream())
        return _CudaSignal(event)

    def wait(self, signal: Signal | None) -> None:
        if isinstance(signal, DeferredSignal):
            signal = signal.result()  # host wait until the work behind it was enqueued
        if isinstance(signal, _CudaSignal):
            self._stream().wait_event(signal.event)
        elif signal is not None:
            signal.wait_host()

    def drain(self) -> None:
        self._stream().synchronize()

    def close(self) -> None:
        return None


class CurrentStreamLane(CudaLane):
    """The compute lane on CUDA: whatever stream is current when the hook runs.

    It remembers every stream it recorded on or made wait, and ``drain`` synchronizes all of
    them: forwards may run under any stream, and memory they read (the slots) must not go back
    to the caching allocator while one of them still has kernels queued that read it (the
    allocator only orders reuse on the stream a block was allocated on; torch docs, CUDA
    semantics, "Memory management": use of a tensor on another stream must be synchronized or
    ``record_stream``-ed by the caller).
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._seen: dict[int, torch.cuda.Stream] = {}

    def _stream(self) -> torch.cuda.Stream:
        stream = torch.cuda.current_stream(self._device)
        self._seen.setdefault(int(stream.cuda_stream), stream)
        return stream

    def drain(self) -> None:
        self._stream()
        for stream in list(self._seen.values()):
            stream.synchronize()
