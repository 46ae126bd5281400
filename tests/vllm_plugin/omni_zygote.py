"""A fork server for ``omni_harness``'s worker processes: torch, vLLM and vLLM-Omni imported once.

``omni_harness.run`` starts each worker as ``python omni_worker.py SPEC``: a new interpreter that
imports torch, vLLM, vLLM-Omni, diffusers and transformers, which is most of a tiny start's time.
Given a ``Zygote`` (the ``omni_zygote`` fixture), it forks each worker from this process instead
(as vLLM forks its own multiprocessing workers), which has imported those modules and done nothing
else: no tensor op, no plugin loaded, no accelerator fake installed, no distributed state, no hwrd
connection, and one thread (checked before every fork: a fork with other threads alive is refused).
The forked worker then runs ``omni_worker.main`` with the run's environment and its output in its
log: every start it records (plugin loading, checkpoint, loader, DLO, leases) happens after the
fork, in a process with its own pid that never loaded a model. Benchmarks do not use it (their
timings count the interpreter's start).

Protocol, one JSON object a line: stdin ``{"spec": PATH, "log": PATH, "env": {...}}`` answered on
stdout by ``{"pid": N}`` (or ``{"error": TEXT}``); stdout ``{"exited": N, "code": C}`` when a
worker ends. The zygote exits at EOF on stdin.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import sys
import threading
import traceback
from types import ModuleType
from typing import Any, TextIO

# The heavy imports every worker makes before its first start (importing them runs no tensor op).
PRELOAD = ("torch", "vllm", "vllm_omni", "diffusers", "transformers", "vllm.model_executor.model_loader",
           "vllm_omni.diffusion.data", "vllm_omni.diffusion.model_loader.diffusers_loader",
           "vllm_omni.diffusion.offloader", "omni_worker")


def _send(channel: TextIO, message: dict[str, Any]) -> None:
    channel.write(json.dumps(message) + "\n")
    channel.flush()


def _child(request: dict[str, Any], channel: TextIO, omni_worker: ModuleType) -> None:
    """In the forked worker: its log as stdout and stderr, the run's environment, omni_worker's main."""
    code = 1
    try:
        channel.close()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [omni_worker.__file__, request["spec"]]
        code = omni_worker.main()
    except BaseException:  # a worker must never return into the zygote's loop
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> int:
    channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the imports print goes to the zygote's log, never into the protocol
    for name in PRELOAD:
        importlib.import_module(name)
    omni_worker = sys.modules["omni_worker"]
    _send(channel, {"ready": True, "threads": threading.active_count()})
    children: set[int] = set()
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.1)
        if readable:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return 0
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                if threading.active_count() != 1:
                    _send(channel, {"error": f"{threading.active_count()} threads alive: not forking"})
                    continue
                pid = os.fork()
                if pid == 0:
                    _child(request, channel, omni_worker)
                children.add(pid)
                _send(channel, {"pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            _send(channel, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    sys.exit(main())
