"""A hostile gRPC client of hwrd, as a separate process; the test runs it as another uid
(``daemon_proc.as_user``). It prints one line ``result {json}``.

- ``flood SOCKET CALLS BYTES``: CALLS connections at once, each sending one request of BYTES
  bytes to ``GetStatus`` (the raw bytes of a protobuf whose first field claims to hold them),
  without a session token; the result counts the status codes the calls ended with.
- ``hold SOCKET CONNS``: CONNS connections to the gRPC socket, sending nothing; after a second
  the result counts those the daemon closed (``closed``) and those still open (``open``).
"""

from __future__ import annotations

import json
import select
import socket
import sys
import threading
import time

import grpc


def flood(sock: str, calls: int, nbytes: int) -> dict:
    body = b"\x0a" + b"\xff\xff\xff\xff\x0f" + b"x" * nbytes  # field 1, a length no message has
    codes: dict[str, int] = {}
    lock = threading.Lock()

    def one() -> None:
        with grpc.insecure_channel(f"unix:{sock}") as channel:
            try:
                channel.unary_unary("/hwr.v1.HostWeightRuntime/GetStatus")(body, timeout=120)
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
        with lock:
            codes[code] = codes.get(code, 0) + 1

    threads = [threading.Thread(target=one) for _ in range(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    return {"calls": calls, "codes": codes}


def hold(path: str, conns: int) -> dict:
    socks = []
    for _ in range(conns):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        socks.append(sock)
    time.sleep(1.0)
    codes: dict[str, int] = {}
    for sock in socks:
        readable, _, _ = select.select([sock], [], [], 0)
        try:
            closed = bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            closed = True
        code = "closed" if closed else "open"
        codes[code] = codes.get(code, 0) + 1
    for sock in socks:
        sock.close()
    return {"connections": conns, "codes": codes}


if __name__ == "__main__":
    mode, where, *numbers = sys.argv[1:]
    result = flood(where, int(numbers[0]), int(numbers[1])) if mode == "flood" else hold(where, int(numbers[0]))
    print("result " + json.dumps(result), flush=True)
