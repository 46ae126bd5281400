"""The entry point: discovered through package metadata, loaded by vLLM-Omni, idempotent, guarded."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm_omni")

import hwr.dlo_backend.vllm_plugin as plugin
from hwr.dlo_backend.vllm_plugin import compat, interception


@pytest.fixture
def fresh(monkeypatch):
    import vllm_omni.plugins as vo_plugins

    monkeypatch.delenv("HWR_VLLM_PLUGIN", raising=False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    interception.uninstall()
    plugin._reset_for_tests()
    monkeypatch.setattr(vo_plugins, "omni_plugins_loaded", False)
    yield vo_plugins
    interception.uninstall()
    plugin._reset_for_tests()


def test_entry_point_is_declared_in_the_package_metadata():
    eps = [ep for ep in entry_points(group="vllm_omni.general_plugins") if ep.name == "hwr"]
    assert len(eps) == 1
    assert eps[0].value == "hwr.dlo_backend.vllm_plugin:register"
    assert eps[0].load() is plugin.register


def test_vllm_omni_loader_installs_the_plugin_once(fresh):
    from vllm_omni.host_weight_runtime import HostWeightRuntime

    original = HostWeightRuntime.__dict__["from_config"].__func__
    fresh.load_omni_general_plugins()
    assert plugin.state() == "installed" and interception.installed()
    wrapped = HostWeightRuntime.__dict__["from_config"].__func__
    assert wrapped.__wrapped__ is original
    plugin._reset_for_tests()
    plugin.register()  # a second load in the same process: no second wrapper
    plugin.register()
    assert HostWeightRuntime.__dict__["from_config"].__func__ is wrapped
    assert interception.uninstall() and HostWeightRuntime.__dict__["from_config"].__func__ is original


def test_a_fresh_process_discovers_and_loads_it():
    code = ("from vllm_omni.plugins import load_omni_general_plugins as load; load();"
            "import hwr.dlo_backend.vllm_plugin as p; from vllm_omni.host_weight_runtime import HostWeightRuntime as R;"
            "print('STATE', p.state(), getattr(R.from_config.__func__, '_hwr_vllm_plugin', False))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert "STATE installed True" in out.stdout, out.stderr[-2000:]


def test_vllm_plugins_allow_list_without_hwr_skips_it(fresh, monkeypatch):
    import vllm.envs as envs

    monkeypatch.setattr(envs, "VLLM_PLUGINS", ["something-else"], raising=False)
    fresh.load_omni_general_plugins()
    assert plugin.state() == "unloaded" and not interception.installed()


def test_disabled_by_environment(fresh, monkeypatch):
    monkeypatch.setenv("HWR_VLLM_PLUGIN", "0")
    plugin.register()
    assert plugin.state().startswith("disabled") and not interception.installed()


def test_unknown_version_logs_once_and_does_nothing(fresh, monkeypatch, caplog):
    import vllm_omni

    monkeypatch.setattr(vllm_omni, "__version__", "0.31.0")
    with caplog.at_level("WARNING", logger="hwr.vllm_plugin"):
        plugin.register()
        plugin.register()
    assert plugin.state().startswith("incompatible") and "0.31.0" in plugin.state()
    assert not interception.installed()
    assert len([r for r in caplog.records if "inactive" in r.getMessage()]) == 1


def test_missing_attribute_is_reported(monkeypatch):
    import vllm_omni.host_weight_runtime as hwr_module

    assert compat.check().ok, compat.check().problems
    monkeypatch.delattr(hwr_module, "LeaseProvenance")
    report = compat.check()
    assert not report.ok and any("LeaseProvenance" in p for p in report.problems)


def test_register_never_raises(fresh, monkeypatch):
    def boom() -> bool:
        raise RuntimeError("patching failed")

    monkeypatch.setattr(interception, "install", boom)
    plugin.register()
    assert plugin.state() == "failed: patching failed"
