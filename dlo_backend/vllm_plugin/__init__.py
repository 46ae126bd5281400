"""The vLLM-Omni plugin: ``--host-weight-runtime-mode preferred|required`` resolves through hwrd.

Registered as the ``hwr`` entry point of the ``vllm_omni.general_plugins`` group, which
vLLM-Omni loads in every process it starts (API server, engine core, spawned diffusion workers)
before any model loads. ``register()``:

- is idempotent (a second call in the same process does nothing) and never raises: vLLM-Omni
  calls it outside any ``try``, so a failure here would kill the serving process;
- touches no GPU and opens no connection (the daemon is reached at the first lookup);
- checks the vLLM-Omni version and every attribute it relies on (``compat``); on a mismatch it
  logs one warning and changes nothing, leaving vLLM-Omni's own store in place;
- then wraps ``HostWeightRuntime.from_config`` (``interception``) so that, when hwrd is
  configured (``config``: ``HWR_SOCKET`` or ``<runtime root>/hwrd.json``), the runtime's store
  is ``store.HwrdHostWeightStore``.

Modules: ``config`` (where hwrd is), ``compat`` (version/attribute check), ``interception``
(the classmethod wrapper), ``store`` (the HostWeightStore over hwrd), ``writer`` (producer
output collected for an hwrd publication). ``HWR_VLLM_PLUGIN=0`` disables the plugin.
If ``VLLM_PLUGINS`` is set, it must name ``hwr`` for vLLM-Omni to load this plugin.
"""

from __future__ import annotations

import logging
import threading

__all__ = ["PLUGIN_NAME", "register", "state"]

PLUGIN_NAME = "hwr"
log = logging.getLogger("hwr.vllm_plugin")
_lock = threading.Lock()
_state: dict[str, str] = {}


def state() -> str:
    """``"unloaded"``, ``"disabled: <why>"``, ``"incompatible: <why>"``, ``"failed: <why>"`` or ``"installed"``."""
    return _state.get("state", "unloaded")


def register() -> None:
    """The entry point; see the module docstring for its contract."""
    with _lock:
        if "state" in _state:
            return
        _state["state"] = "loading"
    try:
        _state["state"] = _register()
    except Exception as exc:  # never take a serving process down from a plugin hook
        _state["state"] = f"failed: {exc}"
        log.warning("hwr vLLM-Omni plugin failed to install; vLLM-Omni keeps its own store: %s", exc)


def _register() -> str:
    from hwr.dlo_backend.vllm_plugin import compat, config

    if config.plugin_disabled():
        log.info("hwr vLLM-Omni plugin disabled by %s", config.ENV_DISABLE)
        return f"disabled: {config.ENV_DISABLE}"
    report = compat.check()
    if not report.ok:
        log.warning("hwr vLLM-Omni plugin inactive (%s)", report.summary())
        return f"incompatible: {report.summary()}"
    from hwr.dlo_backend.vllm_plugin import interception

    interception.install()
    log.debug("hwr vLLM-Omni plugin installed (%s)", report.summary())
    return "installed"


def _reset_for_tests() -> None:
    with _lock:
        _state.clear()
