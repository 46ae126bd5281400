"""The client checks that an acquire's reply is for the artifact it asked for.

A real daemon serves two artifacts, A and B. Between the client's ``Acquirer`` and its real
connection sits a fault at the channel's edge (``Misdirect``): it turns the acquire of A into
one of B, so the real daemon answers with B's lease, manifest and descriptors; optionally it also
relabels that reply as A's. Either way the client refuses (``ManifestCorrupt``), releases the
lease and closes the descriptors, instead of handing out B's bytes as A.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from hwr.client import ArtifactIdentity, connect
from hwr.client.acquisition import Acquirer
from hwr.client.errors import ManifestCorrupt
from hwr.daemon.app.launcher import DaemonProcess


class Misdirect:
    """The real connection, except that an acquire of ``asked`` is sent as one of ``served``
    (and, with ``relabel``, the reply then names ``asked``)."""

    def __init__(self, connection: Any, asked: str, served: str, relabel: bool) -> None:
        self._connection, self.asked, self.served, self.relabel = connection, asked, served, relabel

    def exchange(self, request: dict[str, Any], **kw: Any) -> Any:
        if request.get("op") == "acquire" and request.get("key") == self.asked:
            request = {"op": "acquire", "key": self.served}
            reply, fds, tail = self._connection.exchange(request, **kw)
            if self.relabel:
                reply = {**reply, "key": self.asked}
            return reply, fds, tail
        return self._connection.exchange(request, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._connection, name)


@pytest.mark.parametrize("relabel", [False, True], ids=["other-key", "relabelled"])
def test_a_reply_for_another_artifact_is_refused(hwrd: DaemonProcess, relabel: bool) -> None:
    with connect(hwrd.socket) as client:
        a = client.publish(ArtifactIdentity.simple("reply/a"), {"w": torch.zeros(8)})
        b = client.publish(ArtifactIdentity.simple("reply/b"), {"w": torch.ones(8)})
        assert client.leases() == []  # (opens the gRPC channel before the descriptors are counted)
        fds_before = len(os.listdir("/proc/self/fd"))
        acquirer = Acquirer(Misdirect(client._connection, a, b, relabel))  # type: ignore[arg-type]
        with pytest.raises(ManifestCorrupt) as refused:
            acquirer.acquire(a)
        assert refused.value.details["key"] == a
        assert client.leases() == []  # B's lease went back
        assert len(os.listdir("/proc/self/fd")) == fds_before  # and its descriptors are closed
        with client.acquire(a) as lease:  # the honest path still serves A
            assert float(lease.tensors["w"].sum()) == 0.0
