"""Run a module as ``__main__`` while the interpreter records what the process loads.

``python import_recorder.py RECORD MODULE ARGS...`` installs an audit hook (``sys.addaudithook``:
it cannot be removed, and the import system raises its ``import`` event for every module it
loads, by an ``import`` statement, ``importlib`` or ``__import__`` alike), then runs ``MODULE``
the way ``python -m MODULE ARGS...`` would. Each record line is ``PID EVENT NAME``:

- ``preloaded NAME``: a module already loaded when the hook went in (the interpreter's start-up);
- ``import NAME``: a module the import system loads from then on;
- ``dlopen NAME``: a shared library that ``ctypes`` loads.

Deleting a module from ``sys.modules`` afterwards does not erase its line, so the record says
what the process ever loaded, not what it still lists. A forked child keeps the hook and writes
its own pid; a child that executes a new program does not inherit it (the record's descriptor is
close-on-exec). Limit: a library mapped by other means than an import or ``ctypes`` (an extension
module's own ``dlopen``) is not recorded here: read ``/proc/PID/maps`` for that.
"""

from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    record, module, *args = sys.argv[1:]
    fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)

    def write(event: str, name: object) -> None:
        # One write per line on an O_APPEND descriptor: lines of several threads never interleave.
        os.write(fd, f"{os.getpid()} {event} {name}\n".encode("utf-8", "backslashreplace"))

    for name in list(sys.modules):
        write("preloaded", name)

    def hook(event: str, hook_args: tuple[object, ...]) -> None:
        if event == "import":
            write("import", hook_args[0])
        elif event == "ctypes.dlopen":
            write("dlopen", hook_args[0])

    sys.addaudithook(hook)
    sys.argv = [module, *args]
    sys.path[0] = os.getcwd()  # as ``python -m`` has it (this script's folder stays out of the path)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
