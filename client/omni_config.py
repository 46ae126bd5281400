"""What an operator's vLLM-Omni config may say to the ``vllm-omni`` producer (pure, an allow-list).

The producer runs vLLM-Omni's loader with hwrd's rights (root, or the unit's user), so the
config it is given must not choose what it opens or runs. Policy:

- the producer loads the registered checkpoint's files and nothing else: ``model`` is always the
  registered path (the producer sets it, ``hwr.dlo_backend.vllm_plugin.prewarm.engine_fields``),
  so the key ``model`` is refused, as is every key that names a path, a repository, a revision,
  a tokenizer, a download directory, an import path or extra loader arguments: they are simply
  not on the allow-list below;
- a model's own code never runs: ``trust_remote_code`` is refused unless ``false`` (and the
  producer forces it off whatever the job says);
- what remains selects the pipeline and the artifact's layout, each value checked by type and
  shape (names are identifiers, never paths).

Allowed keys: ``model_class_name`` (a pipeline class name), ``task_type``, ``dtype``,
``model_loaded`` (component name -> bool), ``quantization`` (a method name),
``parallel_config`` (``data_parallel_size`` and the sizes the producer builds at 1: TP, SP,
Ulysses, ring, CFG, pipeline), ``trust_remote_code`` (``false`` only). Anything else is
``INVALID_ARGUMENT`` naming the key (``details.key``), before any producer process starts.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from hwr.client.errors import InvalidRequest

__all__ = ["ALLOWED_KEYS", "PARALLEL_ONE", "check_omni_config"]

#: Parallel sizes the identity records and the producer builds at 1 only.
PARALLEL_ONE = ("tensor_parallel_size", "sequence_parallel_size", "ulysses_degree", "ring_degree",
                "cfg_parallel_size", "pipeline_parallel_size")
_PARALLEL_KEYS = frozenset((*PARALLEL_ONE, "data_parallel_size"))
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_TASK = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_METHOD = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
_DTYPES = frozenset({"auto", "bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32", "float"})
#: Keys refused with a reason of their own (everything off the allow-list is refused too).
_WHY = {
    "model": "the vllm-omni producer loads the registered checkpoint only (model is always its path)",
    "host_weight_runtime_mode": "host_weight_runtime_mode is the producer's own (it publishes into this daemon)",
    "host_weight_runtime_root": "host_weight_runtime_root is the producer's own (it publishes into this daemon)",
}


def _identifier(value: object) -> bool:
    return isinstance(value, str) and _IDENTIFIER.fullmatch(value) is not None


def _task(value: object) -> bool:
    return isinstance(value, str) and _TASK.fullmatch(value) is not None


def _method(value: object) -> bool:
    return isinstance(value, str) and _METHOD.fullmatch(value) is not None


def _dtype(value: object) -> bool:
    return isinstance(value, str) and value in _DTYPES


def _components(value: object) -> bool:
    return isinstance(value, Mapping) and len(value) <= 64 and all(
        _identifier(k) and isinstance(v, bool) for k, v in value.items())


def _false(value: object) -> bool:
    return value is False


_CHECKS: dict[str, tuple[Callable[[object], bool], str]] = {
    "model_class_name": (_identifier, "a pipeline class name (an identifier)"),
    "task_type": (_task, "1-64 characters of [A-Za-z0-9_.-]"),
    "dtype": (_dtype, "one of " + ", ".join(sorted(_DTYPES))),
    "model_loaded": (_components, "an object of component names to true/false"),
    "quantization": (_method, "a quantization method name"),
    "trust_remote_code": (_false, "false: the producer runs with hwrd's rights and never runs a model's own code"),
}
ALLOWED_KEYS = frozenset((*_CHECKS, "parallel_config"))


def _refuse(key: str, message: str) -> InvalidRequest:
    return InvalidRequest(message, details={"field": "producer_config", "key": key[:80]})


def _check_parallel(parallel: object) -> None:
    if parallel is None:
        return
    if not isinstance(parallel, Mapping):
        raise _refuse("parallel_config", "parallel_config must be an object")
    for name, value in parallel.items():
        if name not in _PARALLEL_KEYS:
            raise _refuse(f"parallel_config.{name}", f"parallel_config.{str(name)[:80]!r} is not an option of the "
                          f"vllm-omni producer (it accepts {', '.join(sorted(_PARALLEL_KEYS))})")
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise _refuse(f"parallel_config.{name}", f"parallel_config.{name} must be a positive integer")
        if name in PARALLEL_ONE and value != 1:
            # The registered layout is one rank's: the identity records these sizes and the loader
            # would need those ranks.
            raise InvalidRequest(f"the vllm-omni producer builds {name} = 1 artifacts only",
                                 details={"field": "producer_config", "key": f"parallel_config.{name}",
                                          "name": name})


def check_omni_config(config: object) -> dict[str, Any]:
    """``config`` when every key is on the allow-list with a valid value (module docstring), else
    ``InvalidRequest`` naming the first offending key. Pure; the producer calls it again."""
    if not isinstance(config, Mapping) or not all(isinstance(k, str) for k in config):
        raise InvalidRequest("producer_config must be a JSON object", details={"field": "producer_config"})
    for key in sorted(config):
        value = config[key]
        if key in _WHY:
            raise _refuse(key, _WHY[key])
        if key == "parallel_config":
            _check_parallel(value)
            continue
        check = _CHECKS.get(key)
        if check is None:
            raise _refuse(key, f"{key[:80]!r} is not an option of the vllm-omni producer: it accepts "
                          f"{', '.join(sorted(ALLOWED_KEYS))} (the producer runs with hwrd's rights and "
                          "loads the registered checkpoint only)")
        valid, what = check
        if not valid(value):
            raise _refuse(key, f"{key} must be {what}")
    return dict(config)
