"""Helpers shared by the integration tests: bounded polling, where a key
lives, and raw requests to a service (no client library in between)."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import struct
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from domus.client.blocking import Dht
from domus.client.transport import ServiceChannel
from domus.placement import assignment
from domus.wire import address as addresses
from domus.wire import auth, secret
from domus.wire import protocol as wire
from domus.wire.keys import bucket_of, encode_key

LOOPBACK = "127.0.0.1"
HEARTBEAT = 0.2          # seconds between service heartbeats in test deployments
# The supervisor's patience in test deployments (5 s and 10 s by default):
# ten missed heartbeats make a service unresponsive, and a service has 4 s
# to acknowledge a change, so tests of a silent service wait that long only.
DOWN_AFTER = 2.0
PUSH_TIMEOUT = 4.0
CLIENT_TIMEOUT = 5.0     # what a test client waits at most for one answer
T = TypeVar("T")


def wait_until(predicate: Callable[[], T], *, timeout: float, interval: float = 0.05,
               what: str = "condition") -> T:
    """Poll ``predicate`` until it returns something truthy and return that;
    fail the test after ``timeout`` seconds, saying what was awaited and what
    the last attempt returned (or raised)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = predicate()
        except Exception as exc:  # a transient error counts as "not yet"
            last = exc
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; "
                                 f"last result: {last!r}")
        time.sleep(interval)


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP process ``pid`` and return once every one of its threads has
    stopped: kill returns before that, and a service's C serving thread may
    still answer a request it was handling (a "hung" service that answers
    makes a test of hung services pass or fail by chance)."""
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: all_threads_stopped(pid), timeout=timeout,
               what=f"every thread of process {pid} to be stopped")


def all_threads_stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped (state T)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat", encoding="ascii") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:       # (a thread that ended meanwhile)
            continue
        if state not in ("T", "t"):
            return False
    return True


# ------------------------------------------------------------------ placement

def bucket_of_key(dht: Dht, key: Any) -> int:
    return bucket_of(encode_key(key), dht.descriptor["hash"], dht.bucket_count)


def owner_of(dht: Dht, key: Any) -> str:
    """The service storing ``key``, by the documented placement rule (what
    the direct lookup rebuilds from the per-service counts)."""
    storage = dht.descriptor["storage_services"]
    owners = assignment.placement([entry["count"] for entry in storage])
    return storage[owners[bucket_of_key(dht, key)]]["name"]


def keys_on(dht: Dht, service: str, count: int, prefix: str = "k") -> list[str]:
    """``count`` distinct str keys whose bucket ``service`` stores."""
    found = []
    for number in itertools.count():
        key = f"{prefix}-{number}"
        if owner_of(dht, key) == service:
            found.append(key)
            if len(found) == count:
                return found
        if number > 100_000 + 1000 * count:
            raise AssertionError(f"no keys of {dht.name!r} land on {service}")
    raise AssertionError("unreachable")


def service_addresses(cluster: Any) -> dict[str, str]:
    return {entry["name"]: entry["address"] for entry in cluster.services()}


# ------------------------------------------------------------------ raw requests

class RawUdp:
    """A bare UDP socket to one service, for hand-built datagrams: sealed
    with the deployment's data key (found as every process finds it:
    $DOMUS_SECRET_FILE, which the fixtures set) unless ``keys`` says
    otherwise (False: none); ``send_unsealed`` sends one as it is."""

    def __init__(self, address: str, keys: secret.Keys | None | bool = True) -> None:
        host, port = addresses.parse(address)
        assert host == LOOPBACK, f"integration tests stay on {LOOPBACK}, not {host}"
        self.address = (host, port)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
        self.sock.bind((LOOPBACK, 0))
        self.client_id = int.from_bytes(os.urandom(8), "big")
        self._ids = itertools.count(1)
        if keys is True:
            keys = secret.keys()
        self.key = keys.data if isinstance(keys, secret.Keys) else None

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawUdp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def next_id(self) -> int:
        return next(self._ids) & 0xFFFFFFFF

    def send(self, datagram: bytes) -> bytes:
        """Send ``datagram`` (sealed, on a secure deployment); the time it
        was sealed with (b"": not sealed)."""
        if self.key is None:
            self.sock.sendto(datagram, self.address)
            return b""
        sealed = auth.seal_request(self.key, datagram)
        self.sock.sendto(sealed, self.address)
        return sealed[-12:-8]

    def send_unsealed(self, datagram: bytes) -> None:
        self.sock.sendto(datagram, self.address)

    def opened(self, data: bytes, request: bytes, stamps: list[bytes]) -> bytes | None:
        """``data`` as the reply to ``request`` (sent with ``stamps``), its
        MAC checked and taken off; None if it does not check."""
        if self.key is None:
            return data
        for stamp in stamps:
            reply = auth.open_reply(self.key, data, request[8:16], stamp)
            if reply is not None:
                return reply
        return None

    def drain(self) -> int:
        """Throw away every reply waiting on the socket; how many there were."""
        drained = 0
        self.sock.setblocking(False)
        try:
            while True:
                try:
                    self.sock.recv(65536)
                except (BlockingIOError, ConnectionRefusedError):
                    return drained
                drained += 1
        finally:
            self.sock.setblocking(True)

    def call(self, op: int, body: bytes = b"", *, timeout: float = 5.0) -> tuple[int, bytes]:
        """Send a request with a fresh id, retrying until its reply comes;
        return (status, reply body).  Replies to other datagrams are skipped."""
        request_id = self.next_id()
        message = wire.request_header(op, request_id, self.client_id) + body
        deadline = time.monotonic() + timeout
        wait = 0.1
        stamps: list[bytes] = []
        while True:
            stamps.append(self.send(message))
            resend_at = time.monotonic() + wait
            while True:
                left = min(resend_at, deadline) - time.monotonic()
                if left <= 0:
                    break
                self.sock.settimeout(left)
                try:
                    data = self.sock.recv(65536)
                except TimeoutError:
                    break
                data = self.opened(data, message, stamps) or b""
                if (len(data) >= wire.REPLY_HEADER_SIZE and data[0] == wire.REPLY_MAGIC
                        and wire.U32.unpack_from(data, 4)[0] == request_id):
                    if data[2] == wire.ST_BUSY:
                        break               # (overloaded: sent again, as clients do)
                    if data[2] == wire.ST_REPLY_TOO_LARGE:
                        # (an insecure deployment bounds UDP replies: over TCP)
                        data = self.over_tcp(message, timeout)
                    return data[2], data[wire.REPLY_HEADER_SIZE:]
            if time.monotonic() >= deadline:
                raise AssertionError(f"service at {self.address} did not answer op "
                                     f"0x{op:02x} within {timeout}s")
            wait = min(wait * 2, 1.0)

    def over_tcp(self, message: bytes, timeout: float) -> bytes:
        host, port = self.address
        channel = ServiceChannel("raw", f"{host}:{port}", deadline=timeout,
                                 keys=secret.keys() if self.key is not None else None)
        try:
            return channel.request_tcp(message)
        finally:
            channel.close()

    def stats(self, timeout: float = 5.0) -> dict[str, Any]:
        status, body = self.call(wire.OP_STATS, timeout=timeout)
        assert status == wire.ST_OK, f"STATS answered status 0x{status:02x}"
        return wire.unpack(body)

    def ping(self, timeout: float = 5.0) -> dict[str, Any]:
        status, body = self.call(wire.OP_PING, timeout=timeout)
        assert status == wire.ST_OK, f"PING answered status 0x{status:02x}"
        return wire.unpack(body)


def service_stats(address: str, timeout: float = 5.0) -> dict[str, Any]:
    """A service's counters, straight from it (OP_STATS over UDP)."""
    with RawUdp(address) as raw:
        return raw.stats(timeout)


def records_held(stats: dict[str, Any], dht: str) -> int:
    held = stats.get("dhts", {}).get(dht)
    return held["records"] if held else 0


def same_value(left: Any, right: Any) -> bool:
    """Equality that also compares types (so 1 != 1.0 != True, b"" != "")."""
    if type(left) is not type(right):
        return False
    if isinstance(left, list):
        return len(left) == len(right) and all(map(same_value, left, right))
    if isinstance(left, dict):
        if len(left) != len(right):
            return False
        typed_right = {(type(key), key): value for key, value in right.items()}
        return all((type(key), key) in typed_right
                   and same_value(value, typed_right[(type(key), key)])
                   for key, value in left.items())
    return left == right


def first_difference(actual: dict[Any, Any], expected: dict[Any, Any],
                     limit: int = 5) -> list[str]:
    """Up to ``limit`` human-readable differences between two mappings."""
    problems = []
    for key in expected.keys() - actual.keys():
        problems.append(f"missing {key!r}")
    for key in actual.keys() - expected.keys():
        problems.append(f"unexpected {key!r} = {actual[key]!r:.80}")
    for key in expected.keys() & actual.keys():
        if not same_value(actual[key], expected[key]):
            problems.append(f"{key!r}: got {actual[key]!r:.80}, expected {expected[key]!r:.80}")
    return problems[:limit]


def chunks(items: Iterable[T], size: int) -> Iterable[list[T]]:
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class RawControl:
    """A hand-made control connection over a plain socket, on an insecure
    deployment (the handshake without a secret), either end: ``connect``
    to a supervisor, or ``accept`` a service's link (a hand-built
    supervisor).  ``call`` sends a control request and returns the reply
    (ok, body); requests the far end sends meanwhile (a service's
    heartbeats, a supervisor's pings) are kept in ``requests``, and answered
    with ``answer(op, body)`` if it is set."""

    FRAME = struct.Struct(">I")

    def __init__(self, sock: socket.socket, *, accepting: bool) -> None:
        self.sock = sock
        self.sock.settimeout(10)
        self.requests: list[tuple[int, dict[str, Any]]] = []
        self.answer: Callable[[str, dict[str, Any]], Any] | None = None
        self._ids = itertools.count(1)
        self.client_id = int.from_bytes(os.urandom(8), "big")
        if accepting:
            handshake = auth.Accepting(None)
            self.send_frame(handshake.hello())
            accept, _session = handshake.proof(self.read_frame())
            self.send_frame(accept)
        else:
            connecting = auth.Connecting(None, "raw peer")
            self.send_frame(connecting.hello(self.read_frame()))
            connecting.verdict(self.read_frame())

    @classmethod
    def connect(cls, address: str) -> RawControl:
        host, port = addresses.parse(address)
        return cls(socket.create_connection((host, port), timeout=10), accepting=False)

    def send_frame(self, frame: bytes) -> None:
        self.sock.sendall(self.FRAME.pack(len(frame)) + frame)

    def read_frame(self) -> bytes:
        header = self._read(4)
        return self._read(self.FRAME.unpack(header)[0])

    def _read(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = self.sock.recv(size - len(data))
            if not chunk:
                raise ConnectionError("the peer closed the connection")
            data += chunk
        return data

    def call(self, op: str, **params: Any) -> tuple[bool, Any]:
        return self.call_body({"op": op, **params})

    def call_body(self, body: Any) -> tuple[bool, Any]:
        request_id = next(self._ids)
        self.send_frame(wire.request_header(wire.OP_CONTROL, request_id, self.client_id)
                        + wire.pack(body))
        return self.reply_to(request_id)

    def send_raw(self, payload: bytes) -> tuple[bool, Any]:
        """A control request whose body is ``payload`` as it is."""
        request_id = next(self._ids)
        self.send_frame(wire.request_header(wire.OP_CONTROL, request_id, self.client_id)
                        + payload)
        return self.reply_to(request_id)

    def reply_to(self, request_id: int) -> tuple[bool, Any]:
        while True:
            frame = self.read_frame()
            if frame[0] == wire.REPLY_MAGIC:
                status, answered = wire.decode_reply_header(frame)
                if answered != request_id:
                    continue
                body = wire.unpack(frame[wire.REPLY_HEADER_SIZE:]) \
                    if len(frame) > wire.REPLY_HEADER_SIZE else None
                return status == wire.ST_OK, body
            self._request(frame)

    def _request(self, frame: bytes) -> None:
        _op, request_id, _client = wire.decode_request_header(frame)
        body = wire.decode_control(frame)
        self.requests.append((request_id, body))
        if self.answer is not None:
            result = self.answer(body["op"], body)
            self.send_frame(wire.reply(wire.ST_OK, request_id, wire.pack(result)))

    def next_request(self, op: str, timeout: float = 10.0) -> dict[str, Any]:
        """Wait for the far end's next request ``op`` (its id is then
        ``last_request_id``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for index, (request_id, body) in enumerate(self.requests):
                if body["op"] == op:
                    del self.requests[index]
                    self.last_request_id = request_id
                    return body
            frame = self.read_frame()
            if frame[0] != wire.REPLY_MAGIC:
                self._request(frame)
        raise AssertionError(f"no {op} request within {timeout}s")

    def close(self) -> None:
        self.sock.close()
