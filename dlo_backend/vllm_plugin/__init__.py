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
  is ``store.HwrdHostWeightStore``;

- and wraps two more vLLM-Omni entry points (same install, same idempotence): the loader's
  eligibility gate (``gate``) and the DLO backend factory (``factory``), which together make
  ``preferred|required`` apply to the paths vLLM-Omni 0.30 never resolves through the runtime.

Design of the DLO side (why hwrd does not replace vLLM-Omni's whole DLO backend)
-------------------------------------------------------------------------------
vLLM-Omni's ``DistributedLayerwiseOffloadBackend`` does far more for a pipeline than stream
blocks: it resolves the model's offload plan, places non-block DiT modules, runs text-encoder
rings, stages on-demand and resident modules, exposes the residency controller, takes the
loader's carrier once and tears all of it down in a fixed order. Re-implementing that against
private, version-specific code would fork it. What costs a node memory is narrower: with
AllGather every rank copies its shard of every block into private pinned memory at enable
(page cache + shards: vLLM-Omni's own figure is 244.5 GiB peak PSS for a 61.7 GiB artifact at
DP 2), and AllGather never asks the runtime at all. So the plugin substitutes
``hwr.dlo_backend`` for exactly the DiT block rings whose source is hwrd, inside a subclass of
vLLM-Omni's backend (``offload.HwrdOffloadBackend``), and leaves every other part in place:

- ``gate``: with hwrd configured, AllGather no longer skips the runtime; restore-contract DiTs
  are resolved exactly as on the rank-local path (lookup, restore, carrier), DiTs loaded by
  direct checkpoint mmap (``_remap_ckpt_key``) take the checkpoint path, anything else is
  refused by name (``required`` fails the start, ``preferred`` warns once).
- ``factory``: the backend vLLM-Omni's ``enable_offload_backend`` creates becomes
  ``HwrdOffloadBackend`` when its plan is hwrd-backed and the DiT gathers over more than one
  rank, or when the plan is a checkpoint plan; ``required`` with no hwrd-backed plan fails.
- ``offload``: the hwrd-backed AllGather rings run on ``hwr.dlo_backend`` (each rank copies only
  its own pieces of each block from the shared mapping into a bounded gather input; DLO's own
  communicator; CUDA: registered own ranges or bounded pinned staging); the lease stays
  vLLM-Omni's to close, after the rings.
- ``checkpoints``: a checkpoint plan's files come from hwrd checkpoint leases, checked against
  the files the worker itself may open.

Cold starts stay vLLM-Omni's canonical path; its post-load publication goes to hwrd (``store``).

Warm starts cost metadata, not bytes: vLLM-Omni's loader checks that the warm finalization left
every restored tensor unchanged by hashing all of them twice; for tensors that are still an hwrd
lease's read-only views the plugin answers from metadata instead (``unchanged``). And the ranks of
a job agree on one lookup outcome before any of them loads (``agree``), so a cold start's ranks
never mix leased and canonically loaded weights.

Modules: ``config`` (where hwrd is), ``compat`` (version/attribute check), ``interception``
(the classmethod wrapper, and the installer of the others), ``store`` (the HostWeightStore over
hwrd), ``writer`` (producer output collected for an hwrd publication), ``gate``, ``factory``,
``offload``, ``checkpoints``, ``borrowed`` (a lease view lent to ``hwr.dlo_backend``),
``unchanged`` (the loader's "unchanged" snapshot for leased tensors), ``agree`` (one outcome
across ranks).
``HWR_VLLM_PLUGIN=0`` disables the plugin. If ``VLLM_PLUGINS`` is set, it must name ``hwr`` for
vLLM-Omni to load this plugin.
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
