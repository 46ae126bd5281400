"""Typed errors of the Host Weight Runtime.

Every failure that crosses a module, process or wire boundary is an ``HwrError`` subclass with a
stable ``code`` (the upstream vLLM-Omni failure codes where one fits, upper case) and a
``retryable`` flag. Each class also subclasses the matching built-in (``LookupError``,
``ValueError``, ``PermissionError``, ``OSError``, ``TimeoutError``, ``ConnectionError``) so code
that does not know hwr still catches it sensibly.

Contract:
- ``code`` is stable across releases; callers branch on the type or the code, never on a message.
- ``details`` is a flat JSON-able mapping (strings, numbers, booleans); it travels over the wire.
- Errors pickle and unpickle to the same type, message, details (worker pools rely on it).
- ``error_from_code`` is the single reverse mapping used by the client to rebuild the type
  the daemon raised; an unknown code becomes a plain ``HwrError`` carrying that code.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "ActiveBuildTimeout",
    "ActiveLease",
    "ArtifactDenied",
    "ArtifactNotFound",
    "ArtifactTooLarge",
    "BuildCancelled",
    "ChannelNotFound",
    "CheckpointModified",
    "CheckpointNotFound",
    "ChecksumMismatch",
    "ConfigError",
    "DaemonUnavailable",
    "DeadlineExceeded",
    "HwrError",
    "IdentityCollision",
    "IdentityError",
    "InsufficientCapacity",
    "InvalidRequest",
    "LeaseClosed",
    "ManifestCorrupt",
    "ManifestIncompatible",
    "NoSpace",
    "PermissionDeniedError",
    "ProducerFailed",
    "ProducerTimeout",
    "PublicationFailed",
    "RemoteUnavailable",
    "SessionInvalid",
    "StoreIOError",
    "StoreLimitExceeded",
    "StoreLocked",
    "Unsupported",
    "UntrustedDaemon",
    "UntrustedStore",
    "error_from_code",
]


class HwrError(Exception):
    """Root of every hwr error.

    ``message`` is one human line (no traceback, no secrets); ``details`` a flat mapping.
    """

    code: ClassVar[str] = "HWR_ERROR"
    retryable: ClassVar[bool] = False

    def __init__(self, message: str = "", *, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message or self.code
        self.details: dict[str, Any] = dict(details or {})

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self.details))

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, message={self.message!r})"


def _rebuild(cls: type[HwrError], message: str, details: dict[str, Any]) -> HwrError:
    return cls(message, details=details)


class ArtifactNotFound(HwrError, LookupError):
    """No committed artifact exists for the identity or key (a miss)."""

    code = "LOCAL_MISS"


class ChannelNotFound(HwrError, LookupError):
    """No channel of that name exists on this node (``hwrctl channel ls`` lists them)."""

    code = "CHANNEL_NOT_FOUND"


class RemoteUnavailable(ArtifactNotFound):
    """Not in the local store, and the configured remote tier could not be asked (a miss whose
    message and ``details["remote"]`` name the remote): preferred mode falls back, required fails."""

    code = "REMOTE_UNAVAILABLE"
    retryable = True


class RemoteDenied(RemoteUnavailable):
    """The configured remote tier refused hwrd: its credentials or permissions (a wrong key or
    secret, no credentials at all, a policy that denies the bucket or the path). Not a network
    problem, and not retryable: nothing changes until the operator fixes the credentials or the
    policy. A ``RemoteUnavailable`` (a miss the remote could not answer), so a caller that falls
    back on an unreachable remote does so here too."""

    code = "REMOTE_DENIED"
    retryable = False


class ArtifactDenied(HwrError, PermissionError):
    """The artifact carries a deny marker (corrupt, or denied by an operator)."""

    code = "ARTIFACT_DENIED"


class ManifestCorrupt(HwrError, ValueError):
    """An artifact's manifest, marker or safetensors header is malformed or inconsistent."""

    code = "MANIFEST_CORRUPT"


class ManifestIncompatible(HwrError, ValueError):
    """A structurally valid manifest of a schema or contents this reader does not accept."""

    code = "MANIFEST_INCOMPATIBLE"


class ChecksumMismatch(HwrError, ValueError):
    """Bytes do not hash to what the manifest records."""

    code = "CHECKSUM_MISMATCH"


class IdentityCollision(HwrError, ValueError):
    """An artifact with this identity exists with different content."""

    code = "IDENTITY_COLLISION"


class IdentityError(HwrError, ValueError):
    """An identity is not exact canonical JSON of the expected shape."""

    code = "INVALID_IDENTITY"


class InvalidRequest(HwrError, ValueError):
    """A request is malformed or out of range; nothing was changed."""

    code = "INVALID_ARGUMENT"


class ConfigError(HwrError, ValueError):
    """Configuration is invalid; the message names the field."""

    code = "INVALID_CONFIG"


class Unsupported(HwrError, NotImplementedError):
    """The operation or combination is not supported."""

    code = "UNSUPPORTED"


class UntrustedStore(HwrError, PermissionError):
    """The store root or the socket directory has unsafe permissions, or the store lives on a
    filesystem type that is not allowed."""

    code = "DOMAIN_POLICY_MISMATCH"


class StoreLocked(HwrError, RuntimeError):
    """Another daemon already owns this store root."""

    code = "STORE_LOCKED"


class StoreIOError(HwrError, OSError):
    """An I/O error in the store that is not corruption (retry may succeed)."""

    code = "DOMAIN_UNAVAILABLE"
    retryable = True


class NoSpace(HwrError, OSError):
    """The filesystem ran out of space while writing."""

    code = "ENOSPC"
    retryable = True


class ArtifactTooLarge(HwrError, OSError):
    """The artifact exceeds the per-artifact byte limit."""

    code = "ARTIFACT_TOO_LARGE"
    retryable = True


class StoreLimitExceeded(HwrError, OSError):
    """The store's byte limit would be exceeded and nothing could be evicted."""

    code = "STORE_LIMIT_EXCEEDED"
    retryable = True


class InsufficientCapacity(HwrError, OSError):
    """The filesystem's free space would drop under the configured minimum."""

    code = "INSUFFICIENT_CAPACITY"
    retryable = True


class ExceedsFilesystem(InsufficientCapacity):
    """The artifact (with ``min_free_bytes`` kept free) is larger than the store's whole
    filesystem could hold even empty: no eviction, wait or retry helps; not retryable. Put the
    store on a larger filesystem, or publish a smaller artifact."""

    code = "EXCEEDS_FILESYSTEM"
    retryable = False


class ActiveLease(HwrError, RuntimeError):
    """The artifact is leased or mapped and cannot be removed."""

    code = "ACTIVE_LEASE"


class ActiveBuildTimeout(HwrError, TimeoutError):
    """Waiting for another publisher of the same identity timed out."""

    code = "ACTIVE_BUILD_TIMEOUT"
    retryable = True


class PublicationFailed(HwrError, RuntimeError):
    """A publication could not be committed (aborted, invalid data, or the daemon restarted)."""

    code = "PUBLICATION_FAILED"


class PermissionDeniedError(HwrError, PermissionError):
    """The caller is not on the daemon's allow-list or does not own the object."""

    code = "PERMISSION_DENIED"


class SessionInvalid(HwrError, RuntimeError):
    """The session token is unknown or the session has ended."""

    code = "SESSION_INVALID"
    retryable = True


class LeaseClosed(HwrError, RuntimeError):
    """The lease was already released."""

    code = "LEASE_CLOSED"


class DaemonUnavailable(HwrError, ConnectionError):
    """hwrd cannot be reached on its socket."""

    code = "DAEMON_UNAVAILABLE"
    retryable = True


class UntrustedDaemon(DaemonUnavailable):
    """The process answering on the socket is not one this client may trust with its weights
    (another user's hwrd, or sockets in a place others control: ``hwr.client.daemon_trust``).
    A ``DaemonUnavailable`` so that a caller that can do without hwrd does."""

    code = "UNTRUSTED_DAEMON"


class DeadlineExceeded(HwrError, TimeoutError):
    """A call did not finish before its deadline."""

    code = "DEADLINE_EXCEEDED"
    retryable = True


class CheckpointNotFound(HwrError, LookupError):
    """No registered checkpoint matches the id, prefix or path."""

    code = "CHECKPOINT_NOT_FOUND"


class CheckpointModified(HwrError, RuntimeError):
    """A checkpoint file changed after (or while) it was registered; leases and prewarm are refused."""

    code = "CHECKPOINT_MODIFIED"


class ProducerFailed(HwrError, RuntimeError):
    """A producer process crashed, was killed or reported an error; nothing was published."""

    code = "PRODUCER_FAILED"


class ProducerTimeout(HwrError, TimeoutError):
    """A producer process ran past its time limit and was killed; nothing was published."""

    code = "PRODUCER_TIMEOUT"
    retryable = True


class BuildCancelled(HwrError, RuntimeError):
    """A prewarm build was cancelled by its client; the producer was killed, nothing was published."""

    code = "BUILD_CANCELLED"



# --- restore and startup (loader transaction) ---
class RestorePreflightFailed(HwrError, ValueError):
    """A lease does not cover the model exactly (names, kinds, shapes, dtypes, strides); nothing changed."""

    code = "RESTORE_PREFLIGHT_FAILED"


class RestoreCommitFailed(HwrError, RuntimeError):
    """Binding lease tensors into the model failed part-way; the model must be discarded."""

    code = "RESTORE_COMMIT_FAILED"


class StartupFailed(HwrError, RuntimeError):
    """A worker could not start under its Host Weight Runtime mode; ``report`` says why."""

    code = "STARTUP_FAILED"

    def __init__(self, message: str = "", *, details: dict[str, Any] | None = None, report: Any = None) -> None:
        super().__init__(message, details=details)
        self.report = report

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self.details))

def _all_subclasses(cls: type[HwrError]) -> list[type[HwrError]]:
    found: list[type[HwrError]] = []
    for sub in cls.__subclasses__():
        found.append(sub)
        found.extend(_all_subclasses(sub))
    return found


def error_from_code(code: str, message: str, details: dict[str, Any] | None = None) -> HwrError:
    """Rebuild the typed error for a stable ``code`` (the client's side of the wire mapping)."""
    for cls in _all_subclasses(HwrError):
        if cls.code == code:
            return cls(message, details=details)
    err = HwrError(message, details=details)
    err.details.setdefault("code", code)
    return err
