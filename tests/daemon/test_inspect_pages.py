"""``hwr.daemon.policy.inspect_pages.page`` and ``hwrctl``'s ``printable``: pure functions, real inputs."""

from __future__ import annotations

import json

from hwr.daemon.ctl.cli import printable, table
from hwr.daemon.policy.inspect_pages import PAGE_BYTES, page


def _manifest(count: int, name_len: int = 20) -> bytes:
    tensors = [{"name": f"t{i:0{name_len}d}", "dtype": "F32", "shape": [1], "sha256": "0" * 64}
               for i in range(count)]
    return json.dumps({"schema_version": 1, "files": [{"name": "a"}], "tensors": tensors}).encode()


def test_pages_cover_every_tensor_once_within_the_byte_budget() -> None:
    data = _manifest(30_000, name_len=60)
    seen, offset, pages = [], 0, 0
    while True:
        head, tensors, count, after = page(data, offset, 0)
        assert json.loads(head)["tensors"] == [] and json.loads(head)["files"] == [{"name": "a"}]
        assert len(tensors) <= PAGE_BYTES + 1024
        assert after > offset or after == count
        seen += [t["name"] for t in json.loads(tensors)]
        pages += 1
        if after == count:
            break
        offset = after
    assert count == 30_000 and pages > 1
    assert seen == [t["name"] for t in json.loads(data)["tensors"]]


def test_a_limit_and_an_offset_past_the_end() -> None:
    data = _manifest(10)
    _, tensors, count, after = page(data, 3, 4)
    assert [t["name"] for t in json.loads(tensors)] == [f"t{i:020d}" for i in range(3, 7)] and after == 7
    _, tensors, count, after = page(data, 99, 0)
    assert json.loads(tensors) == [] and count == 10 and after == 10


def test_printable_escapes_control_and_format_characters_but_keeps_newlines() -> None:
    assert printable("plain text\nline two") == "plain text\nline two"
    assert printable("a\x1b[2Jb\rc\u202ed\x00") == "a\\x1b[2Jb\\rc\\u202ed\\x00"
    rendered = table(["NAME"], [["x\x1b[31my"]])
    assert "\x1b" not in rendered and "x\\x1b[31my" in rendered
