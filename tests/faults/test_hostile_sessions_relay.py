"""Hostile and careless clients against sessions, the gRPC relay and publications: each runs
against a real hwrd (root without capabilities, and the unit's unprivileged user where the
daemon's rights matter) and is counted in the hostile summary of ``test_hostile_clients.py``
(``hwr hostile clients: ...``), with the same tally.

- A session holding as many channel watches as the README allows (64) still gets its unary
  calls answered at once, and one more watch is refused with a typed error.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from hwr.client import connect
from hwr.client.errors import InvalidRequest
from hwr.daemon.app.launcher import DaemonProcess

from . import test_hostile_clients as hostile
from .faultkit import publish
from .test_hostile_clients import Attack, crashes

# The hostile suite's fixtures (the tally and its summary, the attacked daemon), shared so that
# these attacks are counted with the others.
_summary, attack, artifact, start, open_dir = (hostile._summary, hostile.attack, hostile.artifact, hostile.start,
                                               hostile.open_dir)
pytestmark = hostile.pytestmark  # root (attackers drop to other uids) and setpriv

WATCHES_PER_SESSION = 64  # the README's promise
UNARY_BOUND_S = 5.0  # a unary call behind 64 open watches: answered well before the client's timeout


@pytest.mark.usefixtures("daemon_user")  # root without capabilities, and the unit's user
@pytest.mark.timeout(240)
def test_watches_per_session(artifact: Callable[..., tuple[DaemonProcess, str, str]], attack: Attack) -> None:
    """64 watches open on one session: ``list_channels``, ``set_channel`` and a publication are
    answered at once (a watch once held one of the 8 calls a gRPC connection has in flight, so
    8 watches froze the session for 10 s), every watch hears the change, and a 65th watch is
    refused (``InvalidRequest``, ``details.limit`` 64)."""
    daemon, key, _digest = artifact()
    timings: dict[str, float] = {}
    with connect(daemon.socket, timeout=10) as client:
        names = [f"w{i:02d}" for i in range(WATCHES_PER_SESSION)]
        for name in names:
            client.set_channel(name, key)
        watches = [client.watch_channel(name) for name in names]
        try:
            assert all(w.wait(30) is not None for w in watches)  # the state at subscription
            began = time.monotonic()
            listed = client.list_channels()
            timings["list_channels"] = time.monotonic() - began
            assert {c["name"] for c in listed} >= set(names)
            other = publish(client, "hostile-watches", 3)
            began = time.monotonic()
            client.set_channel(names[-1], other)
            timings["set_channel"] = time.monotonic() - began
            update = watches[-1].wait(30)
            assert update is not None and update.key == other
            with pytest.raises(InvalidRequest) as refused:
                client.watch_channel("one-too-many")
            assert refused.value.details.get("limit") == WATCHES_PER_SESSION
            began = time.monotonic()
            client.status()
            timings["status"] = time.monotonic() - began
            assert client.inspect_channel(names[0])["watchers"] == 1
        finally:
            for watch in watches:
                watch.close()
    attack.tried = WATCHES_PER_SESSION + 1
    attack.crashes = crashes(daemon)
    slow = {call: t for call, t in timings.items() if t > UNARY_BOUND_S}
    attack.others_failed = len(slow)
    attack.complete = True
    print(f"\nwatches per session: {WATCHES_PER_SESSION} open, one more refused; unary calls took "
          + ", ".join(f"{call} {t * 1000:.0f} ms" for call, t in timings.items()))
    assert not slow, f"unary calls were held up behind the watches: {slow}"
    assert attack.crashes == 0
