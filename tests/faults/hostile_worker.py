"""A hostile local client of hwrd's peer socket, as a separate process (stdlib only).

``python hostile_worker.py [--as-nobody] ATTACK PEER_SOCKET ARGS...`` speaks the peer framing by
hand (u32 big-endian length + JSON) the way a careless or malicious program would, prints
``ready`` once its attack is in place, waits for one line on stdin, then prints one line
``result {json}`` and exits (closing every connection). ``--as-nobody`` drops to uid/gid 65534
first (the test runs as root).

Attacks:

- ``unread KEY DIGEST CONNS REQUESTS``: CONNS sessions, each sending REQUESTS acquires of KEY
  (``have`` = DIGEST, so replies carry no manifest) without ever reading a reply.
- ``partial CONNS``: CONNS connections, each announcing a 1 MiB frame and sending all of it but
  one byte (as far as the daemon reads); the result counts the connections the daemon ended.
- ``hold CONNS``: CONNS connections held open; the result counts greetings by ``code``.
- ``named NAME KEY``: one session named NAME (terminal escape sequences, say) holding a lease
  on KEY, so that the operator's listings show the name.
"""

from __future__ import annotations

import json
import os
import select
import socket
import struct
import sys
import time

_LEN = struct.Struct(">I")
FRAME = 1 << 20


def frame(obj: dict) -> bytes:
    body = json.dumps(obj).encode()
    return _LEN.pack(len(body)) + body


def greeting(sock: socket.socket, timeout: float = 10.0) -> dict:
    sock.settimeout(timeout)
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        if not chunk:
            return {"ok": False, "code": "EOF"}
        head += chunk
    (n,) = _LEN.unpack(head)
    body = b""
    while len(body) < n:
        chunk = sock.recv(n - len(body))
        if not chunk:
            return {"ok": False, "code": "EOF"}
        body += chunk
    return json.loads(body)


def connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    return sock


def unread(path: str, key: str, digest: str, conns: int, requests: int) -> dict:
    socks, sent = [], 0
    request = frame({"op": "acquire", "key": key, "have": digest})
    for _ in range(conns):
        sock = connect(path)
        if not greeting(sock).get("ok"):
            continue
        sock.setblocking(False)
        socks.append(sock)
    deadline = time.monotonic() + 20
    pending = {s: requests for s in socks}
    while pending and time.monotonic() < deadline:
        for sock in list(pending):
            try:
                sock.send(request)  # a 100-byte frame goes whole or not at all here
                sent += 1
                pending[sock] -= 1
                if not pending[sock]:
                    del pending[sock]
            except BlockingIOError:
                pass
            except OSError:
                del pending[sock]
        time.sleep(0.001)
    ready()
    return {"connections": len(socks), "sent": sent, "_keep": socks}


def partial(path: str, conns: int) -> dict:
    socks = []
    for _ in range(conns):
        sock = connect(path)
        if greeting(sock).get("ok"):
            sock.setblocking(False)
            socks.append(sock)
    left = {s: FRAME - 1 for s in socks}
    head = _LEN.pack(FRAME)
    for sock in socks:
        sock.send(head)
    chunk = b"x" * (64 << 10)
    deadline = time.monotonic() + 8
    while left and time.monotonic() < deadline:
        _, writable, _ = select.select([], list(left), [], 0.2)
        for sock in writable:
            try:
                left[sock] -= sock.send(chunk[:min(len(chunk), left[sock])])
            except OSError:
                left.pop(sock)
                continue
            if left[sock] <= 0:
                left.pop(sock)
    ready()
    return {"connections": len(socks), "fully_sent": len(socks) - len(left), "_keep": socks,
            "_watch": True}


def hold(path: str, conns: int) -> dict:
    socks, codes = [], {}
    for _ in range(conns):
        try:
            sock = connect(path)
        except OSError as exc:
            codes[type(exc).__name__] = codes.get(type(exc).__name__, 0) + 1
            continue
        socks.append(sock)
    deadline = time.monotonic() + 5.0  # one bound for all: a silent daemon costs 5 s, not 5 s each
    for sock in socks:
        try:
            g = greeting(sock, max(0.01, deadline - time.monotonic()))
            code = "ok" if g.get("ok") else str(g.get("code"))
        except OSError as exc:
            code = type(exc).__name__
        codes[code] = codes.get(code, 0) + 1
    ready()
    return {"connections": len(socks), "codes": codes, "_keep": socks}


def named(path: str, name: str, key: str) -> dict:
    import array

    sock = connect(path)
    greeting(sock)
    sock.sendall(frame({"op": "hello", "client_name": name, "client_version": name[:16]}))
    hello = greeting(sock)
    sock.sendall(frame({"op": "acquire", "key": key, "have": "0" * 64}))
    fds = array.array("i")
    _msg, ancdata, _flags, _addr = sock.recvmsg(1, socket.CMSG_SPACE(64 * fds.itemsize))
    for _level, _kind, data in ancdata:
        fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    for fd in fds:
        os.close(fd)
    ready()
    return {"named": bool(hello.get("ok")), "descriptors": len(fds), "_keep": [sock]}


def ended_by_daemon(socks: list[socket.socket]) -> int:
    """How many of ``socks`` the daemon has closed (EOF or reset)."""
    count = 0
    for sock in socks:
        try:
            sock.setblocking(False)
            data = sock.recv(1 << 16)
            while data:
                data = sock.recv(1 << 16)
            count += 1
        except BlockingIOError:
            pass
        except OSError:
            count += 1
    return count


def ready() -> None:
    print("ready", flush=True)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--as-nobody":
        os.setgid(65534)
        os.setgroups([])
        os.setuid(65534)
        argv = argv[1:]
    attack, path, *args = argv
    if attack == "unread":
        result = unread(path, args[0], args[1], int(args[2]), int(args[3]))
    elif attack == "partial":
        result = partial(path, int(args[0]))
    elif attack == "hold":
        result = hold(path, int(args[0]))
    elif attack == "named":
        result = named(path, args[0], args[1])
    else:
        raise SystemExit(f"unknown attack {attack!r}")
    sys.stdin.readline()  # the test's go-ahead: it has checked the innocent clients meanwhile
    socks = result.pop("_keep")
    if result.pop("_watch", False):
        result["ended_by_daemon"] = ended_by_daemon(socks)
    print("result " + json.dumps(result), flush=True)
    for sock in socks:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
