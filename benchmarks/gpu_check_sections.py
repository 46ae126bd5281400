"""The five sections of ``gpu_check.py``; each returns ``{"ok": True | False | None, ...}``.

``ok`` is ``None`` for a section (or part) that cannot run here, with ``skipped`` saying why.
Sizes are chosen so that all five finish in well under 7 minutes on one recent GPU; the dry run
(CPU) uses tiny ones and checks only that every path runs.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from gpu_check_cases import REPO, Ctx, Shape, Stack, pin_module, resident_copy, run_case, skeleton

from hwr.dlo_backend import apply_layerwise_offload

_SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU spin: longer than an enable, so the hazard can show


# ------------------------------------------------------------------------------------ 1. matrix
def matrix(ctx: Ctx) -> dict[str, Any]:
    shape = Shape(7, 32, 64, 4) if ctx.dry_run else Shape(7, 1024, 4096, 256)
    staged = "staged" if ctx.cuda else "direct"  # a CPU device copies directly (no pinning there)
    cases = [
        ("module-pinned", "module-pinned", 0.0, "direct", False),
        ("module-unpinned", "module-unpinned", 0.0, staged, False),
        ("lease-staged", "lease", 1e-12, staged, False),  # a budget no region fits: never registered
        ("lease-registered", "lease", 0.0, "direct", ctx.cuda),
    ]
    rows = [
        run_case(ctx, name, shape, source=source, side_stream=side, limit_gib=limit, expect_mode=mode,
                 expect_registered=registered)
        for side in (False, True)
        for name, source, limit, mode, registered in cases
    ]
    return {"ok": all(r["ok"] for r in rows), "shape": shape.__dict__, "lease_source": ctx.lease_source, "cases": rows}


# -------------------------------------------------------------------------------------- 2. race
def _race_iteration(ctx: Ctx, shape: Shape, model: Stack, resident: Stack, slot_bytes: int, lease: bool) -> bool:
    x = torch.randn(shape.tokens, shape.dim, device=ctx.device)
    want = resident(x)
    guard_ok = True
    if ctx.cuda:
        # A kernel queued on the allocating stream still reads memory freed right after: the
        # slots may be carved from it, and the copy lane must not write them before it ran.
        victim = torch.ones(slot_bytes, dtype=torch.uint8, device=ctx.device)
        torch.cuda._sleep(_SLEEP_CYCLES)
        total = victim.sum()
        del victim
    target = skeleton(shape) if lease else model
    source = ctx.take_lease(shape) if lease and ctx.take_lease else None
    handle = apply_layerwise_offload(target, device=ctx.device, blocks_attr="blocks", host_source=source,
                                     cpu_zero_copy=False)
    with ctx.side_stream():
        got = [target(x), target(x)]
        # Closing right away: the side stream may still read the slots; close must wait for it
        # before the memory goes back to the allocator, which hands it to the next allocation.
        handle.close()
    if ctx.cuda:
        torch.full((slot_bytes,), 0xAB, dtype=torch.uint8, device=ctx.device)
        guard_ok = int(total.item()) == slot_bytes
    ctx.sync()
    return guard_ok and all(torch.equal(g, want) for g in got)


def race(ctx: Ctx) -> dict[str, Any]:
    iterations = 2 if ctx.dry_run else 20
    configs = (
        {"compute_bound": Shape(7, 32, 64, 64), "copy_bound": Shape(7, 64, 256, 2)}
        if ctx.dry_run
        else {"compute_bound": Shape(7, 1024, 2048, 16384), "copy_bound": Shape(7, 2048, 8192, 16)}
    )
    # Alternate the sources: pinned module tensors (nothing synchronizes the device during enable,
    # so the allocation hazard is exposed) and the registered lease mapping (the most
    # asynchronous copies; cudaHostRegister may synchronize, which would hide that hazard).
    lease = ctx.take_lease is not None
    out: dict[str, Any] = {"iterations": iterations, "sources": ["module-pinned", "lease"] if lease else
                           ["module-pinned"]}
    with torch.no_grad():
        for name, shape in configs.items():
            model = Stack(shape.depth, shape.dim, shape.hidden).eval()
            resident = resident_copy(model, shape, ctx.device)
            if ctx.cuda:
                pin_module(model)
            probe = apply_layerwise_offload(model, device=ctx.device, blocks_attr="blocks", cpu_zero_copy=False)
            slot_bytes, mode = probe.stats.slot_bytes, probe.stats.mode
            probe.close()
            passed = [
                _race_iteration(ctx, shape, model, resident, slot_bytes, lease and i % 2 == 1)
                for i in range(iterations)
            ]
            out[name] = {"shape": shape.__dict__, "probe_mode": mode, "passed": sum(passed),
                         "failed": passed.count(False)}
    out["ok"] = all(out[name]["failed"] == 0 for name in configs)
    return out


# ------------------------------------------------------------------------------ 3. registration
def _launch(device: torch.device) -> str | None:
    """Launch a kernel and wait for it; the error it raised, else ``None``."""
    try:
        torch.ones(16, device=device).sum().item()
    except RuntimeError as exc:
        return str(exc)[:300]
    return None


def registration(ctx: Ctx) -> dict[str, Any]:
    from hwr.dlo_backend.cudart import HOST_REGISTER_READ_ONLY_SUPPORTED, HOST_REGISTER_SUPPORTED, TorchCudaRuntime
    from hwr.dlo_backend.registration import register_regions

    if ctx.take_lease is None:
        return {"ok": None, "skipped": "no lease source"}
    lease = ctx.take_lease(Shape(2, 64, 256, 1))
    try:
        regions = lease.mapped_regions
        if not ctx.cuda:
            # Without CUDA registration must decline cleanly (staging); nothing else to check.
            none = register_regions(regions, 0) is None
            return {"ok": None, "skipped": "no CUDA device", "declined_without_cuda": none}
        index = ctx.device.index or 0
        runtime = TorchCudaRuntime()
        out: dict[str, Any] = {
            "libcudart_found": runtime.direct,
            "host_register_supported": runtime.attribute(HOST_REGISTER_SUPPORTED, index),
            "read_only_supported": runtime.attribute(HOST_REGISTER_READ_ONLY_SUPPORTED, index),
        }
        first = register_regions(regions, 0, device=index)
        out["first_registered_bytes"] = first.nbytes if first is not None else 0
        second = register_regions(regions, 0, device=index)  # cudaErrorHostMemoryAlreadyRegistered
        out["second_declined"] = second is None
        out["launch_after_failure_error"] = _launch(ctx.device)
        if first is not None:
            # The hazard itself: the same failure without clearing, then a launch.
            raw = torch.cuda.cudart()
            region = regions[0]
            out["raw_second_register_error"] = int(raw.cudaHostRegister(region.address, region.length, 0x09))
            out["raw_next_launch_error"] = _launch(ctx.device)
            runtime.clear_last_error()
            if out["raw_second_register_error"] == 0:
                raw.cudaHostUnregister(region.address)  # unexpected success: undo it
        out["unregister_failures"] = first.close() if first is not None else []
        out["ok"] = bool(
            first is not None and first.complete and second is None
            and out["launch_after_failure_error"] is None and not out["unregister_failures"]
        )
        return out
    finally:
        lease.close()


# --------------------------------------------------------------------------- 4. gpu_dlo + trace
def _analyze_trace(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    kernels: list[tuple[Any, float, float]] = []
    copies: list[tuple[Any, float, float, str]] = []
    for ev in events:
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        cat, name = str(ev.get("cat", "")).lower(), str(ev.get("name", ""))
        stream = (ev.get("args") or {}).get("stream", ev.get("tid"))
        start, end = float(ev["ts"]), float(ev["ts"]) + float(ev["dur"])
        if cat == "kernel":
            kernels.append((stream, start, end))
        elif "memcpy" in cat and "htod" in name.lower():
            copies.append((stream, start, end, name))
    compute_streams = {s for s, _, _ in kernels}
    copy_streams = {s for s, _, _, _ in copies}
    overlap = 0.0
    for stream, start, end, _ in copies:
        spans = sorted((a, b) for s, a, b in kernels if s != stream and b > start and a < end)
        cursor = start
        for a, b in spans:  # union of the kernels' time inside this copy
            a, b = max(a, cursor), min(b, end)
            if b > a:
                overlap += b - a
                cursor = b
    return {
        "h2d_copies": len(copies),
        "h2d_pinned": sum("pinned" in n.lower() for *_, n in copies),
        "h2d_pageable": sum("pageable" in n.lower() for *_, n in copies),
        "kernels": len(kernels),
        "copy_streams": sorted(map(str, copy_streams)),
        "compute_streams": sorted(map(str, compute_streams)),
        "copy_only_streams": sorted(map(str, copy_streams - compute_streams)),
        "h2d_overlapping_compute_us": round(overlap, 1),
        "h2d_total_us": round(sum(e - s for _, s, e, _ in copies), 1),
    }


def _trace(ctx: Ctx) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    shape = Shape(3, 32, 64, 4) if ctx.dry_run else Shape(7, 2048, 8192, 2048)
    lease = ctx.take_lease is not None
    model = Stack(shape.depth, shape.dim, shape.hidden).eval()
    if ctx.cuda and not lease:
        pin_module(model)
    target = skeleton(shape) if lease else model
    source = ctx.take_lease(shape) if lease and ctx.take_lease else None
    x = torch.randn(shape.tokens, shape.dim, device=ctx.device)
    path = ctx.out_dir / "gpu_check_trace.json"
    with torch.no_grad():
        handle = apply_layerwise_offload(target, device=ctx.device, blocks_attr="blocks", host_source=source,
                                         cpu_zero_copy=False)
        mode = handle.stats.mode
        try:
            target(x)  # warm-up: allocator, cuBLAS handles, first-touch of the mapping
            ctx.sync()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
            with profile(activities=activities) as prof:
                for _ in range(2):
                    target(x)
                ctx.sync()
        finally:
            handle.close()
    prof.export_chrome_trace(str(path))
    out = {"trace": str(path), "mode": mode, "shape": shape.__dict__, **_analyze_trace(path)}
    if not ctx.cuda:
        out["ok"] = None
        out["skipped"] = "no CUDA events on a CPU device (trace written and parsed)"
    else:
        out["ok"] = bool(out["h2d_copies"] and out["copy_only_streams"] and out["h2d_overlapping_compute_us"] > 0)
    return out


def gpu_dlo(ctx: Ctx) -> dict[str, Any]:
    sizes = ["--depth", "3", "--dim", "64", "--hidden", "128", "--tokens", "8", "--reps", "1"] if ctx.dry_run else [
        "--depth", "8", "--dim", "2048", "--hidden", "8192", "--tokens", "4096", "--reps", "3"]
    argv = [sys.executable, str(REPO / "benchmarks" / "gpu_dlo.py"), "--device", str(ctx.device), *sizes]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    bench: dict[str, Any] = {"argv": argv[1:], "rc": proc.returncode}
    if proc.returncode != 0 and "No module named 'safetensors'" in proc.stderr:
        bench["ok"] = None
        bench["skipped"] = "safetensors is not installed here (gpu_dlo.py writes its checkpoint with it)"
    elif proc.returncode != 0 or not lines:
        bench["ok"], bench["stderr"] = False, proc.stderr[-3000:]
    else:
        result = json.loads(lines[-1])
        bench["result"] = result
        bench["ok"] = bool(result.get("outputs_equal")) and not result.get("registration_failed")
    trace = _trace(ctx)
    ok = None if bench["ok"] is None and trace["ok"] is None else bench["ok"] is not False and trace["ok"] is not False
    return {"ok": ok, "gpu_dlo": bench, "profile": trace}


# ---------------------------------------------------------------------------------- 5. allgather
def allgather(ctx: Ctx) -> dict[str, Any]:
    import torch.distributed as dist

    from hwr.dlo_backend import group as groups

    if not dist.is_available():
        return {"ok": None, "skipped": "torch.distributed is not available in this torch build"}
    backend = "nccl" if ctx.cuda else "gloo"
    if ctx.cuda and not dist.is_nccl_available():
        return {"ok": None, "skipped": "this torch has no NCCL"}
    dist.init_process_group(backend, init_method=f"file://{ctx.work}/pg-store", rank=0, world_size=1)
    chosen = dist.group.WORLD
    original = groups.select_group
    # select_group maps a one-rank group to rank-local streaming; force it to reach the gathers.
    groups.select_group = lambda *, use_allgather, **_: chosen if use_allgather else None  # type: ignore[assignment]
    shape = Shape(7, 32, 64, 4) if ctx.dry_run else Shape(7, 1024, 4096, 256)
    rows = []
    try:
        for source in ("module", "lease"):
            if source == "lease" and ctx.take_lease is None:
                continue
            model = Stack(shape.depth, shape.dim, shape.hidden).eval()
            reference = {k: v.clone() for k, v in model.state_dict().items()}
            resident = resident_copy(model, shape, ctx.device)
            target = skeleton(shape) if source == "lease" else model
            host = ctx.take_lease(shape) if source == "lease" and ctx.take_lease else None
            with torch.no_grad():
                handle = apply_layerwise_offload(target, device=ctx.device, blocks_attr="blocks", host_source=host,
                                                 use_allgather=True, group=chosen)
                stats = handle.stats
                equal = []
                for side in (False, True):
                    with ctx.side_stream() if side else contextlib.nullcontext():
                        x = torch.randn(shape.tokens, shape.dim, device=ctx.device)
                        equal += [bool(torch.equal(target(x), resident(x))) for _ in range(3)]
                ctx.sync()
                handle.close()  # gathers every block back into CPU tensors
            restored = all(torch.equal(v, reference[k]) for k, v in target.state_dict().items())
            rows.append({"source": source, "mode": stats.mode, "world": stats.world, "outputs_equal": equal,
                         "restored_after_close": restored,
                         "ok": stats.mode == "allgather" and all(equal) and restored})
    finally:
        groups.select_group = original
        dist.destroy_process_group()
    return {"ok": bool(rows) and all(r["ok"] for r in rows), "backend": backend, "runs": rows}


SECTIONS = [("matrix", matrix), ("race", race), ("registration", registration), ("gpu_dlo", gpu_dlo),
            ("allgather", allgather)]
