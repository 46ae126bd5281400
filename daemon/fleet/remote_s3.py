"""The ``s3://`` remote, through boto3 and s3transfer (the ``s3`` extra; the only module that imports them).

Why boto3: it is the S3 client every S3-compatible service tests against, it reads credentials
from the standard chain (environment, shared credentials/config files, container and instance
metadata) so hwrd never holds a secret, and its transfer manager (s3transfer) gives the two
things throughput needs: parallel ranged GETs for downloads and parallel multipart uploads, each
part retried on its own. Downloads go straight to the pull's sink (the staging file at each range's offset,
hashed on the way; no temporary file, no second copy).

Errors: a missing object is None/False where the interface allows it; a refusal of hwrd's
credentials or permissions (HTTP 401/403, ``AccessDenied``, ``SignatureDoesNotMatch``,
``InvalidAccessKeyId``, expired tokens; or no credentials found) becomes ``RemoteDenied``; every
other transport or service failure ``RemoteUnavailable``. Both carry only the remote's display
URL and the service's error code, never a credential or a signed URL.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import boto3
import botocore.config
import botocore.exceptions
from boto3.s3.transfer import TransferConfig
from s3transfer.manager import TransferManager
from s3transfer.subscribers import BaseSubscriber

from hwr.client.errors import HwrError
from hwr.client.identity import is_key
from hwr.daemon.fleet.remote import (
    MAX_DOCUMENT_BYTES,
    READY_OBJECT,
    PayloadSink,
    Progress,
    RemoteEntry,
    RemoteLocation,
    RemoteObjectInvalid,
    denied,
    invalid,
    unreachable,
)

__all__ = ["S3Remote", "transfer_config"]

#: Part size of ranged GETs and multipart uploads: large enough that per-request overhead is
#: small, small enough that a 1 GiB artifact is spread over every transfer thread.
PART_BYTES = 16 << 20
_MISSING = frozenset({"404", "NoSuchKey", "NotFound"})
_TRANSPORT = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, OSError)
#: Error codes (and HTTP statuses, which a HEAD answer carries alone) of a refused identity or
#: permission: the keys or the policy are wrong, not the network.
_DENIED = frozenset({"401", "403", "AccessDenied", "AllAccessDisabled", "AccountProblem", "ExpiredToken",
                     "Forbidden", "InvalidAccessKeyId", "InvalidClientTokenId", "InvalidSecurity", "InvalidToken",
                     "SignatureDoesNotMatch", "TokenRefreshRequired", "UnrecognizedClientException"})
_NO_CREDENTIALS = (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError)


def denial(code: str, http_status: int | None) -> bool:
    """Whether the service's answer ``code`` (HTTP ``http_status``) refuses hwrd's credentials or
    permissions (``RemoteDenied``) rather than failing otherwise."""
    return code in _DENIED or http_status in (401, 403)


def transfer_config(threads: int) -> TransferConfig:
    """The transfer settings hwrd uses (the benchmark's baseline ``download_file`` uses the same)."""
    return TransferConfig(multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES,
                          max_concurrency=threads, max_io_queue=1000)


class _Sized(BaseSubscriber):  # type: ignore[misc]
    """Tells s3transfer the size we already know (skips its HeadObject) and reports progress."""

    def __init__(self, size: int, progress: Progress | None) -> None:
        self._size = size
        self._progress = progress

    def on_queued(self, future: Any, **kwargs: Any) -> None:
        future.meta.provide_transfer_size(self._size)

    def on_progress(self, future: Any, bytes_transferred: int, **kwargs: Any) -> None:
        if self._progress is not None and bytes_transferred > 0:
            self._progress(bytes_transferred)


class _SinkTarget:
    """A seekable write-only file over a ``PayloadSink``: s3transfer seeks to each range's offset
    and writes; every write goes to the sink at that offset (which refuses bytes past the size
    the manifest gave: a longer object must not grow the staging file)."""

    def __init__(self, sink: PayloadSink) -> None:
        self._sink = sink
        self._size = sink.size
        self._pos = 0
        self._lock = threading.Lock()

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        with self._lock:
            self._pos = offset if whence == 0 else (self._pos + offset if whence == 1 else self._size + offset)
            return self._pos

    def tell(self) -> int:
        return self._pos

    def write(self, data: bytes) -> int:
        with self._lock:  # s3transfer serializes seek+write per file; the lock keeps the pair whole
            pos = self._pos
            self._sink.write(pos, data)
            self._pos = pos + len(data)
        return len(data)


class _Reader:
    """A read-only seekable file over a descriptor (s3transfer reads upload parts from it)."""

    def __init__(self, fd: int, size: int) -> None:
        self._fd, self._size, self._pos = fd, size, 0

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset if whence == 0 else (self._pos + offset if whence == 1 else self._size + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:
        n = self._size - self._pos if n is None or n < 0 else min(n, self._size - self._pos)
        data = os.pread(self._fd, n, self._pos) if n > 0 else b""
        self._pos += len(data)
        return data

    def close(self) -> None:
        pass  # the descriptor belongs to the caller


class S3Remote:
    def __init__(self, location: RemoteLocation, *, transfer_threads: int = 8) -> None:
        self.location = location
        options: dict[str, Any] = {}
        if location.endpoint_url:
            options["s3"] = {"addressing_style": "path"}  # custom endpoints rarely resolve bucket hosts
        config = botocore.config.Config(
            connect_timeout=3, read_timeout=60, retries={"max_attempts": 3, "mode": "standard"},
            max_pool_connections=max(10, transfer_threads * 2), **options)
        session = boto3.session.Session(region_name=location.region or None)
        self._client = session.client("s3", endpoint_url=location.endpoint_url or None, config=config)
        self._manager = TransferManager(self._client, transfer_config(transfer_threads))
        self._bucket = location.bucket

    def _fail(self, exc: Exception) -> Exception:
        if not isinstance(exc, _TRANSPORT):
            return exc  # a bug, not the remote: re-raised as it is (logged by the caller)
        if isinstance(exc, botocore.exceptions.ClientError):
            code = str(exc.response.get("Error", {}).get("Code", "error"))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if denial(code, status if isinstance(status, int) else None):
                return denied(self.location, f"the service answered {code}")
            return unreachable(self.location, f"the service answered {code}")
        if isinstance(exc, _NO_CREDENTIALS):
            return denied(self.location, f"no usable credentials found ({type(exc).__name__})")
        return unreachable(self.location, type(exc).__name__)

    @staticmethod
    def _missing(exc: Exception) -> bool:
        return isinstance(exc, botocore.exceptions.ClientError) and str(
            exc.response.get("Error", {}).get("Code")) in _MISSING

    def _size(self, name: str) -> int | None:
        try:
            return int(self._client.head_object(Bucket=self._bucket, Key=name)["ContentLength"])
        except Exception as exc:
            if self._missing(exc):
                return None
            raise self._fail(exc) from None

    def get_bytes(self, name: str, limit: int = MAX_DOCUMENT_BYTES) -> bytes | None:
        try:
            reply = self._client.get_object(Bucket=self._bucket, Key=name)
            if int(reply.get("ContentLength", 0)) > limit:
                reply["Body"].close()
                raise invalid(self.location, name, f"is larger than {limit} bytes")
            return bytes(reply["Body"].read(limit + 1))[: limit + 1]
        except RemoteObjectInvalid:
            raise
        except Exception as exc:
            if self._missing(exc):
                return None
            raise self._fail(exc) from None

    def get_into(self, name: str, sink: PayloadSink) -> None:
        size = sink.size
        have = self._size(name)
        if have is None:
            raise invalid(self.location, name, "is missing")
        if have != size:
            raise invalid(self.location, name, f"is {have} bytes, the manifest says {size}")
        future = self._manager.download(self._bucket, name, _SinkTarget(sink), subscribers=[_Sized(size, None)])
        try:
            while not future.done():  # polled, so that a stopped pull ends the transfer now
                try:
                    sink.check()
                except BaseException:
                    future.cancel()
                    raise
                time.sleep(0.05)
            future.result()
        except RemoteObjectInvalid:
            raise invalid(self.location, name, "is longer than the manifest says") from None
        except HwrError:
            raise  # the sink's own error (a stopped pull)
        except Exception as exc:
            raise self._fail(exc) from None
        if sink.written != size:
            raise invalid(self.location, name, f"ended after {sink.written} of {size} bytes")

    def put_bytes(self, name: str, data: bytes) -> None:
        try:
            self._client.put_object(Bucket=self._bucket, Key=name, Body=data)
        except Exception as exc:
            raise self._fail(exc) from None

    def put_file(self, name: str, fd: int, size: int, progress: Progress | None = None) -> None:
        try:
            self._manager.upload(_Reader(fd, size), self._bucket, name,
                                 subscribers=[_Sized(size, progress)]).result()
        except Exception as exc:
            raise self._fail(exc) from None

    def exists(self, name: str) -> bool:
        return self._size(name) is not None

    def list_entries(self) -> list[RemoteEntry]:
        base = self.location.object_name("0" * 64, READY_OBJECT).rsplit("/", 2)[0] + "/"
        found: dict[str, list[int]] = {}  # key -> [ready, payload bytes]
        try:
            for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self._bucket, Prefix=base):
                for obj in page.get("Contents", ()):
                    rest = str(obj["Key"])[len(base):]
                    key, _, file = rest.partition("/")
                    if not is_key(key) or "/" in file:
                        continue
                    entry = found.setdefault(key, [0, 0])
                    if file == READY_OBJECT:
                        entry[0] = 1
                    elif file.endswith(".safetensors"):
                        entry[1] += int(obj["Size"])
        except Exception as exc:
            raise self._fail(exc) from None
        return [RemoteEntry(k, bool(v[0]), v[1]) for k, v in sorted(found.items())]

    def list_names(self, directory: str) -> list[str]:
        found = []
        try:
            for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self._bucket,
                                                                               Prefix=directory):
                for obj in page.get("Contents", ()):
                    rest = str(obj["Key"])[len(directory):]
                    if rest and "/" not in rest:
                        found.append(rest)
        except Exception as exc:
            raise self._fail(exc) from None
        return sorted(found)

    def delete(self, name: str) -> None:
        try:
            self._client.delete_object(Bucket=self._bucket, Key=name)
        except Exception as exc:
            if not self._missing(exc):
                raise self._fail(exc) from None

    def probe(self) -> None:
        try:
            self._client.head_bucket(Bucket=self._bucket)
        except Exception as exc:
            raise self._fail(exc) from None

    def close(self) -> None:
        # Cancel transfers in flight: a stopping daemon must not wait for a multi-GiB upload (its
        # to-push record makes the next start redo it; a cancelled pull leaves only staging).
        self._manager.shutdown(cancel=True, cancel_msg="hwrd is stopping")
