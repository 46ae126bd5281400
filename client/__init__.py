"""hwr.client: the contract package (identity, artifact format, leases, publication).

Entry points fixed by ARCHITECTURE.md: ``connect(socket=None)`` returns a ``Client``;
``ArtifactIdentity.from_dict``; ``client.publish(identity, tensors)``; ``client.acquire(...)``
returning a ``Lease``; a miss raises ``ArtifactNotFound``. The daemon imports this package's
identity and format types, never the other way round.

Names are resolved lazily (PEP 562) so that hwrd, which imports the contract modules
(``hwr.client.errors``, ``identity``, ``manifest``, ``safetensors_header``, ``wire``), never
imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ArtifactDenied": "hwr.client.errors",
    "ArtifactNotFound": "hwr.client.errors",
    "ChannelNotFound": "hwr.client.errors",
    "ChannelUpdate": "hwr.client.channels",
    "ChannelWatch": "hwr.client.channel_watch",
    "DaemonUnavailable": "hwr.client.errors",
    "HwrError": "hwr.client.errors",
    "IdentityCollision": "hwr.client.errors",
    "IdentityError": "hwr.client.errors",
    "ArtifactIdentity": "hwr.client.identity",
    "HostLease": "hwr.client.carrier",
    "LeaseCarrier": "hwr.client.carrier",
    "MappedRegion": "hwr.client.carrier",
    "Client": "hwr.client.client",
    "connect": "hwr.client.client",
    "Lease": "hwr.client.lease",
    "Publisher": "hwr.client.publisher",
    "TensorSpec": "hwr.client.publisher",
}

__all__ = [
    "ArtifactDenied",
    "ArtifactIdentity",
    "ArtifactNotFound",
    "ChannelNotFound",
    "ChannelUpdate",
    "ChannelWatch",
    "Client",
    "DaemonUnavailable",
    "HostLease",
    "HwrError",
    "IdentityCollision",
    "IdentityError",
    "Lease",
    "LeaseCarrier",
    "MappedRegion",
    "Publisher",
    "TensorSpec",
    "connect",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hwr.client' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from hwr.client.carrier import HostLease, LeaseCarrier, MappedRegion
    from hwr.client.channel_watch import ChannelWatch
    from hwr.client.channels import ChannelUpdate
    from hwr.client.client import Client, connect
    from hwr.client.errors import (
        ArtifactDenied,
        ArtifactNotFound,
        ChannelNotFound,
        DaemonUnavailable,
        HwrError,
        IdentityCollision,
        IdentityError,
    )
    from hwr.client.identity import ArtifactIdentity
    from hwr.client.lease import Lease
    from hwr.client.publisher import Publisher, TensorSpec
