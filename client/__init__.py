"""hwr.client: the contract package (identity, artifact format, leases, publication).

Entry points fixed by ARCHITECTURE.md: ``connect(socket=None)`` returns a ``Client``;
``ArtifactIdentity.from_dict``; ``client.publish(identity, tensors)``; ``client.acquire(...)``
returning a ``Lease``; a miss raises ``ArtifactNotFound``. The daemon imports this package's
identity and format types, never the other way round.
"""

from hwr.client.carrier import HostLease, LeaseCarrier, MappedRegion
from hwr.client.client import Client, connect
from hwr.client.errors import (
    ArtifactDenied,
    ArtifactNotFound,
    DaemonUnavailable,
    HwrError,
    IdentityCollision,
    IdentityError,
)
from hwr.client.identity import ArtifactIdentity
from hwr.client.lease import Lease
from hwr.client.publisher import Publisher, TensorSpec

__all__ = [
    "ArtifactDenied",
    "ArtifactIdentity",
    "ArtifactNotFound",
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
