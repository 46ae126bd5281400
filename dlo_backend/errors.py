"""Typed errors of the layerwise offload backend, rooted in ``hwr.client.errors.HwrError``.

Each class also subclasses the matching built-in, pickles to itself (inherited from
``HwrError``) and carries a stable ``code``. Errors the backend shares with the rest of hwr
(``InvalidRequest``, ``Unsupported``, ``LeaseClosed``) are raised from ``hwr.client.errors``
directly.
"""

from __future__ import annotations

from hwr.client.errors import HwrError

__all__ = ["CollectiveStateError", "HostSourceMismatch", "ManifestMismatch", "OffloadError", "RevisionMismatch"]


class OffloadError(HwrError, RuntimeError):
    """Enabling or running the offload failed; the message says which step.

    Raised by ``enable()`` after a complete rollback (hooks removed, pending copies drained,
    staging released, lease closed), so the model is usable and the backend may be recreated.
    """

    code = "DLO_OFFLOAD_FAILED"


class CollectiveStateError(HwrError, RuntimeError):
    """The backend's process group is in an unknown state (a collective failed or timed out).

    The backend is poisoned: it refuses every further use. Recreate the backend and reload the
    pipeline on every rank of the group; the streamed blocks' weights are lost on this rank.
    """

    code = "DLO_COLLECTIVE_STATE"


class ManifestMismatch(HwrError, ValueError):
    """Ranks of the AllGather group disagree on the block manifest (names, dtypes, shapes)."""

    code = "DLO_MANIFEST_MISMATCH"


class HostSourceMismatch(HwrError, ValueError):
    """A host source (lease) lacks a block tensor or holds it with another shape/dtype/stride."""

    code = "DLO_HOST_SOURCE_MISMATCH"


class RevisionMismatch(HostSourceMismatch):
    """A live update was refused: the new revision does not match the model's tensor contract.

    Raised by ``OffloadHandle.update`` when this rank's check fails (a tensor missing, or held
    with another dtype, shape or stride), and recorded as the handle's ``revision.last_error``
    when a peer rank of the AllGather group refused it (``details["refused_by"]``). Either way
    the new lease is closed and every rank keeps running the revision it had.
    """

    code = "DLO_REVISION_MISMATCH"
