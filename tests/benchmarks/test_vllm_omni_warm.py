"""benchmarks/vllm_omni_warm: DiT sizes by width at a fixed block count, and the page-cache probe."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))  # as test_run_all does: "benchmarks" is this package

from vllm_omni_warm import _cached, _evict, dit_config  # noqa: E402


def test_every_size_has_the_same_blocks_and_a_width_that_grows_with_it() -> None:
    configs = [dit_config(mib) for mib in (64, 1024, 2048)]
    assert {(c["num_layers"], c["num_single_layers"]) for c in configs} == {(4, 12)}
    heads = [c["num_attention_heads"] for c in configs]
    assert heads == sorted(heads) and len(set(heads)) == 3, heads
    # bytes grow with the square of the width: 1 GiB needs about 1.4x the heads of 0.545 GiB (8)
    assert heads[1] == 11


def test_the_page_cache_probe_sees_a_file_read_and_then_dropped(tmp_path: Path) -> None:
    data = tmp_path / "weights" / "a.bin"
    data.parent.mkdir()
    data.write_bytes(os.urandom(1 << 20))
    data.read_bytes()
    assert _cached(data.parent) == 1 << 20  # just written and read: resident
    os.sync()  # DONTNEED drops clean pages only
    _evict(data.parent)
    assert _cached(data.parent) < 1 << 20
