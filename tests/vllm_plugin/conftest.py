"""Fixtures of the vLLM-Omni plugin tests (every test module skips without ``vllm_omni``).

``vo_hwrd``: one real hwrd per test module (tests use distinct identities). ``omni_zygote``: one
fork server for the whole session that ``omni_harness.run`` forks its workers from
(``omni_harness.start_zygote``, a ``zygote.Zygote``; None where it cannot serve: the harness then
starts fresh interpreters). ``plugin``: the
plugin installed into ``HostWeightRuntime`` for one test and removed after it, with
``HWR_SOCKET``/``HWR_VLLM_PLUGIN`` cleared so each test states its own configuration.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_proc import DaemonProcess, finish_daemon


@pytest.fixture(scope="module")
def vo_hwrd() -> Iterator[DaemonProcess]:
    with tempfile.TemporaryDirectory(prefix="hwr-vo-") as d:
        os.chmod(d, 0o700)
        daemon = DaemonProcess(Path(d) / "store", Path(d) / "hwrd.sock").start()
        try:
            yield daemon
        finally:
            finish_daemon(daemon)


@pytest.fixture(scope="session")
def omni_zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    pytest.importorskip("vllm_omni")
    from omni_harness import start_zygote

    zygote = start_zygote(tmp_path_factory.mktemp("omni-zygote") / "zygote.log")
    try:
        yield zygote
    finally:
        if zygote is not None:
            zygote.close()


@pytest.fixture
def plugin(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from hwr.dlo_backend.vllm_plugin import interception

    monkeypatch.delenv("HWR_SOCKET", raising=False)
    monkeypatch.delenv("HWR_VLLM_PLUGIN", raising=False)
    interception.install()
    try:
        yield
    finally:
        interception.uninstall()


@pytest.fixture
def runtime_root(short_tmp: Path) -> Path:
    root = short_tmp / "hwr-runtime"
    root.mkdir(mode=0o700)
    return root
