"""One prepared check of the CUDA paths of ``dlo_backend`` on a single GPU, with a JSON report.

Run from a checkout: ``python benchmarks/gpu_check.py [--out REPORT.json]`` (default
``$OUT/gpu_check.json`` when ``$OUT`` is set, else ``./gpu_check.json``); ``--dry-run`` runs the
same control flow on the CPU with tiny sizes (CI runs it). It needs torch with CUDA on the
machine and nothing installed from this repository: when ``hwr`` does not import, the checkout's
folders are mapped onto the ``hwr`` namespace for this process and its children. A real hwrd is
started on a temp socket for the lease cases when its dependencies (grpcio, protobuf, msgspec)
import; otherwise the lease cases use a read-only file mapping and the report says so.

Sections (each timed, its result written to the report as soon as it finishes):

1. ``matrix``: depth 7, 3 forwards each ``torch.equal`` to the resident model, for module-pinned,
   module-unpinned, lease staged and lease registered, on the default and a non-default stream;
   the backend's mode and registered bytes are checked.
2. ``race``: a compute-bound and a copy-bound configuration, 20 iterations each, built to catch
   the two allocator hazards (a slot reusing memory a queued kernel still reads; slots released
   while another stream still reads them) and any missing copy/compute ordering.
3. ``registration``: the same region registered twice (the second fails), then a kernel launch,
   which must not see the failure; plus the raw ``cudaHostRegister`` repro without clearing.
4. ``gpu_dlo``: ``benchmarks/gpu_dlo.py`` with its output check, and a ``torch.profiler`` trace
   of two streamed forwards: H2D copies on a stream of their own, overlapping compute kernels.
5. ``allgather``: the AllGather path over a one-rank NCCL group (a one-rank group normally streams
   rank-locally; the check forces the group so the shards, gathers and gather-back run).

Exit status 0 when no section failed (skipped sections are listed with their reason), else 1;
2 when the check cannot start (no CUDA device without ``--dry-run``, ``hwr`` does not import).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Before CUDA initializes: cuBLAS results are only bit-reproducible across streams with a fixed
# workspace (CUDA docs, cuBLAS "Results reproducibility"); the check compares bits across streams.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

_PARTS = {"client": "client", "daemon": "daemon", "dlo_backend": "dlo_backend", "protos": "protos"}


def ensure_hwr(work: Path) -> str:
    """Make ``hwr`` importable here and in child processes; says how."""
    try:
        import hwr.dlo_backend  # noqa: F401

        return "installed"
    except ImportError:
        pass
    for name in [m for m in sys.modules if m == "hwr" or m.startswith("hwr.")]:
        del sys.modules[name]  # a bare ``hwr`` (the checkout's top folder) without its subpackages
    shim = work / "import-shim" / "hwr"
    shim.mkdir(parents=True)
    for entry in (REPO / "hwr").iterdir():
        (shim / entry.name).symlink_to(entry)
    for name, folder in _PARTS.items():
        (shim / name).symlink_to(REPO / folder)
    sys.path.insert(0, str(shim.parent))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim.parent), os.environ.get("PYTHONPATH")) if p)
    return f"checkout mapped at {shim}"


def versions(how: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": getattr(torch.version, "cuda", None),
        "cuda_available": torch.cuda.is_available(),
        "hwr_import": how,
    }
    if torch.cuda.is_available():
        info["device_name"] = torch.cuda.get_device_name()
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        with contextlib.suppress(Exception):
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    for module in ("grpc", "google.protobuf", "msgspec", "safetensors", "filelock"):
        try:
            imported = __import__(module, fromlist=["__version__"])
            info[module] = getattr(imported, "__version__", "present")
        except Exception as exc:
            info[module] = f"missing ({type(exc).__name__})"
    if sys.version_info[:2] < (3, 11):  # noqa: UP036 - the device machine may run an older interpreter
        info["warning"] = "hwr needs Python >= 3.11; sections may fail to import"
    return info


def default_out() -> Path:
    out = os.environ.get("OUT")
    return Path(out) / "gpu_check.json" if out else Path("gpu_check.json")


def run_sections(ctx: Any, sections: list[tuple[str, Callable[[Any], dict[str, Any]]]], report: dict[str, Any],
                 out: Path, budget_s: float) -> None:
    started = time.monotonic()
    for name, section in sections:
        if time.monotonic() - started > budget_s:
            report["sections"][name] = {"ok": None, "skipped": f"time budget of {budget_s:.0f} s spent"}
            continue
        t0 = time.monotonic()
        try:
            result = section(ctx)
        except Exception as exc:
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
        result["seconds"] = round(time.monotonic() - t0, 2)
        report["sections"][name] = result
        verdict = "skipped" if result.get("ok") is None else "ok" if result["ok"] else "FAILED"
        print(f"[{result['seconds']:7.2f} s] {name}: {verdict} {result.get('skipped') or result.get('error') or ''}",
              flush=True)
        out.write_text(json.dumps(report, indent=1, default=str))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="report path (default $OUT/gpu_check.json)")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: the control flow only")
    parser.add_argument("--budget-s", type=float, default=380.0, help="skip sections that would start after this")
    args = parser.parse_args(argv)
    out = args.out or default_out()
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="hwr-gpuchk-", dir="/tmp"))
    report: dict[str, Any] = {"check": "gpu_check", "dry_run": args.dry_run, "sections": {}}
    try:
        report["versions"] = versions(ensure_hwr(work))
        print(json.dumps(report["versions"]), flush=True)
        if not args.dry_run and not torch.cuda.is_available():
            report["error"] = "no CUDA device is visible to this torch; use --dry-run on a CPU-only machine"
            return finish(report, out, 2)
        try:
            import gpu_check_cases as cases
            import gpu_check_sections as sections
        except Exception as exc:
            report["error"] = f"the checkout's hwr package does not import with torch {torch.__version__}: {exc!r}"
            return finish(report, out, 2)
        device = torch.device("cpu") if args.dry_run else torch.device(args.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        ctx = cases.Ctx(device=device, dry_run=args.dry_run, out_dir=out.parent, work=work)
        with cases.lease_factory(work) as (take, source):
            ctx.take_lease, ctx.lease_source = take, source
            report["lease_source"] = source
            run_sections(ctx, sections.SECTIONS, report, out, args.budget_s)
        failed = [name for name, result in report["sections"].items() if result.get("ok") is False]
        report["failed"] = failed
        report["ok"] = not failed
        return finish(report, out, 1 if failed else 0)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def finish(report: dict[str, Any], out: Path, status: int) -> int:
    report["status"] = status
    out.write_text(json.dumps(report, indent=1, default=str))
    summary = {name: result.get("ok") for name, result in report.get("sections", {}).items()}
    print("| section | ok |\n| --- | --- |")
    for name, ok in summary.items():
        print(f"| {name} | {'skipped' if ok is None else 'yes' if ok else 'NO'} |")
    print(json.dumps({"check": "gpu_check", "status": status, "report": str(out), "sections": summary,
                      "error": report.get("error")}), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
