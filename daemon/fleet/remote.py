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
``get_bytes(manifest.json)``, then ``get_into`` for each payload. Every method raises
``RemoteUnavailable`` when the remote cannot be reached and ``RemoteObjectInvalid`` when an
object's size is not the one asked for; nothing else escapes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from hwr.client.errors import ConfigError, ManifestCorrupt, RemoteUnavailable
from hwr.client.identity import is_key

__all__ = [
    "READY_OBJECT",
    "RemoteEntry",
    "RemoteLocation",
    "RemoteObjectInvalid",
    "RemoteStore",
    "RemoteUnavailable",
    "open_remote",
    "parse_location",
]

READY_OBJECT = "READY.json"
#: The largest manifest.json/READY.json hwrd reads from a remote (a hostile one must not exhaust memory).
MAX_DOCUMENT_BYTES = 64 << 20
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_PREFIX_PART = re.compile(r"^[A-Za-z0-9_.\-]+$")

Progress = Callable[[int], None]  # called with the bytes moved since the last call


class RemoteObjectInvalid(ManifestCorrupt):
    """A remote object is malformed, truncated, of the wrong size or names another identity."""


@dataclass(frozen=True)
class RemoteLocation:
    """A parsed ``remote`` setting. ``display`` is safe to log (there is never a secret in it:
    URLs with user info are refused at parse time)."""

    scheme: str  # "s3" | "file"
    bucket: str  # s3 only
    prefix: str  # s3: "" or "a/b" (no leading/trailing slash); file: the absolute directory
    endpoint_url: str = ""
    region: str = ""

    @property
    def display(self) -> str:
        if self.scheme == "s3":
            return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        return f"file://{self.prefix}"

    def object_name(self, key: str, file: str) -> str:
        """``PREFIX/artifacts/<key>/<file>`` (``file`` is a manifest-validated basename)."""
        if not is_key(key) or "/" in file or file in ("", ".", ".."):
            raise ValueError("invalid remote object name")
        head = f"{self.prefix}/" if self.prefix and self.scheme == "s3" else ""
        return f"{head}artifacts/{key}/{file}"


def parse_location(url: str, *, endpoint_url: str = "", region: str = "") -> RemoteLocation:
    """``remote``'s value -> a location; ``ConfigError`` naming the key otherwise."""
    def bad(message: str, key: str = "remote") -> ConfigError:
        return ConfigError(message, details={"key": key})

    parts = urlsplit(url)
    if parts.username or parts.password or "@" in parts.netloc:
        raise bad("remote must not carry credentials; hwrd takes them from the S3 client's standard chain")
    if parts.query or parts.fragment:
        raise bad("remote takes no query or fragment")
    if endpoint_url:
        ep = urlsplit(endpoint_url)
        if ep.scheme not in ("http", "https") or not ep.hostname or ep.username or ep.password:
            raise bad("remote_endpoint_url must be http(s)://HOST[:PORT] without credentials", "remote_endpoint_url")
    if parts.scheme == "s3":
        bucket = parts.netloc
        if not _BUCKET.match(bucket):
            raise bad(f"remote: {bucket!r} is not a valid bucket name")
        prefix = parts.path.strip("/")
        if prefix and not all(_PREFIX_PART.match(p) and p not in (".", "..") for p in prefix.split("/")):
            raise bad("remote: the prefix may use letters, digits and _ . - between slashes")
        return RemoteLocation("s3", bucket, prefix, endpoint_url, region)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise bad("remote: a file remote is file:///ABSOLUTE/PATH")
        path = "/" + parts.path.strip("/")
        if any(p in (".", "..") for p in path.split("/")):
            raise bad("remote: the path must not contain . or ..")
        if endpoint_url or region:
            raise bad("remote_endpoint_url and remote_region apply to s3:// remotes only", "remote_endpoint_url")
        return RemoteLocation("file", "", path)
    raise bad("remote must be s3://BUCKET/PREFIX or file:///PATH (or empty: off)")


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

    def get_into(self, name: str, fd: int, size: int, progress: Progress | None = None) -> None:
        """Write the object's bytes into ``fd`` at offset 0; ``RemoteObjectInvalid`` unless the
        object is exactly ``size`` bytes (checked before and while writing)."""
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


def invalid(location: RemoteLocation, name: str, why: str) -> RemoteObjectInvalid:
    """The one error for a remote object that is refused (its message names the remote)."""
    return RemoteObjectInvalid(f"remote {location.display}: object {name} {why}"[:500],
                               details={"remote": location.display, "object": name})
