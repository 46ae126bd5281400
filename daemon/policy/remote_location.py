"""Where the fleet tier's remote is: the ``remote`` setting parsed into a location (pure).

Parsed once when the configuration is (``hwr.daemon.system.config``), so a malformed URL is a
``ConfigError`` naming the key before hwrd serves; ``hwr.daemon.fleet`` opens the backend from the
parsed location. URLs that carry credentials are refused: credentials come only from the S3
client's standard chain, so nothing in a location is secret and ``display`` is safe to log.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from hwr.client.errors import ConfigError
from hwr.client.identity import is_key

__all__ = ["RemoteLocation", "parse_location"]

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")
_PREFIX_PART = re.compile(r"[A-Za-z0-9_.\-]+")


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
        if not _BUCKET.fullmatch(bucket):
            raise bad(f"remote: {bucket!r} is not a valid bucket name")
        prefix = parts.path.strip("/")
        if prefix and not all(_PREFIX_PART.fullmatch(p) and p not in (".", "..") for p in prefix.split("/")):
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
