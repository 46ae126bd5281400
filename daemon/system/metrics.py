"""Prometheus metrics: the instruments, the text exposition (format 0.0.4) and a tiny local server.

The series of one scrape are gathered by ``hwr.daemon.app.exposition`` (it sees every collaborator).

Why not ``prometheus_client``: hwrd needs a dozen instruments, one label set without user data,
and an asyncio listener that may be a Unix socket; the exposition format is a few lines of text,
so writing it keeps a dependency (and its global registry and threads) out of the daemon.

Exposed (all names prefixed ``hwr_``)::

    artifacts                      gauge    ready artifacts in the store
    store_bytes                    gauge    bytes of those artifacts
    leases                         gauge    leases held now
    sessions                       gauge    sessions open now
    publications_active            gauge    publications staged or committing now
    leases_granted_total           counter  leases granted since start
    leases_released_total          counter  leases released since start (explicit or session end)
    publications_total{outcome}    counter  outcome = committed | failed
    evictions_total{reason}        counter  reason chosen by the evicting code (a fixed word)
    artifact_check_failures_total{code}  counter  artifacts refused by a check: the metadata
                                   validation of a lookup, or an operator's verify (the full
                                   re-hash); code = the typed error code (MANIFEST_CORRUPT, ...)
    remote_pulls_total{outcome}    counter  fleet tier (only with a remote): pulled | already_present |
                                   miss | invalid | unavailable | denied | failed
    remote_pushes_total{outcome}   counter  pushed | already_present | skipped | unavailable | failed
    remote_pulled_bytes_total, remote_pushed_bytes_total  counters  payload bytes moved
    channels                       gauge    channels on the node
    channel_watchers               gauge    watches of channels open now (all channels)
    channels_non_durable           gauge    channels pointing to a non-durable artifact now
    channel_switches_total         counter  channel changes since start (sets, commits, fallbacks)
    acquire_duration_seconds       histogram  Acquire handling time, successful acquires only
    publication_phase_seconds{phase}  histogram  where a publication's time goes, per phase:
                                   admission (identity slot + capacity reservation, including
                                   eviction and any wait for room), staging (free evicted bytes,
                                   create the preallocated staging files), writing (staged until
                                   the commit request: the publisher's own time), commit (checks,
                                   hash, fsyncs, rename into artifacts/); successful phases only

Contract: labels carry fixed vocabulary only (outcomes, reasons, error codes), never paths, model
names, keys or exception text; ``label_value`` rejects anything outside ``[A-Za-z0-9_]``. One
scrape is rendered in one event-loop step, so its numbers are consistent with each other:
``leases_granted_total - leases_released_total == leases``, the Acquire histogram's ``_count``
equals ``leases_granted_total`` (a lease is granted exactly when an Acquire succeeds) and the
commit phase's ``_count`` equals ``publications_total{outcome="committed"}``.
Limits: counters reset when hwrd restarts (Prometheus handles resets); the server answers
``GET /metrics`` only, HTTP/1.0-style (one request per connection), and listens on loopback or
a Unix socket only: it has no authentication.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path

from hwr.daemon.system import socket_files

__all__ = ["Counter", "Histogram", "Instruments", "MetricsServer", "parse_listen", "render"]

log = logging.getLogger("hwrd.metrics")
_LABEL_VALUE = re.compile(r"[A-Za-z0-9_]{1,64}")
ACQUIRE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: Publication phases span a 64 KiB artifact's sub-millisecond staging to a 100 GB commit's hash.
PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                 30.0, 60.0, 120.0, 300.0, 600.0)
PUBLICATION_PHASES = ("admission", "staging", "writing", "commit")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def label_value(value: str) -> str:
    if not _LABEL_VALUE.fullmatch(value):
        raise ValueError("metric label values are fixed words ([A-Za-z0-9_], at most 64)")
    return value


class Counter:
    """A monotonically increasing count, optionally split by one label."""

    def __init__(self, name: str, help_text: str, label: str | None = None) -> None:
        self.name, self.help, self.label = name, help_text, label
        self.values: dict[str, float] = {} if label else {"": 0.0}

    def inc(self, label: str = "", amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        key = label_value(label) if self.label else ""
        self.values[key] = self.values.get(key, 0.0) + amount

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        for key, value in sorted(self.values.items()):
            out.append(f"{self.name}{{{self.label}=\"{key}\"}} {_num(value)}" if self.label
                       else f"{self.name} {_num(value)}")
        return out


class _Series:
    """One histogram series: per-bucket (non-cumulative) counts, sum and count."""

    __slots__ = ("count", "counts", "sum")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * buckets
        self.count = 0
        self.sum = 0.0


class Histogram:
    """Cumulative buckets, sum and count (Prometheus histogram semantics), optionally split by one
    label (each label value its own series, rendered in sorted order)."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...] = ACQUIRE_BUCKETS,
                 label: str | None = None) -> None:
        self.name, self.help, self.buckets, self.label = name, help_text, tuple(sorted(buckets)), label
        self.series: dict[str, _Series] = {} if label else {"": _Series(len(self.buckets))}

    def observe(self, value: float, label: str = "") -> None:
        key = label_value(label) if self.label else ""
        series = self.series.get(key)
        if series is None:
            series = self.series[key] = _Series(len(self.buckets))
        index = bisect.bisect_left(self.buckets, value)
        if index < len(series.counts):
            series.counts[index] += 1
        series.count += 1
        series.sum += value

    def touch(self, label: str) -> None:
        """Create ``label``'s series with zero observations (so it is exported before the first)."""
        self.series.setdefault(label_value(label), _Series(len(self.buckets)))

    @property
    def count(self) -> int:
        return sum(s.count for s in self.series.values())

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for key, series in sorted(self.series.items()):
            labels = f'{self.label}="{key}",' if self.label else ""
            only = f'{{{labels[:-1]}}}' if self.label else ""
            running = 0
            for bound, n in zip(self.buckets, series.counts, strict=True):
                running += n
                out.append(f'{self.name}_bucket{{{labels}le="{_num(bound)}"}} {running}')
            out += [f'{self.name}_bucket{{{labels}le="+Inf"}} {series.count}',
                    f"{self.name}_sum{only} {_num(series.sum)}", f"{self.name}_count{only} {series.count}"]
        return out


def gauge_lines(name: str, help_text: str, value: float) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {_num(value)}"]


def counter_lines(name: str, help_text: str, value: float) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {_num(value)}"]


def render(blocks: Iterable[list[str]]) -> bytes:
    return ("\n".join(line for block in blocks for line in block) + "\n").encode()


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def parse_listen(spec: str) -> tuple[str, str | int]:
    """``"127.0.0.1:9464"`` -> ("tcp", ...), ``"unix:/run/hwrd/metrics.sock"`` -> ("unix", path).

    Only loopback hosts are accepted: the endpoint has no authentication.
    """
    if spec.startswith("unix:"):
        path = spec[5:]
        if not path.startswith("/"):
            raise ValueError("metrics unix socket path must be absolute")
        return "unix", path
    host, sep, port = spec.rpartition(":")
    host = host.strip("[]")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError("metrics_listen must be HOST:PORT on loopback or unix:/absolute/path")
    if host not in ("127.0.0.1", "::1", "localhost"):
        raise ValueError("metrics_listen must be a loopback address (127.0.0.1, ::1) or a unix socket")
    return host, int(port)


class MetricsServer:
    """Serves ``GET /metrics`` with ``collect()``'s bytes on a loopback port or a Unix socket."""

    def __init__(self, spec: str, collect: Callable[[], bytes]) -> None:
        self.spec = spec
        self._collect = collect
        self._server: asyncio.base_events.Server | None = None
        self._unix_path: Path | None = None
        self._bound: socket_files.BoundSocket | None = None

    async def start(self) -> None:
        host, where = parse_listen(self.spec)
        if host == "unix":
            path = Path(str(where))
            # Several hwrds may be configured with one path (the service's /run/hwrd/metrics.sock):
            # one that another live hwrd serves is refused, never bound over.
            socket_files.claim(path)
            self._server = await asyncio.start_unix_server(self._handle, path=str(path))
            os.chmod(path, 0o660)
            self._unix_path = path
            self._bound = socket_files.bound(path)
        else:
            self._server = await asyncio.start_server(self._handle, host=host, port=int(where))
        log.info("metrics on %s", self.address)

    @property
    def address(self) -> str:
        if self._server is None:
            return self.spec
        if self._unix_path is not None:
            return f"unix:{self._unix_path}"
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        self.release()

    def release(self) -> None:
        """Unlink the Unix socket file, only while the path still holds the one this server bound."""
        if self._bound is not None:
            socket_files.release(self._bound)
            self._bound = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
            method, _, rest = request.split(b"\r\n", 1)[0].decode("latin-1").partition(" ")
            target = rest.split(" ", 1)[0]
            if method != "GET":
                status, body, ctype = "405 Method Not Allowed", b"only GET\n", "text/plain"
            elif target.split("?", 1)[0] != "/metrics":
                status, body, ctype = "404 Not Found", b"see /metrics\n", "text/plain"
            else:
                status, body, ctype = "200 OK", self._collect(), CONTENT_TYPE
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                         "Connection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()


class Instruments:
    """The daemon's own counters (the rest are read from the registry and store at scrape time).

    ``count_eviction(reason)`` and ``count_check_failure(code)`` are for the components that
    evict or check artifacts (a lookup's validation, an operator's verify); ``observe_acquire``
    for the Acquire handler; ``observe_publication_phase`` for ``hwr.daemon.service.publishing``
    (its ``on_phase`` hook).
    """

    def __init__(self) -> None:
        self.acquire = Histogram("hwr_acquire_duration_seconds", "Time to handle a successful Acquire.")
        self.publication_phases = Histogram(
            "hwr_publication_phase_seconds", "Time a successful publication phase took, by phase.",
            PHASE_BUCKETS, label="phase")
        for phase in PUBLICATION_PHASES:
            self.publication_phases.touch(phase)
        self.evictions = Counter("hwr_evictions_total", "Artifacts evicted from the store.", "reason")
        self.check_failures = Counter(
            "hwr_artifact_check_failures_total",
            "Artifacts refused by a check: a lookup's metadata validation or an operator's verify.", "code")
        # Zero series for the known values, so rate() and alerts work before the first event.
        self.evictions.inc("capacity", 0)
        for code in ("MANIFEST_CORRUPT", "MANIFEST_INCOMPATIBLE", "CHECKSUM_MISMATCH"):
            self.check_failures.inc(code, 0)

    def observe_acquire(self, seconds: float) -> None:
        self.acquire.observe(seconds)

    def observe_publication_phase(self, phase: str, seconds: float) -> None:
        self.publication_phases.observe(seconds, phase)

    def count_eviction(self, reason: str = "capacity") -> None:
        self.evictions.inc(reason)

    def count_check_failure(self, code: str) -> None:
        self.check_failures.inc(code)
