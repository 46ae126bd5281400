"""A fake of the CUDA boundary ``registration`` calls (``cudart.CudaRuntime``), with CUDA's rules.

It keeps what the real runtime keeps and fails where it fails (CUDA Runtime API, Memory
Management and Error Handling):

- a registration of pages that overlap a registered range returns
  ``cudaErrorHostMemoryAlreadyRegistered`` (712); unregistering an address that does not start
  a registered range returns ``cudaErrorHostMemoryNotRegistered`` (713);
- every failing call also sets the thread's *last error*, which stays until it is read;
  ``launch()`` is what torch does after every kernel launch (``cudaGetLastError`` and raise);
- a registration belongs to the device current when it was made (``on_device``), and without
  ``cudaHostRegisterPortable`` only that device sees the pages as pinned (``pinned_for``).

Faults are injected per call (``fail_register_at``/``fail_unregister``); nothing else is faked.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

ALREADY_REGISTERED = 712
NOT_REGISTERED = 713
NOT_SUPPORTED = 801
PORTABLE = 0x01
READ_ONLY = 0x08


@dataclass
class Registered:
    address: int
    length: int
    flags: int
    device: int


@dataclass
class FakeCudaRuntime:
    attributes: dict[int, int] = field(default_factory=dict)
    fail_register_at: set[int] = field(default_factory=set)  # call numbers (0-based) that fail
    fail_unregister: set[int] = field(default_factory=set)  # addresses whose unregister fails
    clearable: bool = True
    registered: list[Registered] = field(default_factory=list)
    calls: list[tuple[str, int, int]] = field(default_factory=list)  # (name, address, device)
    last_error: int = 0
    current: int = 0
    _register_calls: int = 0

    # ---- CudaRuntime
    def host_register(self, address: int, length: int, flags: int) -> int:
        self.calls.append(("register", address, self.current))
        number, self._register_calls = self._register_calls, self._register_calls + 1
        if number in self.fail_register_at:
            return self._fail(NOT_SUPPORTED)
        if any(r.address < address + length and address < r.address + r.length for r in self.registered):
            return self._fail(ALREADY_REGISTERED)
        self.registered.append(Registered(address, length, flags, self.current))
        return 0

    def host_unregister(self, address: int) -> int:
        self.calls.append(("unregister", address, self.current))
        if address in self.fail_unregister:
            return self._fail(NOT_SUPPORTED)
        for r in self.registered:
            if r.address == address:
                self.registered.remove(r)
                return 0
        return self._fail(NOT_REGISTERED)

    def clear_last_error(self) -> bool:
        if self.clearable:
            self.last_error = 0
        return self.last_error == 0

    def attribute(self, attribute: int, device: int) -> int | None:
        return self.attributes.get(attribute)

    @contextlib.contextmanager
    def on_device(self, device: int) -> Iterator[None]:
        previous, self.current = self.current, device
        try:
            yield
        finally:
            self.current = previous

    def current_device(self) -> int:
        return self.current

    # ---- what a test observes
    def _fail(self, error: int) -> int:
        self.last_error = error
        return error

    def launch(self) -> None:
        """A kernel launch as torch checks it: the pending last error raises (and is reset)."""
        error, self.last_error = self.last_error, 0
        if error:
            raise RuntimeError(f"CUDA error {error} reported at an unrelated kernel launch")

    def pinned_for(self, device: int, address: int, length: int) -> bool:
        """Whether ``device`` sees ``[address, address + length)`` as pinned host memory."""
        cursor, end = address, address + length
        while cursor < end:
            hit = next((r for r in self.registered if r.address <= cursor < r.address + r.length), None)
            if hit is None or not (hit.flags & PORTABLE or hit.device == device):
                return False
            cursor = hit.address + hit.length
        return True
