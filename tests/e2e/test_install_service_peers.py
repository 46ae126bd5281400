"""``hwrd install-service`` widens the unit's sandbox for the peer tier, and only for it.

Under ``--prefix`` (no root, no systemd), as ``tests/e2e/test_install_service.py`` does for the
remote: the drop-in's lines for ``fleet_peer_serve``/``fleet_peer_fetch``, one address-family
line when a remote needs the network too, an interpreter the unit would hide refused, and the
unit with its drop-in accepted by ``systemd-analyze verify``. ``AF_NETLINK`` is needed, not
merely convenient: ``test_the_transfer_process_needs_netlink`` starts the real transfer process
under a seccomp filter that refuses the other address families as ``RestrictAddressFamilies=``
does. The unit itself running it under systemd is ``scripts/systemd-test.sh``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)
HWRD = [sys.executable, "-m", "hwr.daemon.app.main"]
UNIT_DIR = Path("etc/systemd/system")
DROPIN = UNIT_DIR / "hwrd.service.d/remote.conf"
SERVING = ('fleet_peer_serve = true\nfleet_peer_fetch = true\nfleet_peer_listen = "10.0.3.17:7461"\n'
           'fleet_peer_secret_file = "/etc/hwrd/fleet.secret"\n')


def install(prefix: Path, config: str) -> subprocess.CompletedProcess[str]:
    path = prefix / "etc/hwrd/hwrd.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config)
    return subprocess.run([*HWRD, "install-service", "--prefix", str(prefix), "--hwrd",
                           str(Path(sys.executable).parent / "hwrd")],
                          capture_output=True, text=True, timeout=120, check=False)


def service_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def test_the_peer_tier_gets_the_network_and_netlink_and_nothing_else(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    remote.mkdir()
    result = install(tmp_path, f'remote = "file://{remote}"\n{SERVING}fleet_peer_python = "/opt/peers/bin/python"\n')
    assert result.returncode == 0, result.stderr
    text = (tmp_path / DROPIN).read_text()
    assert service_lines(text) == ["[Service]", "PrivateNetwork=no",
                                   "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
                                   f"ReadWritePaths={remote}"]
    comment = " ".join(line[2:] for line in text.splitlines() if line.startswith("# "))
    assert "TCP port 7461 inbound" in comment and "/opt/peers/bin/python" in comment and "AF_NETLINK" in comment

    # Fetching only: no inbound port; with an s3:// remote, still one address-family line.
    assert install(tmp_path, 'remote = "s3://bucket/fleet"\nfleet_peer_fetch = true\n'
                             'fleet_peer_secret_file = "/etc/hwrd/fleet.secret"\n').returncode == 0
    text = (tmp_path / DROPIN).read_text()
    assert service_lines(text) == ["[Service]", "PrivateNetwork=no",
                                   "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK"]
    assert "inbound" not in text and "hwrd's own Python" in text

    # The peer tier off again: the remote's own lines, without netlink.
    assert install(tmp_path, 'remote = "s3://bucket/fleet"\nfleet_peer_serve = false\n').returncode == 0
    assert service_lines((tmp_path / DROPIN).read_text()) == [
        "[Service]", "PrivateNetwork=no", "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6"]


def test_the_fleets_networks_become_ip_address_allow_when_only_peers_use_the_network(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    remote.mkdir()
    networks = 'fleet_peer_networks = ["10.0.3.17/24", "fd00::/64"]\n'
    assert install(tmp_path, f'remote = "file://{remote}"\n{SERVING}{networks}').returncode == 0
    lines = service_lines((tmp_path / DROPIN).read_text())
    assert lines[3:5] == ["IPAddressDeny=any", "IPAddressAllow=localhost 10.0.3.0/24 fd00::/64"], lines

    # An s3:// remote (or a TCP metrics port) needs addresses outside them: hwrd alone enforces them.
    assert install(tmp_path, f'remote = "s3://bucket/fleet"\n{SERVING}{networks}').returncode == 0
    text = (tmp_path / DROPIN).read_text()
    assert "IPAddress" not in "".join(service_lines(text)) and "enforced by hwrd only" in text

    refused = install(tmp_path, f'remote = "s3://bucket/fleet"\n{SERVING}fleet_peer_networks = ["10.0.3/24"]\n')
    assert refused.returncode == 1 and "fleet_peer_networks" in refused.stderr


@pytest.mark.parametrize("python", ["/tmp/peers/bin/python", "/var/tmp/venv/bin/python3"])
def test_an_interpreter_the_unit_hides_is_refused(tmp_path: Path, python: str) -> None:
    result = install(tmp_path, f'remote = "s3://bucket/fleet"\n{SERVING}fleet_peer_python = "{python}"\n')
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and python in result.stderr and "PrivateTmp" in result.stderr


def test_an_interpreter_linked_into_tmp_is_refused(tmp_path: Path) -> None:
    hidden = Path("/tmp") / f"hwr-peer-python-{os.getpid()}"
    hidden.write_text("")
    link = tmp_path / "python"
    link.symlink_to(hidden)
    try:
        result = install(tmp_path, f'remote = "s3://bucket/fleet"\n{SERVING}fleet_peer_python = "{link}"\n')
    finally:
        hidden.unlink()
    assert result.returncode == 1 and "PrivateTmp" in result.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_the_unit_with_the_peer_dropin_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    remote.mkdir()
    assert install(tmp_path, f'remote = "file://{remote}"\n{SERVING}fleet_peer_networks = ["10.0.3.0/24"]\n'
                   ).returncode == 0
    assert "IPAddressAllow=" in (tmp_path / DROPIN).read_text()
    units = tmp_path / UNIT_DIR
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", str(units / "hwrd.service"),
                             str(units / "hwrd.socket")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr  # drop-ins are read: no warning


def _seccomp_wrapper(tmp_path: Path) -> Path | None:
    """A tiny C program that execs its command with socket(2) refused (EAFNOSUPPORT) for every
    address family but the listed ones, as RestrictAddressFamilies= does; None without a C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or os.uname().machine != "x86_64":
        return None
    source = tmp_path / "restrict_af.c"
    source.write_text(r"""
#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(int argc, char **argv) {
    int allowed[16], n = 0, i = 0;
    for (char *s = strtok(argv[1], ","); s && n < 16; s = strtok(NULL, ",")) allowed[n++] = atoi(s);
    struct sock_filter f[32];
    f[i++] = (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr));
    f[i++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_socket, 1, 0);
    f[i++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
    f[i++] = (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[0]));
    for (int k = 0; k < n; k++)
        f[i++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, allowed[k], (unsigned)(n - k), 0);
    f[i++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EAFNOSUPPORT);
    f[i++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
    struct sock_fprog prog = {.len = (unsigned short)i, .filter = f};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog)) {
        perror("seccomp");
        return 1;
    }
    execvp(argv[2], argv + 2);
    perror("exec");
    return 1;
}
""")
    binary = tmp_path / "restrict_af"
    subprocess.run([cc, "-O", "-o", str(binary), str(source)], check=True, timeout=120)
    return binary


def _agent_starts(wrapper: Path, families: list[int]) -> tuple[bool, str]:
    """Whether the transfer process answers ``hello`` under ``families`` (and what it logged)."""
    from hwr.daemon.fleet import peer_wire

    env = {**os.environ, "NIXL_LOG_LEVEL": "WARN", "UCX_TLS": "tcp"}
    proc = subprocess.Popen([str(wrapper), ",".join(map(str, families)), sys.executable, "-m",
                             "hwr.daemon.fleet.peer_agent", "sandbox-probe"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(peer_wire.encode({"id": 1, "op": "hello"}))
        proc.stdin.flush()
        length = int.from_bytes(proc.stdout.read(4), "big")
        reply = peer_wire.decode(proc.stdout.read(length))
        proc.stdin.close()
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.stderr is not None
    return "metadata" in reply, proc.stderr.read().decode(errors="replace")


@pytest.mark.skipif(importlib.util.find_spec("nixl_cu12") is None, reason="needs the peers extra (nixl-cu12)")
def test_the_transfer_process_needs_netlink(tmp_path: Path) -> None:
    wrapper = _seccomp_wrapper(tmp_path)
    if wrapper is None:
        pytest.skip("needs a C compiler on x86-64 for the seccomp filter")
    base = [socket.AF_UNIX, socket.AF_INET, socket.AF_INET6]
    started, log = _agent_starts(wrapper, [*base, socket.AF_NETLINK])
    assert started, log
    started, log = _agent_starts(wrapper, base)  # what the drop-in would allow without AF_NETLINK
    assert not started and "no usable transports" in log, log
