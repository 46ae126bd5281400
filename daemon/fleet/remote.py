"""The fleet tier: a remote object store that hwrd uses as a cache of committed artifacts.

Location (config key ``remote``): ``s3://BUCKET/PREFIX`` (any S3-compatible service; endpoint
and region from ``remote_endpoint_url``/``remote_region``, credentials only from the S3
client's standard chain) or ``file:///PATH`` (a shared filesystem). Layout in the remote, the
same for both backends::

    PREFIX/artifacts/<key>/<file>          payloads (model-00001.safetensors ...) and manifest.json
    PREFIX/artifacts/<key>/READY.json      written last: its presence is the completion marker

A key without ``READY.json`` is incomplete (an upload in progress, or one a dead daemon left):
readers treat it as absent, ``hwrctl remote ls`` shows it as ``incomplete``.

Trust: the remote is a cache, never a root of trust. Every pulled byte is verified against the
manifest (``hwr.daemon.fleet.pull``) and the manifest against the key (its identity hashes to
it) and against ``READY.json`` (which names the manifest's SHA-256). Deny markers and quarantine
stay local: nothing about them is written to or read from the remote.

``RemoteStore`` is the storage interface both backends implement. Call order for one upload:
``put_file`` for each payload, ``put_bytes(manifest.json)``, then ``put_bytes(READY.json)`` last;
each object appears whole or not at all (S3 semantics; the file backend renames a temporary
name into place). For one download: ``get_bytes(READY.json)`` (None: not in the remote),
``get_bytes(manifest.json)``, then ``get_into`` for each payload, which hands every piece it
receives to a ``PayloadSink`` (``hwr.daemon.fleet.sink``: the staging file, progress, digests).
Every method raises ``RemoteUnavailable`` when the remote cannot be reached, its subclass
``RemoteDenied`` (``denied``) when the remote refuses hwrd's credentials or permissions, and
``RemoteObjectInvalid`` when one object is refused (its size is not the one asked for, it is not
a regular object, a symlink...); one bad object never makes the whole remote unavailable.
``get_into`` also lets the sink's own error through (a stopped pull).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from hwr.client.errors import ConfigError, ManifestCorrupt, RemoteDenied, RemoteUnavailable
from hwr.daemon.policy.remote_location import RemoteLocation, parse_location

__all__ = [
    "READY_OBJECT",
    "PayloadSink",
    "RemoteDenied",
    "RemoteEntry",
    "RemoteLocation",
    "RemoteObjectInvalid",
    "RemoteStore",
    "RemoteUnavailable",
    "denied",
    "open_remote",
    "parse_location",
]

READY_OBJECT = "READY.json"
#: The largest manifest.json/READY.json hwrd reads from a remote (a hostile one must not exhaust memory).
MAX_DOCUMENT_BYTES = 64 << 20

Progress = Callable[[int], None]  # called with the bytes moved since the last call


class PayloadSink(Protocol):
    """Where ``get_into`` puts an object's bytes (``hwr.daemon.fleet.sink.DownloadSink``)."""

    size: int
    written: int

    def write(self, offset: int, data: bytes | memoryview) -> None:
        """Store one piece (the sink keeps it by reference until hashed: never reuse the
        buffer); ``RemoteObjectInvalid`` past ``size``; the pull's error once it was stopped."""
        ...

    def check(self) -> None:
        """Raise the pull's error once it was stopped (a transfer polls it while it waits)."""
        ...


class RemoteObjectInvalid(ManifestCorrupt):
    """A remote object is malformed, truncated, of the wrong size or names another identity."""


@dataclass(frozen=True)
class RemoteEntry:
    """One key in the remote: complete (``READY.json`` present) or not, and its bytes there."""

    key: str
    ready: bool
    size_bytes: int


class RemoteStore(Protocol):
    """What a backend provides (see the module docstring for the call order and errors)."""

    location: RemoteLocation

    def get_bytes(self, name: str, limit: int = MAX_DOCUMENT_BYTES) -> bytes | None:
        """A small object's bytes, None when it does not exist; ``RemoteObjectInvalid`` over ``limit``."""
        ...

    def get_into(self, name: str, sink: PayloadSink) -> None:
        """Hand the object's bytes to ``sink`` (each piece at its offset); ``RemoteObjectInvalid``
        unless the object is exactly ``sink.size`` bytes (checked before and while receiving)."""
        ...

    def put_bytes(self, name: str, data: bytes) -> None:
        """Create or replace a small object, atomically."""
        ...

    def put_file(self, name: str, fd: int, size: int, progress: Progress | None = None) -> None:
        """Upload ``size`` bytes of ``fd`` (from offset 0) as one object, atomically."""
        ...

    def exists(self, name: str) -> bool:
        ...

    def list_entries(self) -> list[RemoteEntry]:
        """Every key under ``PREFIX/artifacts/``, complete or not."""
        ...

    def list_names(self, directory: str) -> list[str]:
        """The names of the objects directly under ``directory`` (an object name ending in ``/``;
        the peer tier's holder records), [] when there is none."""
        ...

    def delete(self, name: str) -> None:
        """Remove one object; nothing when it does not exist."""
        ...

    def probe(self) -> None:
        """Raise ``RemoteUnavailable`` unless the remote answers (a cheap request)."""
        ...

    def close(self) -> None:
        ...


def open_remote(location: RemoteLocation, *, transfer_threads: int = 8) -> RemoteStore:
    """The backend for ``location``. An s3 remote needs the ``s3`` extra (boto3), imported only here."""
    if location.scheme == "file":
        from hwr.daemon.fleet.remote_file import FileRemote

        return FileRemote(location)
    try:
        from hwr.daemon.fleet.remote_s3 import S3Remote
    except ImportError as exc:
        raise ConfigError(f"remote {location.display} needs boto3: pip install 'hwr[s3]' ({exc.name} is missing)",
                          details={"key": "remote"}) from None
    return S3Remote(location, transfer_threads=transfer_threads)


def unreachable(location: RemoteLocation, why: str) -> RemoteUnavailable:
    """The one error for a remote that does not answer (its message names the remote)."""
    return RemoteUnavailable(f"remote {location.display} is unreachable: {why}"[:500],
                             details={"remote": location.display})


def denied(location: RemoteLocation, why: str) -> RemoteDenied:
    """The one error for a remote that refuses hwrd's credentials or permissions (its message
    names the remote and says where to look)."""
    return RemoteDenied(f"remote {location.display} denied access: {why} (check hwrd's credentials for it "
                        f"and the permissions they carry)"[:500], details={"remote": location.display})


def invalid(location: RemoteLocation, name: str, why: str) -> RemoteObjectInvalid:
    """The one error for a remote object that is refused (its message names the remote)."""
    return RemoteObjectInvalid(f"remote {location.display}: object {name} {why}"[:500],
                               details={"remote": location.display, "object": name})
