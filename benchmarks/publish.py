"""Client publication of one artifact: hwrd vs vLLM-Omni's in-process store vs plain ``save_file``.

    .venv/bin/python benchmarks/publish.py [--size-gib 2] [--tensors 92] [--repeats 3] [--json-out F]

The same bf16 DiT-shaped tensors (``warm_start.dit_shapes``) are published ``--repeats`` times by
each path, interleaved (rep 1 of every path, then rep 2, ...), so machine load drifts over all
paths alike; each row reports the median and the min. Paths:

- ``save_file``: ``safetensors.torch.save_file`` to a new file (no hashing, no fsync: not durable);
- ``save_file + fsync``: the same, then ``fsync`` (durable, no digests);
- ``hwrd publish``: ``client.publish`` to a real hwrd (the daemon lays out the file, the client
  writes into the staging descriptor and starts writeback; the daemon proves it is the sole
  opener, hashes every file and tensor, fsyncs, renames), split into begin / write / commit;
- ``vLLM-Omni publish``: vLLM-Omni 0.30's ``FilesystemHostWeightStore.get_or_build`` in a fresh
  process (``warm_start.worker_upstream_publish``: it reads the tensors from the saved file and
  writes, hashes and fsyncs in-process), when ``vllm_omni.host_weight_runtime`` imports.

Goal: hwrd publish at least as fast as vLLM-Omni's store (both hash and fsync), ideally close to
``save_file + fsync`` (the durable write alone).
Prints a markdown table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import warm_start
from safetensors.torch import save_file

import hwr.client as hc
from hwr.client.publisher import specs_for

GIB = 1 << 30


def _save(tensors: dict[str, Any], path: Path, durable: bool) -> float:
    t = time.perf_counter()
    save_file(tensors, str(path))
    if durable:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    seconds = time.perf_counter() - t
    path.unlink()
    return seconds


def _hwrd(client: Any, tensors: dict[str, Any], name: str) -> dict[str, float]:
    t0 = time.perf_counter()
    with client.publisher(hc.ArtifactIdentity.simple(name), specs_for(tensors)) as pub:
        t1 = time.perf_counter()
        for tensor_name, tensor in tensors.items():
            pub.write(tensor_name, tensor)
        t2 = time.perf_counter()
        pub.commit()
    t3 = time.perf_counter()
    return {"total": t3 - t0, "begin": t1 - t0, "write": t2 - t1, "commit": t3 - t2}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--tensors", type=int, default=92)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    vo, how = warm_start.import_upstream(None)
    work = common.short_tmpdir("hwrpub-")
    times: dict[str, list[float]] = {"save_file": [], "save_file + fsync": [], "hwrd publish": []}
    phases: dict[str, list[float]] = {"begin": [], "write": [], "commit": []}
    if vo is not None:
        times["vLLM-Omni publish"] = []
    try:
        tensors = warm_start.make_tensors(warm_start.dit_shapes(int(args.size_gib * GIB), args.tensors))
        nbytes = sum(t.nbytes for t in tensors.values())
        source = work / "model.safetensors"
        save_file(tensors, str(source))
        identity = hc.ArtifactIdentity.simple(f"bench/publish-{nbytes}")
        with common.hwrd(work / "store") as daemon, hc.connect(daemon.socket, timeout=3600) as client:
            for rep in range(args.repeats):
                times["save_file"].append(_save(tensors, work / "copy.safetensors", durable=False))
                times["save_file + fsync"].append(_save(tensors, work / "copy.safetensors", durable=True))
                run = _hwrd(client, tensors, f"bench/publish-{nbytes}-{rep}")
                times["hwrd publish"].append(run.pop("total"))
                for phase, seconds in run.items():
                    phases[phase].append(seconds)
                if vo is not None:
                    root = work / f"vo-{rep}"
                    root.mkdir(mode=0o700)
                    result = warm_start.run({"mode": "upstream-publish", "root": str(root), "path": str(source),
                                             "identity": json.loads(identity.canonical_bytes),
                                             "vllm_omni_src": None}, timeout=1800)
                    times["vLLM-Omni publish"].append(result["publish_s"])
                    shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gib = nbytes / GIB
    rows = [[name, f"{statistics.median(v):.2f}", f"{min(v):.2f}", f"{gib / statistics.median(v):.2f}"]
            for name, v in times.items()]
    rows += [[f"  hwrd {phase}", f"{statistics.median(v):.2f}", f"{min(v):.2f}", ""] for phase, v in phases.items()]
    print(f"publication of {gib:.2f} GiB bf16 in {len(tensors)} tensors, {args.repeats} interleaved runs; "
          f"vLLM-Omni: {how}\n")
    print(common.md_table(["path", "median s", "min s", "GiB/s (median)"], rows))
    medians = {name: round(statistics.median(v), 3) for name, v in times.items()}
    goal = medians.get("vLLM-Omni publish")
    if goal is not None:
        print(f"\ngoal hwrd publish at least as fast as vLLM-Omni publish: "
              f"{'met' if medians['hwrd publish'] <= goal else 'MISSED'} "
              f"({medians['hwrd publish']:.2f} s vs {goal:.2f} s, median)")
    common.json_line({"benchmark": "publish", "gib": round(gib, 3), "tensors": len(tensors), "repeats": args.repeats,
                      "median_s": medians, "runs_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
                      "hwrd_phases_median_s": {k: round(statistics.median(v), 3) for k, v in phases.items()},
                      "hwrd_at_least_as_fast_as_vllm_omni": None if goal is None else medians["hwrd publish"] <= goal},
                     args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
