"""Daemon-side producers: deterministic transforms from a registered checkpoint to final-layout
artifacts, run in an isolated, cancellable process (``runner``), streaming into a store staging.

``PRODUCERS`` maps the user-facing names (``cast``, ``tp-slice``, ``fp8-per-tensor``) to classes;
``make_producer(name, options)`` builds one from plain options (the worker does the same).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hwr.client.errors import InvalidRequest
from hwr.daemon.producers.base import ArtifactProducer, OutputTensor, SourceTensor
from hwr.daemon.producers.cast import CastProducer
from hwr.daemon.producers.fp8 import Fp8PerTensorProducer
from hwr.daemon.producers.tp_slice import TpSliceProducer

__all__ = ["PRODUCERS", "ArtifactProducer", "OutputTensor", "SourceTensor", "make_producer"]

PRODUCERS: Mapping[str, type[ArtifactProducer]] = {
    CastProducer.name: CastProducer,
    TpSliceProducer.name: TpSliceProducer,
    Fp8PerTensorProducer.name: Fp8PerTensorProducer,
}


def make_producer(name: str, options: Mapping[str, Any]) -> ArtifactProducer:
    cls = PRODUCERS.get(name)
    if cls is None:
        raise InvalidRequest(f"unknown producer {str(name)[:40]!r} (one of {', '.join(sorted(PRODUCERS))})",
                             details={"field": "producer"})
    return cls.from_options(options)
