"""What sealing costs a client per request, without a service.

    python -m benchmarks.mac_client [--calls 100000] [--repeat 7] [--json FILE]

Times, best of ``--repeat`` runs of ``--calls`` calls each (so that a shared
machine's noise falls away): sealing a put1 request and opening its reply
with the C functions (domus._codec.seal_request, open_reply_to) and in
Python as the clients did before (struct and the C SipHash, as
domus.wire.auth did up to commit 411f646); then a whole C round
trip (domus._codec.roundtrip) on loopback UDP to a reply queued on the
client's socket before the call, so that it is found at once and what is
timed is the client's own work, syscalls included: insecure, sealed in
Python around the round trip (what the blocking client did before the C
round trip sealed), and sealed inside it (what it does now).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import time
import timeit
from collections.abc import Callable
from typing import Any

from domus import _codec as C
from domus.wire import auth
from domus.wire import protocol as wire

from .provenance import machine

KEY = bytes(range(16))
MESSAGE = wire.encode_keyed(wire.OP_PUT, 77, 0xC11E, 1, 0, b"\x01" + bytes(8),
                            b"\xcf" + bytes(8))
PLAIN_REPLY = wire.reply(wire.ST_OK, 77, b"\x01")
_U32, _U64 = struct.Struct(">I"), struct.Struct(">Q")


def seal_in_python(key: bytes, message: bytes, seconds: int) -> bytes:
    """auth.seal_request as it was written in Python."""
    stamp = _U32.pack(seconds)
    return message + stamp + _U64.pack(C.siphash24(key, message + stamp))


def open_in_python(key: bytes, datagram: bytes, request: bytes,
                   stamps: list[bytes]) -> bytes | None:
    """auth.open_reply_to as it was written in Python."""
    client_id = request[8:16]
    for stamp in reversed(stamps):
        if len(datagram) < 9:
            return None
        reply = datagram[:-8]
        if _U64.unpack_from(datagram, len(datagram) - 8)[0] == C.siphash24(
                key, reply + client_id + stamp):
            return reply
    return None


def best(function: Callable[[], Any], calls: int, repeat: int) -> float:
    """Microseconds per call, the best of ``repeat`` runs."""
    return min(timeit.repeat(function, number=calls, repeat=repeat)) / calls * 1e6


def measure(calls: int, repeat: int) -> dict[str, float]:
    sealed = C.seal_request(KEY, MESSAGE)
    stamps = [sealed[-12:-8]]
    reply = auth.seal_reply(KEY, PLAIN_REPLY, MESSAGE[8:16], stamps[0])
    results = {
        "seal_request C": best(lambda: C.seal_request(KEY, MESSAGE), calls, repeat),
        "seal_request Python": best(lambda: seal_in_python(KEY, MESSAGE, auth.now_seconds()),
                                    calls, repeat),
        "open_reply_to C": best(lambda: C.open_reply_to(KEY, reply, MESSAGE, stamps), calls,
                                repeat),
        "open_reply_to Python": best(lambda: open_in_python(KEY, reply, MESSAGE, stamps),
                                     calls, repeat),
    }
    service = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    service.bind(("127.0.0.1", 0))
    service.setblocking(False)
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.connect(service.getsockname())
    client.settimeout(0.25)             # (as a ServiceChannel leaves it)
    to_client, fd, wall_clock = client.getsockname(), client.fileno(), time.time
    sealed_replies: dict[int, bytes] = {}

    def sealed_reply(seconds: int) -> bytes:
        found = sealed_replies.get(seconds)
        if found is None:
            found = sealed_replies[seconds] = auth.seal_reply(
                KEY, PLAIN_REPLY, MESSAGE[8:16], seconds.to_bytes(4, "big"))
        return found

    def insecure() -> None:
        service.sendto(PLAIN_REPLY, to_client)
        C.roundtrip(fd, MESSAGE, 1.0, 0.0)

    def sealed_in_python() -> None:
        seconds = auth.now_seconds()
        service.sendto(sealed_reply(seconds), to_client)
        request = seal_in_python(KEY, MESSAGE, seconds)
        answer = C.roundtrip(fd, request, 1.0, 0.0)
        open_in_python(KEY, answer, MESSAGE, [request[-12:-8]])

    def sealed_in_c() -> None:
        seconds = int(wall_clock()) & 0xFFFFFFFF
        service.sendto(sealed_reply(seconds), to_client)
        C.roundtrip(fd, MESSAGE, 1.0, 0.0, KEY, seconds)

    def drained(function: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            function()
            try:
                service.recv(65536)
            except BlockingIOError:
                pass
        return run

    with service, client:
        for name, function in (("round trip insecure", insecure),
                               ("round trip sealed in Python", sealed_in_python),
                               ("round trip sealed in C", sealed_in_c)):
            results[name] = best(drained(function), calls // 10, repeat)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    load_at_start = [round(load, 2) for load in os.getloadavg()]
    results = measure(args.calls, args.repeat)
    print(f"client cost of the MAC, best of {args.repeat} (load average {load_at_start[0]:.1f}"
          f" at the start; the machine is shared)")
    for name, microseconds in results.items():
        print(f"  {name:30} {microseconds:6.2f} us")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as target:
            json.dump({"benchmark": "mac_client", **machine(),
                       "load_average_at_start": load_at_start, "calls": args.calls,
                       "repeat": args.repeat, "microseconds": results}, target, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
