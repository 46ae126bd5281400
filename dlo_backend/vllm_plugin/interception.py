"""Substitute hwrd for vLLM-Omni's filesystem store behind ``HostWeightRuntime.from_config``.

vLLM-Omni has no registry for host-weight stores: ``HostWeightRuntime.from_config`` hard-codes
its filesystem store, and the diffusion loader calls it through the class at load time. The
plugin therefore replaces that classmethod with a wrapper:

    mode disabled                      -> the original (no probing at all, as upstream)
    no hwrd configured (see config)    -> the original (vLLM-Omni's own store)
    marker present but malformed       -> a runtime whose initialization failed with
                                          CONFIGURATION/INVALID_CONFIG (startup fails in both
                                          modes, naming the file: an operator error is never
                                          hidden behind a silent fallback)
    hwrd configured                    -> a runtime over ``HwrdHostWeightStore``; reaching the
                                          daemon is deferred to the first lookup, so a daemon
                                          that is down gives preferred -> canonical fallback,
                                          required -> failure naming the socket; its ``resolve``
                                          agrees on one outcome across the job's ranks (``agree``)

The original is not called first when hwrd is configured: it would create and lock a
filesystem store in the runtime root that nothing would use. The runtime root still holds
vLLM-Omni's source digest cache and the ``hwrd.json`` marker.

``install`` and ``uninstall`` are idempotent; the wrapper keeps the original in ``__wrapped__``.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from hwr.client.errors import ConfigError
from hwr.dlo_backend.vllm_plugin.config import resolve_target

__all__ = ["install", "installed", "uninstall"]

log = logging.getLogger("hwr.vllm_plugin")
_MARK = "_hwr_vllm_plugin"
_lock = threading.Lock()


def _runtime_cls() -> Any:
    from vllm_omni.host_weight_runtime import HostWeightRuntime

    return HostWeightRuntime


def installed() -> bool:
    return getattr(_runtime_cls().__dict__["from_config"].__func__, _MARK, False)


def install() -> bool:
    """Install every hook (the store, the loader gate, the DLO backend factory, the loader's
    "unchanged" snapshot); False when the store hook was already installed. See ``gate``,
    ``factory`` and ``unchanged`` for the other three."""
    from hwr.dlo_backend.vllm_plugin import unchanged
    from hwr.dlo_backend.vllm_plugin.factory import install_factory
    from hwr.dlo_backend.vllm_plugin.gate import install_gate

    install_gate()
    install_factory()
    unchanged.install()
    return _install_store()


def _install_store() -> bool:
    cls = _runtime_cls()
    with _lock:
        original = cls.__dict__["from_config"].__func__
        if getattr(original, _MARK, False):
            return False

        def from_config(klass: Any, config: Any, *, observer: Any = None, publication_observer: Any = None) -> Any:
            return _from_config(original, klass, config, observer, publication_observer)

        setattr(from_config, _MARK, True)
        from_config.__wrapped__ = original  # type: ignore[attr-defined]
        from_config.__doc__ = original.__doc__
        cls.from_config = classmethod(from_config)
        return True


def uninstall() -> bool:
    """Restore every original; False when the store hook was not installed."""
    from hwr.dlo_backend.vllm_plugin import unchanged
    from hwr.dlo_backend.vllm_plugin.factory import uninstall_factory
    from hwr.dlo_backend.vllm_plugin.gate import uninstall_gate

    uninstall_gate()
    uninstall_factory()
    unchanged.uninstall()
    cls = _runtime_cls()
    with _lock:
        current = cls.__dict__["from_config"].__func__
        if not getattr(current, _MARK, False):
            return False
        cls.from_config = classmethod(current.__wrapped__)
        return True


def _from_config(original: Any, klass: Any, config: Any, observer: Any, publication_observer: Any) -> Any:
    from vllm_omni.host_weight_runtime import (
        CanonicalJson,
        FailureCode,
        HostWeightFailure,
        ResolutionStage,
        RuntimeMode,
    )

    if config.mode is RuntimeMode.DISABLED or config.domain is None:
        return original(klass, config, observer=observer, publication_observer=publication_observer)
    root = Path(config.domain.root)
    try:
        target = resolve_target(root)
    except ConfigError as exc:
        failure = HostWeightFailure(stage=ResolutionStage.CONFIGURATION, code=FailureCode.INVALID_CONFIG,
                                    retryable=False, message=exc.message,
                                    details=CanonicalJson.from_value({k: str(v) for k, v in exc.details.items()}))
        log.error("hwrd marker rejected: %s", exc.message)
        return klass(config, observer=observer, publication_observer=publication_observer,
                     _initialization_failure=failure)
    if target is None:
        return original(klass, config, observer=observer, publication_observer=publication_observer)
    from hwr.dlo_backend.vllm_plugin import agree
    from hwr.dlo_backend.vllm_plugin.store import HwrdHostWeightStore

    log.info("Host Weight Runtime (%s) resolves through hwrd at %s (from %s)",
             config.mode.value, target.socket, target.origin)
    store = HwrdHostWeightStore(target, mode=config.mode.value)
    runtime = klass(config, store, observer=observer, publication_observer=publication_observer)
    return agree.install_on(runtime)  # the job's ranks take one outcome (see ``agree``)
