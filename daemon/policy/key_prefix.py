"""One resolver of key prefixes (pure): ``hwrctl show 3fa9`` and every admin command that takes a KEY.

A KEY is a 64-hex identity digest or a unique prefix of it (4 to 64 lowercase hex digits). The
caller supplies the candidates; which keys are candidates is decided once per namespace, not
per command: the local store's keys (``hwr.daemon.service.catalog``: present, denied and pinned
keys alike), the remote's complete artifacts (``hwr.daemon.rpc.remote``) and checkpoint ids
(``hwr.daemon.checkpoints.files``). Errors are typed: a malformed or ambiguous prefix is
``InvalidRequest``, no match is the namespace's not-found error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from hwr.client.errors import ArtifactNotFound, HwrError, InvalidRequest

__all__ = ["is_prefix", "unique_prefix"]

_HEX = frozenset("0123456789abcdef")


def is_prefix(text: str) -> bool:
    """Whether ``text`` is shaped like a key prefix: 4 to 64 lowercase hex digits."""
    return 4 <= len(text) <= 64 and set(text) <= _HEX


def _no_artifact(prefix: str) -> HwrError:
    return ArtifactNotFound("no artifact matches that key", details={"key": prefix})


def unique_prefix(prefix: str, candidates: Iterable[str], *, field: str = "key",
                  malformed: str = "a key prefix needs 4 to 64 lowercase hex digits",
                  ambiguous: str = "ambiguous key prefix",
                  missing: Callable[[str], HwrError] = _no_artifact) -> str:
    """The one candidate starting with ``prefix``. ``field`` names the request field in the
    errors' details; ``missing(prefix)`` builds the error raised when nothing matches."""
    if not is_prefix(prefix):
        raise InvalidRequest(malformed, details={field: prefix[:80]})
    matches = sorted({c for c in candidates if c.startswith(prefix)})
    if not matches:
        raise missing(prefix)
    if len(matches) > 1:
        raise InvalidRequest(ambiguous, details={field: prefix, "matches": len(matches)})
    return matches[0]
