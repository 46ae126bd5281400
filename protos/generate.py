"""Regenerate the Python stubs of ``protos/hwr/v1/hwr.proto`` (run from anywhere).

The generated ``hwr_pb2_grpc.py`` imports its sibling as ``hwr.v1``, the proto package, which is
not an importable name here; the one rewrite below points it at ``hwr.protos.hwr.v1``. The
result is byte-for-byte reproducible with the pinned grpcio-tools (``tests/protos`` checks it).

Usage: ``python protos/generate.py [OUT_DIR]`` (default: next to the .proto).
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO = "hwr/v1/hwr.proto"
IMPORT_FROM = "from hwr.v1 import hwr_pb2"
IMPORT_TO = "from hwr.protos.hwr.v1 import hwr_pb2"


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc  # build-time dependency only (extra "test")

    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", str(PROTO_ROOT / PROTO)]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    produced = [out_dir / "hwr/v1" / n for n in ("hwr_pb2.py", "hwr_pb2.pyi", "hwr_pb2_grpc.py")]
    grpc_file = produced[2]
    text = grpc_file.read_text()
    if IMPORT_FROM not in text:
        raise SystemExit("unexpected generated import; update protos/generate.py")
    grpc_file.write_text(text.replace(IMPORT_FROM, IMPORT_TO))
    return produced


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT
    for path in generate(target):
        print(path)
