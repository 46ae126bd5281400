"""The client's choice of socket when none is given (``hwr.client.paths.pick_socket``, pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hwr.client.paths import pick_socket

OWN = Path("/run/user/1000/hwrd.sock")
SERVICE = Path("/run/hwrd/hwrd.sock")


@pytest.mark.parametrize(("hwr_socket", "own_present", "service_usable", "chosen", "looked"), [
    ("/x/hwrd.sock", True, True, Path("/x/hwrd.sock"), (Path("/x/hwrd.sock"),)),  # the variable wins
    (None, True, True, OWN, (OWN, SERVICE)),  # a user's own hwrd comes first
    (None, False, True, SERVICE, (OWN, SERVICE)),  # then the node's service
    (None, False, False, OWN, (OWN, SERVICE)),  # then the own default, for the error to name
    ("", False, True, SERVICE, (OWN, SERVICE)),  # an empty variable is unset
])
def test_the_order_of_the_places(hwr_socket: str | None, own_present: bool, service_usable: bool, chosen: Path,
                                 looked: tuple[Path, ...]) -> None:
    choice = pick_socket(hwr_socket, OWN, SERVICE, own_present=own_present, service_usable=service_usable)
    assert (choice.path, choice.looked) == (chosen, looked)


def test_root_looks_at_the_service_socket_only() -> None:
    choice = pick_socket(None, SERVICE, SERVICE, own_present=False, service_usable=False)
    assert choice.looked == (SERVICE,)
    assert choice.hint() == (f"looked at {SERVICE} ($HWR_SOCKET is unset): start hwrd, or set $HWR_SOCKET "
                             "(or --socket) to its socket")


def test_the_hint_of_an_explicit_socket_names_the_variable() -> None:
    choice = pick_socket("/x/hwrd.sock", OWN, SERVICE, own_present=False, service_usable=False)
    assert choice.hint() == "the socket named by $HWR_SOCKET"
