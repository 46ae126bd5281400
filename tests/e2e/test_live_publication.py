"""Publishing revisions for live updates: a large non-durable revision is laid out in several
files that the client hands over as it writes them (hwrd hashes each meanwhile), and the result
is exactly what a full hash at commit gives; a writer that keeps a handed-over file open or
mapped gets its commit refused. Real hwrd, the test process as a real client."""

from __future__ import annotations

import mmap
import os

import pytest
import torch

from hwr.client import ArtifactIdentity, connect
from hwr.client.errors import ChannelNotFound, PublicationFailed
from hwr.client.publisher import specs_for
from hwr.daemon.app.launcher import DaemonProcess

MIB = 1 << 20


def revision(seed: int, count: int = 10, mib: int = 8) -> dict[str, torch.Tensor]:
    return {f"blocks.{i}.w": torch.arange(seed + i * mib * MIB // 4, seed + (i + 1) * mib * MIB // 4,
                                          dtype=torch.int32).view(torch.bfloat16)
            for i in range(count)}


@pytest.mark.timeout(240)
def test_a_large_revision_is_hashed_file_by_file_while_written(shared_hwrd: DaemonProcess) -> None:
    tensors = revision(1)  # 80 MiB: past the peer channel's size, several files
    with connect(shared_hwrd.socket) as client:
        handed: list[int] = []
        pub = client.publisher(ArtifactIdentity.simple("live/files"), specs_for(tensors), channel="live-files",
                               durable=False)
        real = pub._hand_over
        assert real is not None
        pub._hand_over = lambda pid, token, index: (handed.append(index), real(pid, token, index))[1]
        for name in pub.write_order(tensors):
            pub.write(name, tensors[name])
        key = pub.commit()
        info = client.inspect(key)
        assert len(info["files"]) > 1 and sorted(handed) == list(range(len(info["files"])))
        assert info["non_durable"] and info["channels"] == ["live-files"]
        verdict = client.verify(key)  # every byte re-hashed: the early digests were right
        assert verdict["ok"], verdict
        with client.acquire_channel("live-files") as lease:
            assert lease.key == key
            for name, t in tensors.items():
                assert torch.equal(lease.tensors[name].view(torch.int16), t.view(torch.int16)), name
        # publish() writes in file order and hands every file over the same way
        again = revision(2)
        key2 = client.publish(ArtifactIdentity.simple("live/files-2"), again, channel="live-files", durable=False)
        assert client.verify(key2)["ok"] and client.inspect_channel("live-files")["key"] == key2
        client.remove_channel("live-files")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("keep", ["descriptor", "mapping"])
def test_a_writer_that_keeps_a_handed_over_file_cannot_commit(shared_hwrd: DaemonProcess, keep: str) -> None:
    tensors = revision(3)
    with connect(shared_hwrd.socket) as client:
        pub = client.publisher(ArtifactIdentity.simple(f"live/keeps-{keep}"), specs_for(tensors),
                               channel="live-keeps", durable=False)
        order = pub.write_order(tensors)
        first = pub._placements[order[0]].file_index
        kept = os.dup(pub._fds[first])
        view = mmap.mmap(kept, 0) if keep == "mapping" else None
        if view is not None:
            os.close(kept)  # only the mapping holds the file now
        try:
            for name in order:
                pub.write(name, tensors[name])
            # hwrd hands out no writable descriptor of a publication with handed-over files
            with pytest.raises(PublicationFailed):
                client._peer_exchange({"op": "staging_fds", "publication_id": pub._publication_id,
                                       "publication_token": pub._token}, want_fds=True)
            with pytest.raises(PublicationFailed) as refused:
                pub.commit()
            assert "still holds" in refused.value.message
        finally:
            if view is not None:
                view.close()
            else:
                os.close(kept)
        with pytest.raises(ChannelNotFound):  # nothing was committed, so the channel was never set
            client.inspect_channel("live-keeps")
