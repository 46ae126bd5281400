"""A fork server for the tests' worker processes: heavy modules imported once, each worker forked.

A test that starts workers as fresh interpreters (``python worker.py ARGS``, a ``spawn``ed rank)
pays, per worker, the interpreter's start and ``import torch`` (1-2 s of CPU each), which is
often most of the test. A ``Zygote`` is one server process that has imported such modules and
done nothing else (no tensor op, no thread, no distributed state, no connection); each worker is
forked from it and then runs what the fresh interpreter would run: everything a test observes
happens after the fork, in a real separate process with its own pid, its own gloo groups and its
own hwrd session.

What a worker runs: a command line (``[python, script.py, ARGS...]``: the script as ``__main__``
with that ``sys.argv`` and its directory as ``sys.path[0]``; ``[python, "-m", module, ARGS...]``)
or (``call``) a module-level function with pickled arguments, as a ``spawn``ed
``multiprocessing.Process`` runs its target; both end as an interpreter ends (non-daemon threads
joined, ``atexit`` run, streams flushed; an uncaught exception is printed and exits 1), less the
teardown of the inherited modules (``_exit``). Or (``main``) a preloaded ``module:function``
called with ``sys.argv = ARGS``, whose return value is the exit status and after which the worker
ends at once (``_main``). A worker gets the caller's environment, working directory and standard
streams (``Zygote.popen`` takes ``subprocess.Popen``'s stream arguments and returns a
``Forked``, which answers ``Popen``'s calls). Run as a script, this module is the server
(``main``).

Forking is safe only while the forking process has a single thread: a thread that holds a lock
at the fork (torch's intra-op pool, a gloo group, gRPC's threads) leaves it held for good in the
child. The server counts the threads the kernel lists for it (``/proc/self/task``: native ones
too) after its imports and before every fork, and refuses to fork when there are others;
``Zygote.start`` then returns None and callers start fresh interpreters, as before. numpy's
OpenBLAS (which torch loads) starts a thread pool when it is loaded unless
``OPENBLAS_NUM_THREADS`` is 1, so the server imports with it set to 1: workers compute with
torch's own BLAS and OpenMP, which start their threads at a worker's first op.

Limits: what a preloaded library read from the environment while it was loaded (libgomp's
``OMP_*``, OpenBLAS's thread count) is what the server's environment said (the test process's,
at the server's start); of glibc's ``MALLOC_*`` settings, read only when a process starts, the
ones ``mallopt`` can set are applied in the worker from its environment; a worker's parent is
the server, not the test process, and its hash seed is the server's.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import ctypes
import gc
import importlib
import io
import json
import os
import pickle
import queue
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, NoReturn

__all__ = ["TORCH_PRELOAD", "Forked", "Zygote", "popen", "shared", "start_call", "threads_of"]

SERVER = Path(__file__).resolve()
# One request or answer is one packet (SOCK_SEQPACKET keeps them whole, with the fds they carry).
PACKET = 1 << 20
# What the torch workers of the e2e and DLO tests import before their first line of work.
TORCH_PRELOAD = ("torch", "torch.distributed", "safetensors.torch", "hwr.client", "hwr.dlo_backend",
                 "hwr.demo_model")
# glibc's mallopt parameters for the MALLOC_*_ variables it otherwise reads only at a process's start.
MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_TOP_PAD_": -2, "MALLOC_MMAP_THRESHOLD_": -3,
           "MALLOC_MMAP_MAX_": -4, "MALLOC_ARENA_TEST": -7, "MALLOC_ARENA_MAX": -8}


def threads_of(pid: int | str = "self") -> int:
    """How many threads the kernel lists for process ``pid`` (native threads included)."""
    return len(os.listdir(f"/proc/{pid}/task"))


# ------------------------------------------------------------------------------------ server side
def _send(control: socket.socket, message: dict[str, Any]) -> None:
    control.send(json.dumps(message).encode())


def _tell(control: socket.socket, message: dict[str, Any]) -> None:
    """The server's answer; a client that is gone is noticed at the next read (EOF)."""
    with contextlib.suppress(OSError):
        _send(control, message)


def _reap(control: socket.socket, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _tell(control, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def serve(control: socket.socket) -> dict[str, Any] | None:
    """Fork one worker per request on ``control`` until it closes.

    In the server this returns None (at EOF, after killing the workers still running). In a
    forked worker it returns that worker's request, with the standard streams, environment,
    working directory and signal handlers already the worker's: the caller then runs it (``run``).
    """
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    # A child's exit wakes the loop through the wakeup fd; ^C in the test's terminal is the test's.
    handlers = {signal.SIGCHLD: signal.signal(signal.SIGCHLD, lambda *_: None),
                signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN)}
    signal.set_wakeup_fd(wake_w)
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([control, wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 1 << 16)
            _reap(control, children)
        if control not in readable:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(control, PACKET, 3)
        except OSError:  # the client is gone (a reset reads as EOF)
            data, fds = b"", []
        if not data:
            for pid in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for pid in children:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
            return None
        request = json.loads(data)
        if "signal" in request:  # only to a child not yet reaped: its pid cannot have been reused
            if request["pid"] in children:
                os.kill(request["pid"], request["signal"])
            continue
        if threads_of() != 1:
            for fd in fds:
                os.close(fd)
            _tell(control, {"error": f"{threads_of()} threads alive: not forking"})
            continue
        sys.stdout.flush()  # nothing buffered here may be written twice
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
            for fd in (wake_r, wake_w, control.detach()):
                os.close(fd)
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            for fd in fds:
                if fd > 2:
                    os.close(fd)
            gc.enable()
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            for name, param in MALLOPT.items():
                if name in os.environ:
                    ctypes.CDLL(None).mallopt(param, int(os.environ[name]))
            return request
        for fd in fds:
            os.close(fd)
        children.add(pid)
        _tell(control, {"pid": pid})


def run(request: Mapping[str, Any]) -> int:
    """In a forked worker: what ``python ARGV...`` runs (or ``call``'s function)."""
    argv = list(request["argv"][1:])
    if request.get("call"):
        return _call(request["sys_path"], request["call"])
    if argv[0] == "-m":
        sys.argv = argv[1:]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return 0
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")
    return 0


def _call(sys_path: list[str], payload: str) -> int:
    """``function(*args)`` from ``payload`` with the caller's ``sys.path``, as ``spawn`` runs a target."""
    sys.path[:] = sys_path  # before unpickling: the function's module is found on the caller's path
    function, args = pickle.loads(base64.b64decode(payload))
    function(*args)
    return 0


def main() -> int:
    """The server: ``python zygote.py CONTROL_FD HOME PRELOAD_JSON``; ``python zygote.py --call
    SYS_PATH_JSON PAYLOAD``: the fresh-interpreter form of a ``call`` (``start_call``)."""
    if sys.argv[1] == "--call":
        return _call(json.loads(sys.argv[2]), sys.argv[3])
    control = socket.socket(fileno=int(sys.argv[1]))
    server_env = dict(os.environ)
    os.environ["OPENBLAS_NUM_THREADS"] = "1"  # see the module's docstring
    if sys.argv[2]:
        sys.path[0] = sys.argv[2]  # where the workers' modules are, as if this script lived there
    # What the imports allocate stays in place and out of the collector's sight (gc.freeze), so a
    # worker's collections and its exit do not write to, and so copy, every inherited page.
    gc.disable()
    for name in json.loads(sys.argv[3]):
        importlib.import_module(name)
    gc.freeze()
    os.environ.clear()
    os.environ.update(server_env)
    _send(control, {"ready": True, "threads": threads_of()})
    request = serve(control)
    if request is None:
        return 0
    if request.get("main"):
        _main(request)
    _exit(request)


def _main(request: Mapping[str, Any]) -> NoReturn:
    """In a forked worker: ``module:function`` with ``sys.argv = ARGV``; its return value is the
    exit status (1 if it raises, the traceback printed) and the worker ends right after it: streams
    flushed, no ``atexit`` handler run, no thread waited for."""
    code = 1
    try:
        module, _, function = request["main"].partition(":")
        sys.argv = list(request["argv"][1:])
        code = int(getattr(importlib.import_module(module), function)() or 0)
    except BaseException:  # a worker must never return into the server's loop
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _exit(request: Mapping[str, Any]) -> NoReturn:
    """In a forked worker: run it, then end as an interpreter ends (an uncaught exception printed,
    exit status 1; ``SystemExit``'s code; non-daemon threads joined, ``atexit`` handlers run,
    streams flushed) but without tearing down the modules it inherited: that would write to, and
    so copy, most of the pages it shares with the zygote (about a second of CPU per worker).
    Objects still alive then are not finalized: a file the worker left open unflushed loses the
    unflushed part."""
    try:
        code = run(request)
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx does first
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


# ------------------------------------------------------------------------------------ client side
class Forked:
    """A worker forked by a ``Zygote``; answers ``subprocess.Popen``'s calls (``pid``, the pipes,
    ``poll``, ``wait``, ``send_signal``, ``kill``, ``terminate``, ``returncode``)."""

    def __init__(self, zygote: Zygote, pid: int, args: Sequence[str],
                 streams: tuple[IO[Any] | None, IO[Any] | None, IO[Any] | None]) -> None:
        self.zygote, self.pid, self.args = zygote, pid, list(args)
        self.stdin, self.stdout, self.stderr = streams
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            self.zygote.signal(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def __repr__(self) -> str:
        return f"<Forked pid={self.pid} returncode={self.returncode} args={self.args[1:3]}>"


class Zygote:
    """The client of one server process (``main``): forks workers, learns their exits.

    ``start`` returns None when the server cannot serve (it did not start, or other threads were
    alive after its imports); ``popen`` raises ``RuntimeError`` when it refuses a fork. Thread-safe.
    """

    def __init__(self, proc: subprocess.Popen[bytes], control: socket.socket, log: Path) -> None:
        self.proc, self.control, self.log = proc, control, log
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._exits: dict[int, int] = {}
        self._changed = threading.Condition()
        self._closed = False
        self._lost = False
        self._fork_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)

    @classmethod
    def start(cls, preload: Sequence[str], log: Path, *, home: Path | None = None,
              env: Mapping[str, str] | None = None, timeout: float = 300.0) -> Zygote | None:
        """A server with ``preload`` imported (``home`` as its ``sys.path[0]``), its output in ``log``."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with ours, open(log, "wb") as sink:
            proc = subprocess.Popen(
                [sys.executable, str(SERVER), str(theirs.fileno()), str(home or ""), json.dumps(list(preload))],
                stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT, pass_fds=(theirs.fileno(),),
                env=dict(os.environ if env is None else env))
            theirs.close()
            zygote = cls(proc, ours.dup(), log)
        ready = zygote._ready(timeout)
        if ready is None or ready.get("threads") != 1:
            zygote.close()
            return None
        zygote._reader.start()
        return zygote

    def _ready(self, timeout: float) -> dict[str, Any] | None:
        if not select.select([self.control], [], [], timeout)[0]:
            return None
        data = self.control.recv(PACKET)
        return json.loads(data) if data else None

    def _read(self) -> None:
        while True:
            try:
                data = self.control.recv(PACKET)
            except OSError:
                data = b""
            if not data:
                with self._changed:
                    self._closed = True
                    self._changed.notify_all()
                self._answers.put(None)
                return
            message = json.loads(data)
            if "exited" in message:
                with self._changed:
                    self._exits[int(message["exited"])] = int(message["code"])
                    self._changed.notify_all()
            else:
                self._answers.put(message)

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        """Worker ``pid``'s exit code (negative: the signal), or None if it runs on after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while pid not in self._exits:
                remaining = None if deadline is None else deadline - time.monotonic()
                if self._closed:
                    raise RuntimeError(f"the zygote is gone; worker {pid}'s exit is unknown\n{self.tail()}")
                if remaining is not None and remaining <= 0:
                    return None
                self._changed.wait(remaining)
            return self._exits[pid]

    def signal(self, pid: int, signum: int) -> None:
        _send(self.control, {"signal": int(signum), "pid": pid})

    def popen(self, args: Sequence[str], *, stdin: Any = None, stdout: Any = None, stderr: Any = None,
              env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
              text: bool = False, bufsize: int = -1, main: str | None = None,
              call: tuple[Callable[..., Any], Sequence[Any]] | None = None) -> Forked:
        """Fork a worker that runs ``args`` as ``subprocess.Popen(args, ...)`` would run it (streams:
        None, ``PIPE``, ``DEVNULL``, ``STDOUT`` for stderr, a file or a descriptor); ``main``
        ("module:function") calls that function with ``sys.argv = args[1:]`` instead, and ``call``
        (a module-level function and its picklable arguments) calls it as a ``spawn``ed
        ``multiprocessing.Process`` calls its target (``args`` then only names the worker)."""
        if call is not None:
            args = [sys.executable, f"{call[0].__module__}.{call[0].__qualname__}"]
        elif len(args) < 2 or (args[1] == "-m" and len(args) < 3) or (args[1].startswith("-") and args[1] != "-m"):
            raise ValueError(f"a zygote runs 'python SCRIPT ...' or 'python -m MODULE ...', not {list(args)}")
        ends: list[int] = []  # our ends of the pipes
        close_after: list[int] = []  # the worker's ends, ours to close once sent
        child_fds: list[int] = []
        with open(os.devnull, "rb+") as null:
            for index, spec in enumerate((stdin, stdout, stderr)):
                if spec is None:
                    child_fds.append(index)
                elif spec == subprocess.PIPE:
                    read, write = os.pipe()
                    ours, theirs = (write, read) if index == 0 else (read, write)
                    ends.append(ours)
                    close_after.append(theirs)
                    child_fds.append(theirs)
                elif spec == subprocess.DEVNULL:
                    child_fds.append(null.fileno())
                elif spec == subprocess.STDOUT and index == 2:
                    child_fds.append(child_fds[1])
                else:
                    child_fds.append(spec if isinstance(spec, int) else spec.fileno())
            request = {"argv": [str(a) for a in args], "main": main, "cwd": str(cwd or os.getcwd()),
                       "env": dict(os.environ if env is None else env),
                       "call": None if call is None else _payload(*call), "sys_path": sys.path}
            try:
                with self._fork_lock:
                    if self._lost:
                        raise RuntimeError("an earlier fork went unanswered: this zygote forks no more")
                    socket.send_fds(self.control, [json.dumps(request).encode()], child_fds)
                    try:
                        answer = self._answers.get(timeout=60)
                    except queue.Empty:
                        self._lost = True  # a late answer would be taken for the next fork's
                        raise RuntimeError(f"the zygote did not answer a fork in 60 s\n{self.tail()}") from None
            except BaseException:
                for fd in ends:
                    os.close(fd)
                raise
            finally:
                for fd in close_after:
                    os.close(fd)
        if answer is None or "pid" not in answer:
            for fd in ends:
                os.close(fd)
            raise RuntimeError(f"the zygote did not fork a worker: {answer}\n{self.tail()}")
        streams: list[IO[Any] | None] = []
        pipes = iter(ends)
        for index, spec in enumerate((stdin, stdout, stderr)):
            streams.append(_wrap(next(pipes), index == 0, text, bufsize) if spec == subprocess.PIPE else None)
        return Forked(self, int(answer["pid"]), args, (streams[0], streams[1], streams[2]))

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def close(self) -> None:
        """End the server (it kills the workers still running); idempotent."""
        with contextlib.suppress(OSError):
            self.control.shutdown(socket.SHUT_RDWR)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.control.close()


def _payload(function: Callable[..., Any], args: Sequence[Any]) -> str:
    return base64.b64encode(pickle.dumps((function, tuple(args)))).decode()


def _wrap(fd: int, writing: bool, text: bool, bufsize: int) -> IO[Any]:
    """Our end of a pipe as ``subprocess.Popen`` wraps it."""
    raw = open(fd, "wb" if writing else "rb", -1 if bufsize == 1 else bufsize)  # noqa: SIM115 (the caller owns it)
    if not text:
        return raw
    return io.TextIOWrapper(raw, write_through=writing, line_buffering=bufsize == 1)


_shared: dict[str, Zygote | None] = {}
_shared_lock = threading.Lock()


def shared() -> Zygote | None:
    """This process's zygote with ``TORCH_PRELOAD``, started by the first call and ended (its log
    removed) when this process exits; None where it cannot serve, then and on every later call
    (callers start fresh interpreters)."""
    with _shared_lock:
        if "zygote" not in _shared:
            log = Path(tempfile.gettempdir()) / f"hwr-zygote-{os.getpid()}.log"
            zygote = _shared["zygote"] = Zygote.start(TORCH_PRELOAD, log)
            if zygote is not None:
                atexit.register(zygote.close)
            atexit.register(log.unlink, missing_ok=True)
        return _shared["zygote"]


def popen(args: Sequence[str], **kwargs: Any) -> Forked | subprocess.Popen[Any]:
    """``args`` run by a worker forked from ``shared()`` (``Zygote.popen``), or by
    ``subprocess.Popen(args, **kwargs)`` where the zygote cannot serve."""
    zygote = shared()
    if zygote is not None:
        try:
            return zygote.popen(args, **kwargs)
        except (RuntimeError, OSError) as exc:
            warnings.warn(f"zygote: starting a fresh interpreter instead: {exc}", stacklevel=2)
    return subprocess.Popen(args, **kwargs)


def start_call(function: Callable[..., Any], *args: Any) -> Forked | subprocess.Popen[Any]:
    """``function(*args)`` (module-level, picklable arguments) in a worker forked from ``shared()``,
    or in a fresh interpreter where it cannot serve: either way as a ``spawn``ed
    ``multiprocessing.Process`` runs its target (the caller's ``sys.path``, stdin from
    ``/dev/null``, stdout and stderr the caller's, exit code 1 on an uncaught exception)."""
    zygote = shared()
    if zygote is not None:
        try:
            return zygote.popen([], stdin=subprocess.DEVNULL, call=(function, args))
        except (RuntimeError, OSError) as exc:
            warnings.warn(f"zygote: starting a fresh interpreter instead: {exc}", stacklevel=2)
    return subprocess.Popen([sys.executable, str(SERVER), "--call", json.dumps(sys.path), _payload(function, args)],
                            stdin=subprocess.DEVNULL)


if __name__ == "__main__":
    sys.exit(main())
