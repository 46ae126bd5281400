"""The committed stubs are exactly what the pinned generator produces from the .proto."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("hwr_protos_generate", ROOT / "protos" / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_match_regeneration(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    produced = _generator().generate(tmp_path)
    for path in produced:
        committed = ROOT / "protos" / "hwr" / "v1" / path.name
        assert committed.read_bytes() == path.read_bytes(), f"{path.name} is stale: run protos/generate.py"


def test_enum_zero_values_are_unspecified() -> None:
    from hwr.protos.hwr.v1 import hwr_pb2

    for enum in hwr_pb2.DESCRIPTOR.enum_types_by_name.values():
        assert enum.values[0].number == 0
        assert enum.values[0].name.endswith("_UNSPECIFIED"), enum.name


def test_every_rpc_has_its_own_request_and_response() -> None:
    from hwr.protos.hwr.v1 import hwr_pb2

    service = hwr_pb2.DESCRIPTOR.services_by_name["HostWeightRuntime"]
    seen: set[str] = set()
    for method in service.methods:
        assert method.input_type.name == f"{method.name}Request"
        assert method.output_type.name == f"{method.name}Response"
        assert method.input_type.name not in seen
        seen.add(method.input_type.name)
