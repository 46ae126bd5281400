"""The producer runner's spare process: started ahead of time, it receives the job and the
descriptors over its socket and produces the same bytes as a fresh process; a dead or idled-out
spare is replaced by a fresh process, and an idle spare exits on its own."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hwr.client.errors import InvalidRequest
from hwr.client.safetensors_header import read_header
from hwr.daemon.producers import runner

pytestmark = pytest.mark.timeout(120)


def _job(tmp: Path) -> tuple[dict, list[int], dict[str, torch.Tensor], dict[str, tuple[int, int]]]:
    g = torch.Generator().manual_seed(5)
    source = {"a": torch.randn(40, 9, generator=g), "b": torch.randn(7, generator=g)}
    save_file(source, tmp / "src.safetensors")
    src = os.open(tmp / "src.safetensors", os.O_RDONLY)
    out = os.open(tmp / "out.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.ftruncate(out, 64 + 40 * 9 * 2 + 7 * 2)
    st = os.fstat(src)
    where = {"a": (64, 40 * 9 * 2), "b": (64 + 40 * 9 * 2, 14)}
    assert {e.name for e in read_header(src, require_alignment=False).entries} == set(source)
    job = {"producer": "cast", "options": {"dtype": "bf16"}, "rank": 0,
           "sources": [{"fd": src, "fingerprint": [st.st_size, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]}],
           "outputs": {name: [out, offset, nbytes] for name, (offset, nbytes) in where.items()},
           "files": [[out, "out.bin", os.fstat(out).st_size]]}
    return job, [src, out], source, where


def _check_output(tmp: Path, source: dict[str, torch.Tensor], where: dict[str, tuple[int, int]]) -> None:
    data = (tmp / "out.bin").read_bytes()
    for name, (offset, nbytes) in where.items():
        got = torch.frombuffer(bytearray(data[offset:offset + nbytes]), dtype=torch.bfloat16)
        assert torch.equal(got, source[name].to(torch.bfloat16).reshape(-1))


async def _started_spare() -> runner._Process:
    runner.ensure_spare()
    assert runner._spare_starting is not None
    await runner._spare_starting
    assert runner._spare is not None
    return runner._spare


def test_a_spare_serves_one_job_with_passed_descriptors(short_tmp: Path) -> None:
    job, fds, source, where = _job(short_tmp)

    async def main() -> dict:
        spare = await _started_spare()
        done = await runner.run_job(job, fds, timeout=60)
        assert spare.proc.returncode == 0 and runner._spare is None  # it served and exited
        return done

    try:
        done = asyncio.run(main())
    finally:
        for fd in fds:
            os.close(fd)
    _check_output(short_tmp, source, where)
    assert set(done["digests"]["tensors"]) == set(source)  # the remapped "files" reached the spare


def test_a_killed_spare_is_replaced_by_a_fresh_process(short_tmp: Path) -> None:
    job, fds, source, where = _job(short_tmp)

    async def main() -> None:
        spare = await _started_spare()
        os.killpg(spare.proc.pid, signal.SIGKILL)
        await spare.proc.wait()
        await runner.run_job(job, fds, timeout=60)

    try:
        asyncio.run(main())
    finally:
        for fd in fds:
            os.close(fd)
    _check_output(short_tmp, source, where)


def test_an_idle_spare_exits_and_errors_stay_typed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "SPARE_IDLE_S", 0.5)

    async def main() -> None:
        spare = await _started_spare()
        assert await asyncio.wait_for(spare.proc.wait(), 60) == 0  # nobody came: it left quietly
        with pytest.raises(InvalidRequest):  # the fresh process that replaces it reports typed errors
            await runner.run_job({"producer": "cast", "options": {"dtype": "int4"}, "sources": [], "outputs": {}},
                                 [], timeout=60)
        runner.SPARE_IDLE_S = 300.0
        spare = await _started_spare()
        with pytest.raises(InvalidRequest):  # the same through a spare
            await runner.run_job({"producer": "cast", "options": {"dtype": "int4"}, "sources": [], "outputs": {}},
                                 [], timeout=60)
        assert spare.proc.returncode == 1 and runner._spare is None  # the spare ran it

    asyncio.run(main())
