"""Publication on the peer socket: ``publish_begin`` / ``publish_commit`` / ``publish_abort``.

The same operations as the ``BeginPublication`` / ``CommitPublication`` / ``AbortPublication``
RPCs (one domain implementation: ``hwr.daemon.service.publishing``; the same request validation:
``hwr.daemon.service.publication_checks``), without gRPC's per-call cost, and with the staging descriptors in the
``publish_begin`` reply instead of a second round trip. Requests (JSON frames, see
``hwr.daemon.peer.server``)::

    publish_begin   identity         canonical identity JSON (a string)
                    tensors          [[name, dtype, shape, kind, role], ...]; dtype a safetensors
                                     code ("F32"), shape a list of ints, kind "parameter"|"buffer"
                    wait_timeout_ms  int in [0, MAX_WAIT_TIMEOUT_MS] (optional, default 0)
                    format_metadata  canonical JSON object as a string (optional)
                    channel          a channel to point at the artifact as part of the commit
                                     (optional; see ``hwr.daemon.service.publishing``)
                    durable          bool (optional, default true); false: no fsync, gone at
                                     hwrd's next start
                    overlap          bool (optional): lay the staging out in several files the
                                     writer hands over one by one (``publish_file_done``)
                    reuse            {"base": 64-hex key, "tensors": [names]} (optional): tensors
                                     hwrd takes from that artifact (``hwr.daemon.store.reuse``)
      -> outcome ("staged" | "joined" | "already_present"), key; when staged also
         publication_id, publication_token, files [[name, size]], placements
         [[name, file_index, offset, nbytes]] (sorted by name), reused [names] (not to be
         written), count + the staging descriptors
    publish_commit  publication_id, expected_sha256 {name: 64 hex} (optional)
      -> key, joined, size_bytes, content_sha256
    publish_abort   publication_id   -> aborted (bool)
    publish_file_done  publication_id, publication_token, file_index
                                     the writer closed its descriptor of that file: hwrd hashes
                                     it while the rest is written (answered at once; see
                                     ``hwr.daemon.store.prehash``) -> {}

Typed errors are error frames with the code, message and details the RPC would carry.

Staging descriptors (in the ``publish_begin`` reply, and for the channel's ``open_staging``
request) are opened by the service (``Publishing.staging_descriptors``: sealed memfds for a
small publication, else the staging files); this module only sends them. Each operation needs
the publish role, checked on every operation as the RPCs do.

Limit: the peer socket serves one request per connection at a time, so a request that waits
(another publisher of the same identity is building; a commit hashing gigabytes) holds up that
client's other peer operations and is bounded by its socket timeout. The client therefore uses
these operations only for publications it knows are small and with ``wait_timeout_ms`` 0,
falling back to the RPCs otherwise (``hwr.client.publisher``); the daemon does not rely on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hwr.client.errors import InvalidRequest
from hwr.client.identity import is_key
from hwr.daemon.service.leasing import parse_identity
from hwr.daemon.service.publication_checks import KINDS, RequestedTensor, format_metadata, tensor_specs, wait_timeout_s
from hwr.daemon.service.roles import PUBLISH
from hwr.daemon.service.sessions import Session

if TYPE_CHECKING:
    from hwr.daemon.service.publishing import Publishing
    from hwr.daemon.service.settings import Settings

__all__ = ["PublicationFrames"]


class PublicationFrames:
    """The three peer publication operations; replies are (reply dict, descriptors)."""

    def __init__(self, publications: Publishing, settings: Settings | None = None) -> None:
        self._publications = publications
        self._settings = settings  # its roles decide who publishes; None: no role check

    def _require(self, session: Session, action: str) -> None:
        """The publish role (``hwr.daemon.service.roles``), checked for every operation, as the RPCs do."""
        if self._settings is not None:
            self._settings.roles.require(session.cred, PUBLISH, action)

    def staging_fds(self, session: Session, publication_id: str, token: str) -> list[int]:
        """The staging descriptors of a publication ``session`` staged (its token checked)."""
        self._require(session, "open staging descriptors")
        return self._publications.staging_descriptors(session, publication_id, token)

    def file_done(self, session: Session, req: dict[str, Any]) -> dict[str, Any]:
        """``publish_file_done``: the writer handed a staging file over (answered at once)."""
        self._require(session, "publish_file_done")
        index = req.get("file_index")
        if not _is_int(index):
            raise InvalidRequest("file_index must be an integer", details={"field": "file_index"})
        self._publications.file_done(session, _id(req), _token(req), index)  # type: ignore[arg-type]
        return {"ok": True}

    async def begin(self, session: Session, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        self._require(session, "publish_begin")
        identity_text = req.get("identity")
        if not isinstance(identity_text, str):
            raise InvalidRequest("identity must be canonical identity JSON text", details={"field": "identity"})
        wait_timeout = wait_timeout_s(req.get("wait_timeout_ms", 0))
        metadata = req.get("format_metadata", "")
        if not isinstance(metadata, str):
            raise InvalidRequest("format_metadata must be JSON text", details={"field": "format_metadata_json"})
        channel, durable, overlap = req.get("channel"), req.get("durable", True), req.get("overlap", False)
        if channel is not None and not isinstance(channel, str):
            raise InvalidRequest("channel must be a channel name", details={"field": "channel"})
        if not isinstance(durable, bool) or not isinstance(overlap, bool):
            raise InvalidRequest("durable and overlap must be true or false", details={"field": "durable"})
        reuse_base, reuse = _parse_reuse(req.get("reuse"))
        identity = parse_identity(identity_text.encode())
        specs = tensor_specs(_parse_tensors(req.get("tensors")))
        result = await self._publications.begin(
            session, identity, specs, wait_timeout=wait_timeout,
            format_metadata=format_metadata(metadata.encode()), channel=channel, durable=durable, overlap=overlap,
            reuse_base=reuse_base, reuse=reuse)
        pub = result.publication
        if pub is None:
            return {"ok": True, "outcome": result.outcome, "key": result.key}, []
        staging = pub.staging
        try:
            fds = self.staging_fds(session, pub.publication_id, pub.token)
        except BaseException:
            await self._publications.abort(session, pub.publication_id)
            raise
        index = {name: i for i, (name, _path, _size) in enumerate(staging.files)}
        return {"ok": True, "outcome": "staged", "key": result.key, "publication_id": pub.publication_id,
                "publication_token": pub.token,
                "files": [[name, size] for name, _path, size in staging.files],
                "placements": [[name, index[fname], offset, nbytes]
                               for name, (fname, offset, nbytes) in sorted(staging.placements.items())],
                "reused": result.reused, "count": len(fds)}, fds

    async def commit(self, session: Session, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        self._require(session, "publish_commit")
        expected = req.get("expected_sha256") or {}
        if not isinstance(expected, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in expected.items()):
            raise InvalidRequest("expected_sha256 must map tensor names to hex digests",
                                 details={"field": "expected_sha256"})
        record, joined = await self._publications.commit(session, _id(req), expected)
        return {"ok": True, "key": record.key, "joined": joined, "size_bytes": record.size_bytes,
                "content_sha256": record.manifest.artifact_content_sha256}, []

    async def abort(self, session: Session, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        self._require(session, "publish_abort")
        return {"ok": True, "aborted": await self._publications.abort(session, _id(req))}, []


def _id(req: dict[str, Any]) -> str:
    value = req.get("publication_id")
    if not isinstance(value, str) or not value or len(value) > 256:
        raise InvalidRequest("publication_id is required", details={"field": "publication_id"})
    return value


def _parse_reuse(value: object) -> tuple[str | None, list[str]]:
    if value is None:
        return None, []
    if not isinstance(value, dict) or not is_key(value.get("base")) or not isinstance(value.get("tensors"), list) \
            or not all(isinstance(n, str) for n in value["tensors"]):
        raise InvalidRequest('reuse must be {"base": a 64-hex key, "tensors": [names]}', details={"field": "reuse"})
    return value["base"], value["tensors"]


def _token(req: dict[str, Any]) -> str:
    value = req.get("publication_token")
    if not isinstance(value, str) or not value or len(value) > 256:
        raise InvalidRequest("publication_token is required", details={"field": "publication_token"})
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_tensors(value: object) -> list[RequestedTensor]:
    """JSON tensor entries -> ``RequestedTensor`` values for ``tensor_specs`` (which checks them)."""
    if not isinstance(value, list):
        raise InvalidRequest("tensors must be a list of [name, dtype, shape, kind, role]",
                             details={"field": "tensors"})
    out = []
    for entry in value:
        if not (isinstance(entry, list) and len(entry) == 5):
            raise InvalidRequest("each tensor is [name, dtype, shape, kind, role]", details={"field": "tensors"})
        name, dtype, shape, kind, role = entry
        if not isinstance(name, str):
            raise InvalidRequest("tensor names must be strings", details={"field": "tensors.name"})
        if not isinstance(dtype, str) or not isinstance(role, str) or len(role) > 128:
            raise InvalidRequest("tensor dtype and role must be strings", details={"tensor": name[:200]})
        if not isinstance(shape, list) or len(shape) > 16 or not all(
                _is_int(d) and 0 <= d <= (1 << 40) for d in shape):
            raise InvalidRequest("tensor shape out of range", details={"tensor": name[:200]})
        known = kind if isinstance(kind, str) and kind in KINDS else None
        out.append(RequestedTensor(name, dtype, tuple(shape), known, role))
    return out
