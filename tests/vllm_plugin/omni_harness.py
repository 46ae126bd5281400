"""Drive vLLM-Omni's own diffusion loader and DLO the way ``vllm serve --omni`` does, as fresh processes.

``run(...)`` starts one ``omni_worker.py`` process per rank of a ``Topology`` (all ranks at once,
gloo over a free local port), each performing the ``Start`` s given, in order, and returns one
``WorkerResult`` per rank. A *start* is what a diffusion worker does when ``vllm serve`` starts
it: build the config from the flags, load the pipeline with vLLM-Omni's
``DiffusersPipelineLoader`` (its Host Weight Runtime mixin and hwr's plugin deciding warm or
cold), then ``enable_offload_backend`` and forwards through DLO, then teardown. Several starts in
one process share its imports and process group (cheap); a start "in a fresh process" is the
first start of a new ``run``.

Real: vLLM-Omni's loader, restorer, pipeline and model classes, ``enable_offload_backend`` and
its DLO backend, plugin loading through the ``vllm_omni.general_plugins`` entry point,
``torch.distributed`` over gloo, hwrd (the caller's daemon, reached through ``HWR_SOCKET``) and
``hwrctl``. Checkpoints are written at test time by diffusers/transformers in the layout the
loader reads (``omni_pipelines``). Faked: only the accelerator boundary, in the worker, as
``omni_accelerator`` documents (platform device calls, attention backend choice, vLLM's CPU
linear-weight relayout, pinned memory and ``cudaHostRegister``).

Parameters meant for multi-rank use: ``Topology(world_size, data_parallel_size,
sequence_parallel_size, ulysses_degree, ring_degree, use_allgather)``; with data parallelism each
DP rank gets its own input seed (``Start.input_seed + 1000 * rank``), with sequence parallelism
all ranks share the start's seed. ``pipeline`` names an entry of ``omni_pipelines.PIPELINES``.
Limits: ranks run on one host (CPU); a run has one timeout for all its ranks and kills them all
when it passes.

With ``zygote`` (a ``zygote.Zygote`` from ``start_zygote``, the tests' ``omni_zygote`` fixture)
each worker is forked from a process that has imported torch, vLLM and vLLM-Omni and done nothing
else, and runs ``omni_worker.main``, instead of a new interpreter that imports them; everything
the worker does is the same.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from zygote import Forked, Zygote

WORKER = Path(__file__).resolve().parent / "omni_worker.py"
# The heavy imports every worker makes before its first start (importing them runs no tensor op).
PRELOAD = ("torch", "vllm", "vllm_omni", "diffusers", "transformers", "vllm.model_executor.model_loader",
           "vllm_omni.diffusion.data", "vllm_omni.diffusion.model_loader.diffusers_loader",
           "vllm_omni.diffusion.offloader", "omni_worker")

__all__ = ["Start", "StartResult", "Topology", "WorkerResult", "Zygote", "run", "start_zygote"]


def start_zygote(log: Path, timeout: float = 900.0) -> Zygote | None:
    """The tests' zygote (``zygote.Zygote``) with torch, vLLM, vLLM-Omni and ``omni_worker``
    imported, its output in ``log``; None where it cannot serve (``run`` then starts fresh
    interpreters). It starts without ``HWR_SOCKET``/``HWR_VLLM_PLUGIN``: imports see neither."""
    env = {k: v for k, v in os.environ.items() if k not in {"HWR_SOCKET", "HWR_VLLM_PLUGIN"}}
    return Zygote.start(PRELOAD, log, home=WORKER.parent, env=env, timeout=timeout)


@dataclass(frozen=True)
class Topology:
    """The parallel layout of one run (vLLM-Omni's ``DiffusionParallelConfig`` plus DLO AllGather)."""

    world_size: int = 1
    data_parallel_size: int = 1
    sequence_parallel_size: int = 1
    ulysses_degree: int = 1
    ring_degree: int = 1
    use_allgather: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.world_size != self.data_parallel_size * self.sequence_parallel_size:
            raise ValueError(f"world_size {self.world_size} must equal DP {self.data_parallel_size} "
                             f"x SP {self.sequence_parallel_size}")


@dataclass(frozen=True)
class Start:
    """One worker start: runtime ``mode`` (``disabled``/``preferred``/``required``), the hwrd
    socket (None: ``HWR_SOCKET`` unset; a path where no daemon listens: "daemon down"), host
    registration (``omni_accelerator.REGISTRATION_MODES``), DLO forwards after the straight one,
    DLO AllGather for this start only (``allgather``; None: the topology's), and whether to
    record what ``load_model`` hashes (``audit_hashing``: the worker's ``HashAudit``); rank r
    waits ``r * stagger_s`` seconds before its load (a cold start's ranks reaching hwrd apart)."""

    name: str
    mode: str = "preferred"
    socket: str | None = None
    registration: str = "unpinned"
    forwards: int = 2
    straight: bool = True
    input_seed: int = 1
    allgather: bool | None = None
    audit_hashing: bool = False
    stagger_s: float = 0.0


@dataclass
class StartResult:
    """What one start recorded (see ``omni_worker``); ``raw`` holds everything."""

    raw: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.raw["name"])

    @property
    def error(self) -> dict[str, Any] | None:
        return self.raw.get("error")

    @property
    def outcome(self) -> str | None:
        return self.raw.get("outcome")

    @property
    def plan(self) -> str | None:
        return self.raw.get("plan")

    @property
    def logs(self) -> list[str]:
        return list(self.raw.get("logs", []))

    @property
    def straight(self) -> str:
        return str(self.raw["straight"]["sha256"])

    @property
    def offloaded(self) -> list[str]:
        return [o["sha256"] for o in self.raw["offload"]["outputs"]]

    def tensor(self, label: str = "straight") -> torch.Tensor:
        entry = self.raw["straight"] if label == "straight" else self.raw["offload"]["outputs"][int(label)]
        return torch.load(entry["path"])

    def expect_ok(self) -> StartResult:
        assert self.error is None, f"start {self.name!r} failed:\n{self.error['traceback']}\n" + "\n".join(self.logs)
        return self


@dataclass
class WorkerResult:
    rank: int
    pid: int
    plugin: str
    starts: list[StartResult] = field(default_factory=list)
    log: Path | None = None

    def __getitem__(self, name: str) -> StartResult:
        return next(s for s in self.starts if s.name == name)


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _seed(start: Start, rank: int, topology: Topology) -> Start:
    if topology.data_parallel_size > 1:
        dp_rank = rank // topology.sequence_parallel_size
        return Start(**{**asdict(start), "input_seed": start.input_seed + 1000 * dp_rank})
    return start


def run(pipeline: str, *, checkpoint: Path, runtime_root: Path, out: Path, starts: list[Start],
        topology: Topology = Topology(), write_checkpoint: bool = False, timeout: float = 900.0,
        env: dict[str, str] | None = None, zygote: Zygote | None = None) -> list[WorkerResult]:
    """Run ``starts`` in ``topology.world_size`` fresh worker processes; one result per rank.

    Raises ``RuntimeError`` with the worker's log tail when a worker dies, times out or writes no
    result (a start that fails is a result, not an exception).
    """
    port = _free_port()
    procs: list[tuple[int, subprocess.Popen[bytes] | Forked, Path, Path]] = []
    base_env = {k: v for k, v in os.environ.items() if k not in {"HWR_SOCKET", "HWR_VLLM_PLUGIN"}}
    for rank in range(topology.world_size):
        rank_out = out / f"rank{rank}"
        rank_out.mkdir(parents=True, exist_ok=True)
        spec = {"pipeline": pipeline, "checkpoint": str(checkpoint), "runtime_root": str(runtime_root),
                "out": str(rank_out), "rank": rank, "master_port": port, "topology": asdict(topology),
                "write_checkpoint": write_checkpoint and rank == 0, "await_checkpoint": write_checkpoint,
                "starts": [asdict(_seed(s, rank, topology)) for s in starts], "spawned_at": time.time()}
        spec_path = rank_out / "spec.json"
        spec_path.write_text(json.dumps(spec, indent=1))
        log = rank_out / "worker.log"
        worker_env = {**base_env, **(env or {})}
        with open(log, "wb") as sink:
            if zygote is not None:
                proc: subprocess.Popen[bytes] | Forked = zygote.popen(
                    [sys.executable, str(WORKER), str(spec_path)], main="omni_worker:main",
                    stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT, env=worker_env)
            else:
                proc = subprocess.Popen([sys.executable, str(WORKER), str(spec_path)], stdout=sink,
                                        stderr=subprocess.STDOUT, env=worker_env)
        procs.append((rank, proc, rank_out, log))
    deadline = time.monotonic() + timeout
    codes: dict[int, int | None] = {}
    try:
        for rank, proc, _out, log in procs:
            try:
                codes[rank] = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"worker timed out after {timeout:.0f} s:\n{_tail(log)}") from None
    finally:
        for _rank, proc, _out, _log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    results = []
    for rank, proc, rank_out, log in procs:
        path = rank_out / "result.json"
        pid = proc.pid
        if codes[rank] != 0 or not path.exists():
            raise RuntimeError(f"worker rank {rank} exited {codes[rank]} without a result:\n{_tail(log)}")
        data = json.loads(path.read_text())
        if data.get("error"):
            raise RuntimeError(f"worker rank {rank} failed before its starts:\n{data['error']['traceback']}")
        assert int(data["pid"]) == pid, (data["pid"], pid)
        results.append(WorkerResult(rank, int(data["pid"]), str(data.get("plugin")),
                                    [StartResult(s) for s in data["starts"]], log))
    return results


def _tail(log: Path, lines: int = 80) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
