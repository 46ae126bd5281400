"""One key namespace for every command that takes a KEY (``hwrctl show``, verify, deny, allow,
pin, unpin, evict, push): the read API's resolver (``hwr.daemon.service.catalog``), against a real
hwrd. A denied key resolves the same way for each of them, whether its directory is still in the
store (an operator's deny) or gone (quarantined after a failed verification).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hwr.client import ArtifactIdentity, connect
from hwr.client.errors import ArtifactDenied, ArtifactNotFound, InvalidRequest
from hwr.daemon.app.launcher import DaemonProcess

from .helpers import rot_a_byte


@pytest.mark.timeout(120)
def test_denied_and_quarantined_keys_resolve_alike_for_every_command(
        spawn_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = spawn_daemon()
    with connect(daemon.socket) as client:
        denied = client.publish(ArtifactIdentity.simple("denied"), {"w": torch.arange(4096.0)})
        rotten = client.publish(ArtifactIdentity.simple("rotten"), {"w": torch.arange(8192.0)})
        assert client.deny(denied[:10], "operator says no")["key"] == denied
    daemon.stop()  # bit rot while it is down: sizes and timestamps stay, only a re-hash can tell
    rot_a_byte(Path(daemon.root) / "artifacts" / rotten / "model-00001.safetensors", 1024)
    daemon = spawn_daemon(daemon=daemon)
    with connect(daemon.socket) as client:
        verdict = client.verify(rotten[:10])
        assert verdict["quarantined"] and not (Path(daemon.root) / "artifacts" / rotten).exists()
        for key in (denied, rotten):
            prefix = key[:10]
            shown = client.inspect(prefix)  # the listing entry of a denied key, directory or not
            assert shown["key"] == key and shown["state"] == "denied"
            assert key in {a["key"] for a in client.list_artifacts(include_denied=True)}
            assert key not in {a["key"] for a in client.list_artifacts()}
            with pytest.raises(ArtifactDenied):
                client.acquire(key)
            with pytest.raises(ArtifactDenied):
                client.pin(prefix)  # resolved, then refused for what it is, not "no such key"
        assert client.allow(denied[:10]) == {"key": denied, "was_denied": True}
        with client.acquire(denied) as lease:  # allowed again: re-validated and served
            assert float(lease.tensors["w"][7]) == 7.0
        assert client.allow(rotten[:10])["was_denied"]
        with pytest.raises(ArtifactNotFound):  # its bytes are in quarantine/: nothing to serve
            client.acquire(rotten)
        with pytest.raises(ArtifactNotFound):
            client.inspect(rotten[:10])
        with pytest.raises(InvalidRequest, match="4 to 64 lowercase hex digits"):
            client.inspect(denied[:3])


def _two_names_sharing_a_prefix(digits: int = 4) -> tuple[str, str, str]:
    """Two identities whose keys share their first ``digits`` hex digits (found by search:
    about 300 keys for 4 digits, by the birthday bound), and that prefix."""
    seen: dict[str, str] = {}
    for i in range(1 << 16):
        name = f"twin-{i}"
        head = ArtifactIdentity.simple(name).key[:digits]
        if head in seen:
            return seen[head], name, head
        seen[head] = name
    raise AssertionError("unreachable: 65,536 names over 65,536 prefixes")


@pytest.mark.timeout(120)
def test_an_ambiguous_prefix_is_refused_by_every_command_alike(
        spawn_daemon: Callable[..., DaemonProcess]) -> None:
    first, second, prefix = _two_names_sharing_a_prefix()
    daemon = spawn_daemon()
    with connect(daemon.socket) as client:
        keys = [client.publish(ArtifactIdentity.simple(n), {"w": torch.full((64,), 1.0)}) for n in (first, second)]
        assert all(k.startswith(prefix) for k in keys)
        for call in (client.inspect, client.verify, client.pin, client.unpin, client.evict, client.allow,
                     lambda p: client.deny(p, "x")):
            with pytest.raises(InvalidRequest, match="ambiguous key prefix") as info:
                call(prefix)
            assert info.value.details == {"key": prefix, "matches": 2}
        assert client.inspect(keys[0][:12])["key"] == keys[0]  # one digit more tells them apart
