"""Rank programs for the AllGather-through-hwrd tests: real spawned processes over real gloo groups.

Each rank sets up vLLM-Omni's own distributed state (``init_distributed_environment`` and
``initialize_model_parallel`` with the DP/SP sizes of the test), loads the hwr plugin the way
vLLM-Omni does (``load_omni_general_plugins``), and starts DLO through vLLM-Omni's own
``enable_offload_backend`` from a loader startup state, exactly the runner's call after a load.

Faked, at the accelerator boundary only: vLLM-Omni has no CPU OmniPlatform, so the unspecified
platform gets the device calls DLO makes (synchronize, empty_cache, memory and device queries)
as CPU no-ops (``cpu_platform``). Everything else is real: hwrd, the plugin's store, vLLM-Omni's
runtime, lease, carrier, resolver and backend, torch.distributed gloo.

Each program writes ``<outdir>/rank<r>.json`` (``write_result``); the test asserts on it.

Ranks are forked from multiprocessing's fork server (``processes()``), which has imported torch and
vLLM-Omni once for the session and done nothing else; each rank then does all of the above itself.
The fork server's environment is the one it started with, so what a rank needs from the test's
environment is passed to it (glibc's ``MALLOC_MMAP_THRESHOLD_``, applied with ``mallopt``).
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

DIM = 1024  # 4 MiB blocks: the fixed private overhead (gather input, threads) is small beside one


def write_result(outdir: str, rank: int, result: dict[str, Any]) -> None:
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(result))


def run_ranks(program: Callable[..., None], world: int, tmp: Path, *args: Any,
              deadline: float = 240) -> list[dict[str, Any]]:
    """Run ``program`` on ``world`` spawned ranks; kill what is left after ``deadline`` (a hang
    then fails the test: its rank wrote no result)."""
    ctx = processes()
    rdzv = tmp / f"rdzv-{time.monotonic_ns()}"
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    procs = [ctx.Process(target=_rank_main, args=(threshold, program, rank, world, str(rdzv), str(tmp), *args))
             for rank in range(world)]
    for proc in procs:
        proc.start()
    end = time.monotonic() + deadline
    for proc in procs:
        proc.join(max(0.0, end - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    results = []
    for rank in range(world):
        path = tmp / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no result (exit code {procs[rank].exitcode})"
        results.append(json.loads(path.read_text()))
        path.unlink()
    return results


PRELOAD = ["torch", "torch.distributed", "vllm_omni", "vllm_omni.diffusion.distributed.parallel_state",
           "vllm_omni.diffusion.offloader", "vllm_omni.host_weight_runtime", "omni_ag_ranks", "vo_helpers"]
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (what MALLOC_MMAP_THRESHOLD_ sets at startup)


def processes() -> Any:
    """The multiprocessing context ranks start from: the fork server, with vLLM-Omni preloaded."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _rank_main(mmap_threshold: str | None, program: Callable[..., None], *args: Any) -> None:
    if mmap_threshold is not None:
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, int(mmap_threshold))
    program(*args)


def cpu_platform() -> None:
    """The accelerator boundary: CPU no-ops for the device calls vLLM-Omni's platform lacks."""
    from vllm_omni.platforms import current_omni_platform

    platform = type(current_omni_platform)
    for name, fn in {
        "synchronize": lambda cls: None,
        "empty_cache": lambda cls: None,
        "get_free_memory": lambda cls, device=None: 1 << 40,
        "get_device_memory": lambda cls, device=None: (1 << 40, 1 << 40),
        "get_torch_device": lambda cls, local_rank=None: torch.device("cpu"),
        "get_device_count": lambda cls: 1,
        "set_device": lambda cls, device: None,
        "supports_cpu_offload": lambda cls: True,
    }.items():
        setattr(platform, name, classmethod(fn))


class Block(nn.Module):
    """One DiT block; with ``sp`` it all-reduces inside forward on vLLM-Omni's SP group (as
    sequence-parallel attention does), so DLO's gathers run beside the model's own collectives."""

    def __init__(self, sp: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.lin = nn.Linear(DIM, DIM)
        self.sp = sp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(self.norm(x))
        if self.sp:
            from vllm_omni.diffusion.distributed.parallel_state import get_sp_group

            group = get_sp_group()
            dist.all_reduce(h, group=group.device_group)
            h = h / group.world_size
        return x + torch.tanh(h)


class TinyDiT(nn.Module):
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self, depth: int = 6, sp: bool = False) -> None:
        super().__init__()
        self.proj_in = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(Block(sp) for _ in range(depth))
        self.proj_out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for block in self.blocks:
            x = block(x)
        return self.proj_out(x)


class TinyPipeline(nn.Module):
    _dit_modules = ["transformer"]
    _encoder_modules: list[str] = []
    _vae_modules: list[str] = []
    _resident_modules: list[str] = []

    def __init__(self, transformer: TinyDiT) -> None:
        super().__init__()
        self.transformer = transformer


def anonymous_kib() -> int:
    """Private anonymous memory of this process (file pages of the lease are not counted)."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1])
    raise RuntimeError("no Anonymous in smaps_rollup")


def setup(rank: int, world: int, rdzv: str, dp: int, sp: int) -> None:
    """vLLM-Omni's distributed state on gloo, the plugin loaded as vLLM-Omni loads it, the CPU boundary."""
    from vllm_omni.diffusion.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from vllm_omni.plugins import load_omni_general_plugins

    cpu_platform()
    load_omni_general_plugins()
    init_distributed_environment(world_size=world, rank=rank, distributed_init_method=f"file://{rdzv}",
                                 local_rank=rank, backend="gloo")
    initialize_model_parallel(data_parallel_size=dp, sequence_parallel_size=sp, ulysses_degree=sp, backend="gloo")


def od_config(root: str, dp: int, sp: int, mode: str) -> Any:
    from vllm_omni.diffusion.data import DiffusionParallelConfig, OmniDiffusionConfig

    return OmniDiffusionConfig(
        model=root, enable_distributed_layerwise_offload=True, pin_cpu_memory=False,
        parallel_config=DiffusionParallelConfig(data_parallel_size=dp, ulysses_degree=sp),
        host_weight_runtime_mode=mode, host_weight_runtime_root=root)


def allgather_from_lease(rank: int, world: int, rdzv: str, outdir: str, socket: str, root: str, dp: int, sp: int,
                         mode: str, ident_json: str) -> None:
    """Warm AllGather DLO from an hwrd lease: outputs, private memory, the lease's lifecycle."""
    os.environ["HWR_SOCKET"] = socket
    setup(rank, world, rdzv, dp, sp)
    from vllm_omni.diffusion.model_loader.host_weight_plan import HostWeightPlan
    from vllm_omni.diffusion.offloader import enable_offload_backend
    from vllm_omni.diffusion.offloader.startup import OffloadStartupState, attach_offload_startup_state
    from vllm_omni.host_weight_runtime import HostWeightLeaseCarrier, ResolutionOutcome, WeightArtifactIdentity
    from vo_helpers import runtime

    import hwr.client
    from hwr.dlo_backend.vllm_plugin.offload import HwrdOffloadBackend

    torch.manual_seed(0)
    reference = TinyPipeline(TinyDiT(sp=sp > 1)).eval()
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(100 + (rank if dp > 1 else 0)))
    with torch.no_grad():
        want = reference.transformer(x)
    ident = WeightArtifactIdentity.from_dict(json.loads(ident_json))
    from vllm_omni.host_weight_runtime import RuntimeMode

    rt = runtime(Path(root), RuntimeMode(mode))
    warm = rt.resolve(ident)
    result: dict[str, Any] = {"outcome": warm.report.outcome.value}
    if warm.report.outcome is not ResolutionOutcome.LOCAL_HIT:
        write_result(outdir, rank, result)
        return
    with torch.device("meta"):
        model = TinyDiT(sp=sp > 1).eval()
    for name, source in warm.lease.tensors.items():  # what the final-layout restore commit does
        parent_name, _, leaf = name.removeprefix("transformer.").rpartition(".")
        model.get_submodule(parent_name)._parameters[leaf] = nn.Parameter(source, requires_grad=False)
    pipeline = TinyPipeline(model)
    carrier = HostWeightLeaseCarrier(warm.lease)
    attach_offload_startup_state(pipeline, OffloadStartupState(host_weight_plan=HostWeightPlan(
        backing_kind="host_weight_runtime", bindings={}, lease_carrier=carrier)))
    dist.barrier()
    before = anonymous_kib()
    pipeline, backend = enable_offload_backend(od_config(root, dp, sp, mode), pipeline, device=torch.device("cpu"))
    after_enable = anonymous_kib()
    with torch.no_grad():
        outs = [pipeline.transformer(x) for _ in range(2)]
    handles = getattr(backend, "_hwr_handles", [])
    for handle in handles:
        for lane in handle.backend._runtime.lanes:
            lane.drain()  # the next pass's prefetch finished: no gather temporary is alive
    grown = (anonymous_kib() - before) * 1024
    with hwr.client.connect(socket) as c:
        leases = [entry for entry in c.leases() if entry["key"] == ident.key]
    stats = handles[0].stats if handles else None
    result.update({
        "backend": type(backend).__name__, "hwrd_backend": isinstance(backend, HwrdOffloadBackend),
        "taken": carrier.taken, "equal": [bool(torch.equal(o, want)) for o in outs],
        "private_growth_bytes": grown, "enable_growth_bytes": (after_enable - before) * 1024,
        "slot_bytes": 2 * stats.slot_bytes if stats else 0,
        "block_bytes": stats.block_bytes // max(1, stats.streamed_blocks) if stats else 0,
        "host_shard_bytes": stats.host_shard_bytes if stats else -1,
        "shard_source": stats.shard_source if stats else "none", "world": stats.world if stats else 0,
        "leases_while_running": len(leases), "lease_pids": sorted({e["pid"] for e in leases}), "pid": os.getpid(),
    })
    backend.disable()
    with torch.no_grad():
        result["equal_after_disable"] = bool(torch.equal(pipeline.transformer(x), want))
    result["lease_closed"] = warm.lease.closed
    dist.barrier()
    with hwr.client.connect(socket) as c:
        result["leases_after"] = len([e for e in c.leases() if e["key"] == ident.key])
    write_result(outdir, rank, result)
    dist.destroy_process_group()


def publish(socket: str, root: str, ident_json: str, sp: bool) -> None:
    """The cold start's publication: the canonical final layout into hwrd (a fresh process)."""
    os.environ["HWR_SOCKET"] = socket
    from vllm_omni.host_weight_runtime import PostLoadPublicationOutcome, WeightArtifactIdentity
    from vllm_omni.plugins import load_omni_general_plugins
    from vo_helpers import TensorProducer, runtime

    load_omni_general_plugins()
    torch.manual_seed(0)
    canonical = TinyPipeline(TinyDiT(sp=sp))
    ident = WeightArtifactIdentity.from_dict(json.loads(ident_json))
    weights = {n: p.detach().clone() for n, p in canonical.state_dict().items()}
    report = runtime(Path(root)).publish_after_load(ident, producer=TensorProducer(ident, weights))
    assert report.outcome is PostLoadPublicationOutcome.PUBLISHED, report


class RemapPipeline(nn.Module):
    """A pipeline loaded by direct checkpoint mmap: canonical keys lack the ``transformer.``
    namespace of the model, and ``_remap_ckpt_key`` maps them (as Cosmos3 and MAGI-2 do)."""

    _dit_modules = ["transformer"]
    _encoder_modules: list[str] = []
    _vae_modules: list[str] = []
    _resident_modules: list[str] = []

    def __init__(self, checkpoint_dir: str, sp: bool = False) -> None:
        super().__init__()
        from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader

        self.transformer = TinyDiT(sp=sp)
        self.weights_sources = [DiffusersPipelineLoader.ComponentSource(
            model_or_path=checkpoint_dir, subfolder="transformer", revision=None, prefix="transformer.")]

    @staticmethod
    def _remap_ckpt_key(key: str) -> str | None:
        key = key.removeprefix("transformer.")
        return f"transformer.{key.removeprefix('model.')}" if key.startswith("model.") else None


def write_checkpoint(checkpoint_dir: str, seed: int) -> dict[str, torch.Tensor]:
    """The canonical checkpoint (keys under ``model.``), split over two files like real ones.

    hwrd registers one content once (under its first path), so each test writes its own seed."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    state = {f"model.{k}": v.contiguous() for k, v in TinyDiT().state_dict().items()}
    names = sorted(state)
    folder = Path(checkpoint_dir, "transformer")
    folder.mkdir(parents=True, exist_ok=True)
    half = len(names) // 2
    save_file({n: state[n] for n in names[:half]}, folder / "model-00001-of-00002.safetensors")
    save_file({n: state[n] for n in names[half:]}, folder / "model-00002-of-00002.safetensors")
    return state


def checkpoint_plan(rank: int, world: int, rdzv: str, outdir: str, socket: str, checkpoint_dir: str, dp: int,
                    mode: str) -> None:
    """DLO of a direct checkpoint mmap plan whose files come from hwrd checkpoint leases."""
    from safetensors.torch import load_file

    setup(rank, world, rdzv, dp, 1)
    os.environ["HWR_SOCKET"] = socket
    import vllm_omni.diffusion.model_loader.host_weight_plan as planning
    from vllm_omni.diffusion.offloader import enable_offload_backend
    from vllm_omni.diffusion.offloader.startup import OffloadStartupState, attach_offload_startup_state

    import hwr.client
    from hwr.dlo_backend.vllm_plugin.offload import HwrdOffloadBackend

    # vLLM-Omni's planner looks up model-specific adapters by importing the Cosmos3, MAGI-2 and
    # MiniMax-H3 modules, and Cosmos3's imports torchvision, which has no CPU build on PyPI. The
    # answer for this pipeline (none of the three) is given directly; the rest of the planner
    # (source map, remap, coverage, custom-loader and metadata checks) runs as it is.
    planning.get_direct_mmap_adapter = lambda pipeline: None
    folder = Path(checkpoint_dir, "transformer")
    reference = TinyDiT().eval()
    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update({k.removeprefix("model."): v for k, v in load_file(file).items()})
    reference.load_state_dict(state)
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(200 + (rank if dp > 1 else 0)))
    with torch.no_grad():
        want = reference(x)
    pipeline = RemapPipeline(checkpoint_dir).eval()
    planned = planning.build_checkpoint_mmap_plan(
        pipeline, dit_modules=(("transformer", pipeline.transformer),), sources=pipeline.weights_sources,
        model_path=checkpoint_dir, tensor_parallel_size=1, use_hsdp=False, online_quantization=False)
    result: dict[str, Any] = {"plan": planned.plan.backing_kind if planned.plan else planned.fallback_reason}
    attach_offload_startup_state(pipeline, OffloadStartupState(host_weight_plan=planned.plan))
    dist.barrier()
    before = anonymous_kib()
    try:
        pipeline, backend = enable_offload_backend(od_config(checkpoint_dir, dp, 1, mode), pipeline,
                                                   device=torch.device("cpu"))
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        write_result(outdir, rank, result)
        return
    with torch.no_grad():
        outs = [pipeline.transformer(x) for _ in range(2)]
    handles = getattr(backend, "_hwr_handles", [])
    for handle in handles:
        for lane in handle.backend._runtime.lanes:
            lane.drain()
    grown = (anonymous_kib() - before) * 1024
    stats = handles[0].stats if handles else None
    leases = backend._checkpoint_leases if isinstance(backend, HwrdOffloadBackend) else None
    bound = leases is not None and all(
        any(p.data_ptr() == v.data_ptr() for v in leases.tensors.values())
        for p in (pipeline.transformer.proj_in.weight, pipeline.transformer.proj_out.weight))
    try:
        with hwr.client.connect(socket, timeout=5) as c:
            held = [e for e in c.leases() if e["key"].startswith("checkpoint:")]
    except hwr.client.errors.HwrError:
        held = []
    result.update({
        "backend": type(backend).__name__, "equal": [bool(torch.equal(o, want)) for o in outs],
        "from_hwrd": leases is not None, "non_block_views_of_lease": bound,
        "hwr_rings": len(handles), "shard_source": stats.shard_source if stats else "none",
        "private_growth_bytes": grown, "slot_bytes": 2 * stats.slot_bytes if stats else 0,
        "block_bytes": stats.block_bytes // max(1, stats.streamed_blocks) if stats else 0,
        "leases_while_running": len(held), "lease_pids": sorted({e["pid"] for e in held}), "pid": os.getpid(),
    })
    backend.disable()
    with torch.no_grad():
        result["equal_after_disable"] = bool(torch.equal(pipeline.transformer(x), want))
    result["closed"] = leases is None or leases.closed
    dist.barrier()
    try:
        with hwr.client.connect(socket, timeout=5) as c:
            result["leases_after"] = len([e for e in c.leases() if e["key"].startswith("checkpoint:")])
    except hwr.client.errors.HwrError:
        result["leases_after"] = -1
    write_result(outdir, rank, result)
    dist.destroy_process_group()
