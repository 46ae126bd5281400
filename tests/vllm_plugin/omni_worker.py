"""One vLLM-Omni diffusion worker, run as a fresh process by ``omni_harness`` (``python omni_worker.py SPEC``,
or ``main`` in a process forked from the tests' zygote, which has only imported the modules).

What it does is what a ``vllm serve MODEL --omni`` diffusion worker does below the engine, with
vLLM-Omni's own code at every step, for each *start* of its spec in turn:

1. once per process: write the pipeline's tiny checkpoint when asked (rank 0; the other ranks
   wait for it), install the accelerator boundary (``omni_accelerator``), load vLLM-Omni's
   general plugins (``vllm_omni.plugins.load_omni_general_plugins``: hwr's entry point among
   them), then ``init_distributed_environment`` + ``initialize_model_parallel`` over gloo as
   ``DiffusionWorker.init_device`` does (``create_diffusion_vllm_config``, forward context);
2. per start: ``HWR_SOCKET`` as the start says (unset, or a path; a dead path is "daemon down"),
   an ``OmniDiffusionConfig`` built with ``from_kwargs`` + ``enrich_config`` (as the engine
   builds it from ``vllm serve`` flags: DLO on, AllGather on or off, the runtime mode and root),
   ``DiffusersPipelineLoader.load_model(load_device="cpu")`` (the call ``DiffusionModelRunner``
   makes for DLO), one forward of the DiT straight from the loader, then
   ``enable_offload_backend`` (the runner's next call), ``forwards`` forwards through DLO, and
   the offload backend's ``shutdown()`` (what ``DiffusionWorker.shutdown`` calls).

It records, per start, as JSON in ``<out>/result.json``: the Host Weight Runtime outcome the
loader reached and the plan it handed to DLO; where the DiT's tensors live (the file mappings of
``/proc/self/maps`` that back them: a warm start's are hwrd's read-only artifact files); what
``hwrctl leases --json`` (a real ``hwrctl`` process) lists during the start and after teardown
(and, for a direct checkpoint mmap plan, whose leases DLO takes, while DLO runs);
the SHA-256 of every output's bytes (outputs saved under ``<out>``); host registration; the
vLLM-Omni and hwr log records about the runtime and DLO; or the error a start failed with.
"""

from __future__ import annotations

import contextlib
import cProfile
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import omni_accelerator  # noqa: E402
from omni_pipelines import PIPELINES, PipelineSpec  # noqa: E402

WRITTEN, COMPLETED = ".harness-written", ".harness-completed"  # checkpoint phases done (markers)
CHECKPOINT_WAIT_S = 900.0
LOGGERS = ("vllm_omni.diffusion.model_loader", "vllm_omni.diffusion.offloader", "vllm_omni.host_weight_runtime",
           "hwr")


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.levelname} {record.name}: {record.getMessage()}")


@contextlib.contextmanager
def capture_logs() -> Iterator[list[str]]:
    handler = _Capture()
    loggers = [logging.getLogger(name) for name in LOGGERS]
    for logger in loggers:
        logger.addHandler(handler)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
    try:
        yield handler.messages
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def digest(tensor: torch.Tensor) -> str:
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def file_mappings() -> list[tuple[int, int, str, str]]:
    """(start, end, permissions, path) of this process's file-backed mappings."""
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith("/"):
                start, end = (int(x, 16) for x in parts[0].split("-"))
                out.append((start, end, parts[1], parts[5].strip()))
    return out


def tensor_homes(module: torch.nn.Module, prefix: str) -> dict[str, Any]:
    """Where a module's parameters and persistent buffers live: file mapping or anonymous memory."""
    mappings = file_mappings()
    homes: dict[str, int] = {}
    elsewhere: list[str] = []
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if tensor.numel() == 0 or tensor.device.type != "cpu":
            continue
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        home = next((f"{perm} {path}" for lo, hi, perm, path in mappings if lo <= start and end <= hi), None)
        if home is None:
            elsewhere.append(f"{prefix}.{name}")
        else:
            homes[home] = homes.get(home, 0) + 1
    return {"file_mappings": homes, "not_file_backed": elsewhere}


class HashAudit:
    """Every buffer given to ``hashlib.sha256`` (constructor or ``update``) while active: its
    address and length, so a start can tell which hashed bytes were the DiT's restored tensors.
    Replaces the ``hashlib.sha256`` attribute (vLLM-Omni's loader calls ``hashlib.sha256(...)``
    at call time); code that bound ``sha256`` by name at import is not seen."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, int]] = []
        self.total = 0

    def note(self, data: Any) -> None:
        try:
            nbytes = memoryview(data).nbytes
        except TypeError:
            return
        self.total += nbytes
        if nbytes:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # read-only buffers: torch only warns
                self.spans.append((torch.frombuffer(data, dtype=torch.uint8).data_ptr(), nbytes))

    @contextlib.contextmanager
    def active(self) -> Iterator[HashAudit]:
        real, audit = hashlib.sha256, self

        class Audited:
            def __init__(self, hasher: Any) -> None:
                self._hasher = hasher

            def update(self, data: Any) -> None:
                audit.note(data)
                self._hasher.update(data)

            def copy(self) -> Audited:
                return Audited(self._hasher.copy())

            def __getattr__(self, name: str) -> Any:
                return getattr(self._hasher, name)

        def sha256(*args: Any, **kwargs: Any) -> Audited:
            for data in (*args[:1], *([kwargs["data"]] if "data" in kwargs else [])):
                audit.note(data)
            return Audited(real(*args, **kwargs))

        hashlib.sha256 = sha256  # type: ignore[assignment]
        try:
            yield self
        finally:
            hashlib.sha256 = real

    def overlap(self, ranges: list[tuple[int, int]]) -> int:
        """Bytes hashed that lie inside ``ranges`` ((address, nbytes) pairs)."""
        total = 0
        for start, length in self.spans:
            for lo, size in ranges:
                total += max(0, min(start + length, lo + size) - max(start, lo))
        return total


def hwrctl_leases(socket: str | None) -> list[dict[str, Any]] | None:
    if not socket or not os.path.exists(socket):
        return None
    done = subprocess.run([sys.executable, "-m", "hwr.daemon.ctl.cli", "--socket", socket, "leases", "--json"],
                          capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        return [{"error": done.stderr.strip()}]
    return json.loads(done.stdout)


def error_record(exc: BaseException) -> dict[str, Any]:
    chain, cursor = [], exc
    while cursor is not None:
        chain.append(f"{type(cursor).__name__}: {cursor}")
        cursor = cursor.__cause__ or cursor.__context__
    return {"type": type(exc).__name__, "message": str(exc), "chain": chain, "traceback": traceback.format_exc()}


class Worker:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.pipeline: PipelineSpec = PIPELINES[spec["pipeline"]]
        self.out = Path(spec["out"])
        self.device = torch.device("cpu")
        self.rank = int(spec["rank"])

    # once per process ---------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        checkpoint = Path(self.spec["checkpoint"])
        seed = int(self.spec.get("checkpoint_seed", 0))
        self._checkpoint_phase(checkpoint / WRITTEN, lambda: self.pipeline.write_checkpoint(checkpoint, seed))
        topology = self.spec["topology"]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.spec["master_port"]),
                          RANK=str(self.rank), LOCAL_RANK=str(self.rank), WORLD_SIZE=str(topology["world_size"]))
        omni_accelerator.install()
        from vllm_omni.plugins import load_omni_general_plugins

        load_omni_general_plugins()
        import hwr.dlo_backend.vllm_plugin as plugin

        od_config = self.od_config(self.spec["starts"][0])
        self._init_distributed(od_config)
        complete = self.pipeline.complete_checkpoint
        if complete is not None:
            self._checkpoint_phase(checkpoint / COMPLETED, lambda: complete(checkpoint, seed, od_config))
        return {"plugin": plugin.state()}

    def _checkpoint_phase(self, marker: Path, write: Callable[[], None]) -> None:
        """Rank 0 of a run that writes the checkpoint writes this phase once (``marker`` records
        it); the other ranks of that run wait for the marker, so no rank reads a half-written
        checkpoint."""
        if self.spec.get("write_checkpoint"):
            if not marker.exists():
                marker.parent.mkdir(parents=True, exist_ok=True)
                write()
                marker.touch()
        elif self.spec.get("await_checkpoint"):
            deadline = time.monotonic() + CHECKPOINT_WAIT_S
            while not marker.exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rank 0 did not write {marker} within {CHECKPOINT_WAIT_S:.0f} s")
                time.sleep(0.2)

    def od_config(self, start: dict[str, Any]) -> Any:
        from vllm_omni.diffusion.data import DiffusionParallelConfig, OmniDiffusionConfig

        topology = self.spec["topology"]
        allgather = topology["use_allgather"] if start.get("allgather") is None else start["allgather"]
        parallel = DiffusionParallelConfig(
            data_parallel_size=topology["data_parallel_size"],
            sequence_parallel_size=topology["sequence_parallel_size"],
            ulysses_degree=topology["ulysses_degree"], ring_degree=topology["ring_degree"])
        kwargs: dict[str, Any] = {
            "model": str(Path(self.spec["checkpoint"]) / self.pipeline.model_subpath),
            "model_class_name": self.pipeline.model_class_name,
            "num_gpus": topology["world_size"], "parallel_config": parallel, "enforce_eager": True,
            "enable_distributed_layerwise_offload": True, "dlo_use_allgather": allgather,
            "pin_cpu_memory": start["registration"] != "unpinned",
            "host_weight_runtime_mode": start["mode"], "host_weight_runtime_root": self.spec["runtime_root"],
            "master_port": self.spec["master_port"], **dict(self.pipeline.extra_config),
        }
        config = OmniDiffusionConfig.from_kwargs(**kwargs)
        config.enrich_config()
        return config

    def _init_distributed(self, od_config: Any) -> None:
        from vllm.config import set_current_vllm_config
        from vllm_omni.diffusion.distributed.parallel_state import (
            init_distributed_environment,
            initialize_model_parallel,
        )
        from vllm_omni.diffusion.forward_context import set_forward_context
        from vllm_omni.diffusion.vllm_config import create_diffusion_vllm_config

        vllm_config = create_diffusion_vllm_config(self.device, od_config)
        with set_forward_context(vllm_config=vllm_config, omni_diffusion_config=od_config), \
                set_current_vllm_config(vllm_config):
            init_distributed_environment(world_size=self.spec["topology"]["world_size"], rank=self.rank)
            parallel = od_config.parallel_config
            initialize_model_parallel(
                data_parallel_size=parallel.data_parallel_size, cfg_parallel_size=parallel.cfg_parallel_size,
                sequence_parallel_size=parallel.sequence_parallel_size, ulysses_degree=parallel.ulysses_degree,
                ring_degree=parallel.ring_degree, allgather_degree=parallel.allgather_degree,
                tensor_parallel_size=parallel.tensor_parallel_size,
                pipeline_parallel_size=parallel.pipeline_parallel_size)

    # per start ----------------------------------------------------------------------------
    def run_start(self, index: int, start: dict[str, Any]) -> dict[str, Any]:
        from vllm.config import set_current_vllm_config
        from vllm_omni.diffusion.forward_context import set_forward_context
        from vllm_omni.diffusion.vllm_config import create_diffusion_vllm_config

        if start["socket"] is None:
            os.environ.pop("HWR_SOCKET", None)
        else:
            os.environ["HWR_SOCKET"] = start["socket"]
        record: dict[str, Any] = {"name": start["name"], "error": None}
        od_config = self.od_config(start)
        vllm_config = create_diffusion_vllm_config(self.device, od_config)
        with set_forward_context(vllm_config=vllm_config, omni_diffusion_config=od_config), \
                set_current_vllm_config(vllm_config), capture_logs() as logs, \
                omni_accelerator.registration(start["registration"]) as registration:
            try:
                self._start(index, start, od_config, record)
            except Exception as exc:
                record["error"] = error_record(exc)
            record["registration"] = registration.to_json()
        record["logs"] = logs
        record["leases_after"] = hwrctl_leases(start["socket"])
        return record

    def _start(self, index: int, start: dict[str, Any], od_config: Any, record: dict[str, Any]) -> None:
        from vllm.model_executor.model_loader import LoadConfig
        from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader
        from vllm_omni.diffusion.offloader import enable_offload_backend

        inputs = self.pipeline.dit_inputs(int(start["input_seed"])) if start["straight"] or start["forwards"] else {}
        loader = DiffusersPipelineLoader(LoadConfig(), od_config=od_config)
        audit = HashAudit()
        from hwr.dlo_backend.vllm_plugin import unchanged

        snapshots_before = unchanged.stats()
        time.sleep(self.rank * float(start.get("stagger_s", 0.0)))
        with audit.active() if start.get("audit_hashing") else contextlib.nullcontext():
            profile = cProfile.Profile() if os.environ.get("HWR_PROFILE_LOAD") else None
            began = time.perf_counter()
            if profile is not None:  # benchmarks only: where a load's time goes
                profile.enable()
            loaded = loader.load_model(load_device="cpu", load_format="default", device=self.device)
            record["load_s"] = time.perf_counter() - began
            if profile is not None:
                profile.disable()
                profile.dump_stats(str(self.out / f"start{index}-load.prof"))
        state = loader._hwr_state or {}  # the loader's own transaction state (no public accessor)
        outcome = state.get("outcome")
        record["outcome"] = None if outcome is None else outcome.value
        plan = loader.host_weight_plan
        record["plan"] = None if plan is None else plan.backing_kind
        carrier = None if plan is None else plan.lease_carrier
        dit = getattr(loaded, self.pipeline.dit_attr)
        record["dit_homes"] = tensor_homes(dit, self.pipeline.dit_attr)
        if start.get("audit_hashing"):
            record["hashing"] = self._hashing(audit, loader, loaded, dit)
            after = record["hashing"]["snapshots"]
            record["hashing"]["snapshots"] = {k: after[k] - snapshots_before[k] for k in after}
        record["leases_during"] = hwrctl_leases(start["socket"])
        try:
            if start["straight"]:
                with torch.no_grad():
                    record["straight"] = self._save(index, "straight", self.pipeline.run_dit(dit, inputs))
            pipeline, backend = enable_offload_backend(od_config, loaded, device=self.device)
        except BaseException:
            if carrier is not None:
                carrier.close()  # the loader's lease, when DLO never took it (as the runner's failure path)
            raise
        record["offload"] = {"backend": type(backend).__name__, "fresh_model": pipeline is not loaded,
                             "carrier_taken": None if carrier is None else carrier.taken, "outputs": []}
        try:
            dit = getattr(pipeline, self.pipeline.dit_attr)
            with torch.no_grad():
                for forward in range(int(start["forwards"])):
                    record["offload"]["outputs"].append(
                        self._save(index, f"offload-{forward}", self.pipeline.run_dit(dit, inputs)))
                    if forward == 0 and os.environ.get("HWR_BENCH_MEASURE"):
                        record["first_forward"] = self._measure()
            if record["plan"] == "checkpoint_mmap":  # a checkpoint plan's leases are taken by DLO's enable
                record["offload"]["leases"] = hwrctl_leases(start["socket"])
            # DiT rings streamed by hwr.dlo_backend (AllGather from an hwrd lease): where shards come from.
            record["offload"]["hwr_rings"] = [
                {"world": h.stats.world, "shard_source": h.stats.shard_source,
                 "host_shard_bytes": h.stats.host_shard_bytes, "block_bytes": h.stats.block_bytes,
                 "slot_bytes": h.stats.slot_bytes}
                for h in getattr(backend, "_hwr_handles", [])]
        finally:
            if backend is not None:
                backend.shutdown()
        record["offload"]["carrier_closed"] = None if carrier is None else carrier.closed

    @staticmethod
    def _hashing(audit: HashAudit, loader: Any, loaded: Any, dit: torch.nn.Module) -> dict[str, Any]:
        """What ``load_model`` hashed (``HashAudit``), and whether the loader's "unchanged" check
        still catches a restored tensor replaced after its snapshot."""
        from hwr.dlo_backend.vllm_plugin import unchanged

        ranges = [(t.data_ptr(), t.numel() * t.element_size()) for t in [*dit.parameters(), *dit.buffers()]
                  if t.numel()]
        out: dict[str, Any] = {"dit_bytes": sum(n for _, n in ranges), "total_bytes": audit.total,
                               "restored_bytes": audit.overlap(ranges), "snapshots": unchanged.stats()}
        snapshot = (loader._hwr_state or {}).get("warm_snapshot")
        if snapshot:
            name = next(iter(snapshot))
            parent_path, _, leaf = name.rpartition(".")
            parent = loaded.get_submodule(parent_path)
            tensor = parent._parameters.get(leaf)
            tensor = parent._buffers[leaf] if tensor is None else tensor
            original = tensor.data
            tensor.data = original.clone()  # same bytes, private memory: no longer the leased view
            try:
                loader._assert_final_layout_tensors_unchanged(loaded, snapshot)
                out["replaced_tensor_detected"] = False
            except RuntimeError as exc:
                out["replaced_tensor_detected"] = name in str(exc)
            finally:
                tensor.data = original
        return out

    def _measure(self) -> dict[str, Any]:
        """Benchmarks only: seconds from process start, then PSS and Private_Dirty (and the node's
        MemAvailable) once every rank has run its first forward (a barrier on each side: the
        ranks' PSS shares are taken while all of them map what they share)."""
        at = time.time() - float(self.spec.get("spawned_at", time.time()))
        torch.distributed.barrier()
        memory = {}
        with open("/proc/self/smaps_rollup") as rollup:
            for line in rollup:
                key, _, rest = line.partition(":")
                if key in ("Pss", "Private_Dirty", "Anonymous", "Rss"):
                    memory[key] = int(rest.split()[0]) * 1024
        with open("/proc/meminfo") as meminfo:  # the node's view, page cache included
            memory["MemAvailable"] = next(int(line.split()[1]) * 1024 for line in meminfo
                                          if line.startswith("MemAvailable:"))
        torch.distributed.barrier()
        return {"seconds_from_start": at, **memory}

    def _save(self, index: int, label: str, output: torch.Tensor) -> dict[str, Any]:
        path = self.out / f"start{index}-{label}.pt"
        torch.save(output.detach().clone(), path)
        return {"sha256": digest(output), "path": str(path), "shape": list(output.shape)}


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    worker = Worker(spec)
    worker.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"pid": os.getpid(), "rank": worker.rank, "starts": []}
    try:
        result.update(worker.prepare())
        for index, start in enumerate(spec["starts"]):
            result["starts"].append(worker.run_start(index, start))
    except Exception as exc:
        result["error"] = error_record(exc)
    (worker.out / "result.json").write_text(json.dumps(result, indent=1))
    with contextlib.suppress(Exception):
        from vllm_omni.diffusion.distributed.parallel_state import destroy_distributed_env

        destroy_distributed_env()
    return 0


if __name__ == "__main__":
    sys.exit(main())
