"""Garbage on a service's ports is counted and answered (or dropped), never
served as data and never fatal."""

from __future__ import annotations

import random
import socket
import struct
import time

import pytest

from domus.client import transport
from domus.errors import SupervisorError
from domus.service.handler import RequestHandler
from domus.wire import protocol as wire
from domus.wire import secret
from domus.wire.keys import encode_key

from .support import (
    LOOPBACK,
    RawUdp,
    bucket_of_key,
    first_difference,
    owner_of,
    service_addresses,
    wait_until,
)

SEED = 4242
DATAGRAMS = 10_000
RECORDS = 600
TARGET = "s2"
FAKE_DHT = 0xFFFFFFF0          # no such DHT, and 4 bytes away from any real one
SYNC_EVERY = 64                # datagrams between two round trips ...
SYNC_BYTES = 256 * 1024        # ... or bytes: the service's buffer never overflows
ALL_OPS = sorted(wire.OP_NAMES)
FRAME = struct.Struct(">I")


# ------------------------------------------------------------------ datagrams

class Garbage:
    """Seeded generator of bad datagrams.  Every datagram gets a fresh
    request id, so no two of them share a reply-cache token."""

    def __init__(self, rng: random.Random, client_id: int, dht_id: int,
                 owned: list[tuple[int, bytes]]) -> None:
        self.rng = rng
        self.client_id = client_id
        self.dht_id = dht_id            # the real DHT
        self.owned = owned              # (bucket, encoded key) of records the target stores
        self.request_id = 1_000_000
        self.kinds: dict[str, int] = {}

    def fresh_id(self) -> int:
        self.request_id += 1
        return self.request_id

    def valid(self, dht_id: int = FAKE_DHT) -> bytes:
        """A well-formed request of a random op (aimed at ``dht_id``)."""
        rng, rid, cid = self.rng, self.fresh_id(), self.client_id
        op = rng.choice(ALL_OPS)
        bucket = rng.randrange(256)
        key = encode_key(rng.choice([rng.randint(-10**6, 10**6), "kéy", rng.randbytes(9)]))
        value = wire.pack(rng.choice([None, 1.5, "v" * rng.randrange(40), [1, {"a": b"b"}]]))
        if op in (wire.OP_PUT,):
            return wire.encode_keyed(op, rid, cid, dht_id, bucket, key, value)
        if op in (wire.OP_GET, wire.OP_DELETE, wire.OP_CONTAINS):
            return wire.encode_keyed(op, rid, cid, dht_id, bucket, key)
        if op == wire.OP_PUT_MANY:
            entries = [(bucket, key, value)] * rng.randint(1, 5)
            return wire.encode_put_many(rid, cid, dht_id, entries)
        if op == wire.OP_GET_MANY:
            return wire.encode_get_many(rid, cid, dht_id, [(bucket, key)] * rng.randint(1, 5))
        if op == wire.OP_LENGTH:
            return wire.encode_length(rid, cid, dht_id)
        if op == wire.OP_SCAN:
            return wire.encode_scan(rid, cid, dht_id, bucket, 0, 0)
        if op == wire.OP_RANGE:
            return wire.encode_range(rid, cid, wire.RangeQuery(dht_id, key, None,
                                                               reverse=rng.random() < 0.5))
        if op == wire.OP_CONTROL:
            return wire.encode_control(rid, cid, {"op": "shutdown"})
        return wire.request_header(op, rid, cid)   # PING, STATS

    def mutate(self, data: bytes, changes: int) -> bytes:
        mutable = bytearray(data)
        for _ in range(changes):
            position = self.rng.randrange(len(mutable))
            mutable[position] = self.rng.randrange(256)
        return bytes(mutable)

    def header(self, op: int) -> bytes:
        return wire.request_header(op, self.fresh_id(), self.client_id)

    # -- the kinds of garbage, each a method returning one datagram
    def random_bytes(self) -> bytes:
        return self.rng.randbytes(self.rng.choice([0, 1, 7, 15, 16, 17, 25, 26, 100, 1400]))

    def truncated(self) -> bytes:
        data = self.valid()
        return data[:self.rng.randrange(len(data))]

    def mutated(self) -> bytes:
        return self.mutate(self.valid(), self.rng.randint(1, 3))

    def wrong_magic(self) -> bytes:
        data = bytearray(self.valid())
        data[0] = self.rng.choice([byte for byte in range(256) if byte != wire.REQUEST_MAGIC])
        return bytes(data)

    def wrong_version(self) -> bytes:
        data = bytearray(self.valid())
        data[1] = self.rng.choice([0, 2, 3, 0x7F, 0xFF])
        return bytes(data)

    def unknown_op(self) -> bytes:
        known = set(wire.OP_NAMES) - {wire.OP_CONTROL}   # CONTROL is not a UDP op
        op = self.rng.choice([op for op in range(256) if op not in known])
        return self.header(op) + self.rng.randbytes(self.rng.randrange(30))

    def oversized_lengths(self) -> bytes:
        rng = self.rng
        choice = rng.randrange(4)
        bucket, key = rng.choice(self.owned)
        if choice == 0:   # a key length past the end (aimed at a real record)
            op = rng.choice([wire.OP_PUT, wire.OP_GET, wire.OP_DELETE, wire.OP_CONTAINS])
            claimed = rng.choice([len(key) + 1, 0x7FFF, 0xFFFF])
            return self.header(op) + wire.KEYED.pack(self.dht_id, bucket, claimed) + key
        if choice == 1:   # put_many: an entry whose value length runs off the end
            entries = wire.PUT_ENTRY.pack(bucket, len(key), 0xFFFFFFFF) + key + b"overwrite"
            return self.header(wire.OP_PUT_MANY) + wire.BATCH.pack(self.dht_id, 1) + entries
        if choice == 2:   # put_many: a count far above the entries present
            entry = wire.PUT_ENTRY.pack(bucket, len(key), 3) + key + b"new"
            return (self.header(wire.OP_PUT_MANY) + wire.BATCH.pack(self.dht_id, 0xFFFF)
                    + entry * rng.randint(1, 20))
        # get_many with a huge count, or a zero-length key
        if rng.random() < 0.5:
            return (self.header(wire.OP_GET_MANY) + wire.BATCH.pack(self.dht_id, 0xFFFF)
                    + wire.GET_ENTRY.pack(bucket, len(key)) + key)
        return (self.header(wire.OP_PUT) + wire.KEYED.pack(self.dht_id, bucket, 0)
                + b"empty key")

    def broken_changes_to_real_records(self) -> bytes:
        """Requests that would overwrite or delete a stored record, if the
        service did not check them completely before acting."""
        rng = self.rng
        bucket, key = rng.choice(self.owned)
        choice = rng.randrange(4)
        if choice == 3:   # a put whose value is cut short, or padded past its length
            put = wire.encode_keyed(wire.OP_PUT, self.fresh_id(), self.client_id, self.dht_id,
                                    bucket, key, wire.pack("overwritten"))
            return put[:-rng.randint(1, 5)] if rng.random() < 0.5 else put + b"pad"
        if choice == 0:   # delete with stray bytes after the key
            return wire.encode_keyed(wire.OP_DELETE, self.fresh_id(), self.client_id,
                                     self.dht_id, bucket, key) + b"\x00"
        if choice == 1:   # a good entry, then a truncated one
            good = wire.encode_put_many(self.fresh_id(), self.client_id, self.dht_id,
                                        [(bucket, key, wire.pack("overwritten"))] * 2)
            return good[:-1]
        good = wire.encode_put_many(self.fresh_id(), self.client_id, self.dht_id,
                                    [(bucket, key, wire.pack("overwritten"))])
        return good + b"stray"

    def junk_60k(self) -> bytes:
        if self.rng.random() < 0.5:
            return self.rng.randbytes(60_000)
        return self.header(self.rng.choice(ALL_OPS)) + self.rng.randbytes(60_000 - 16)

    KINDS = ("random_bytes", "truncated", "mutated", "wrong_magic", "wrong_version",
             "unknown_op", "oversized_lengths", "broken_changes_to_real_records", "junk_60k")
    WEIGHTS = (20, 20, 25, 8, 8, 5, 6, 6, 2)

    def next(self) -> bytes:
        kind = self.rng.choices(self.KINDS, self.WEIGHTS)[0]
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        return getattr(self, kind)()


# ------------------------------------------------------------------ tests

@pytest.fixture
def stored(cluster):
    """A DHT with RECORDS records on the three services; its model."""
    dht = cluster.create_dht("target")
    model = {number: {"n": number, "blob": bytes([number % 256]) * (number % 50)}
             for number in range(RECORDS // 2)}
    model.update({f"ключ-{number}": [number, None, True] for number in range(RECORDS // 2)})
    dht.put_many(model)
    return dht, model


def assert_untouched(dht, model) -> None:
    assert first_difference(dict(dht.items()), model) == []
    assert first_difference(dht.get_many(list(model)), model) == []
    assert len(dht) == len(model)


@pytest.mark.timeout(180)
def test_ten_thousand_bad_datagrams(cluster, stored):
    dht, model = stored
    address = service_addresses(cluster)[TARGET]
    owned = [(bucket_of_key(dht, key), encode_key(key)) for key in target_keys(dht, model)]
    assert owned, "the target service stores none of the records"
    # The reference: the same handler code, with the same DHT hosted, fed the
    # same datagrams in the same order, says which of them are malformed.
    reference = RequestHandler(TARGET)
    reference.assign(cluster.open_dht("target").descriptor)

    with RawUdp(address) as raw:
        before = raw.stats()
        garbage = Garbage(random.Random(SEED), raw.client_id, dht.id, owned)
        pending_bytes = 0
        started = time.monotonic()
        for number in range(1, DATAGRAMS + 1):
            datagram = garbage.next()
            reference.handle(datagram)
            raw.send(datagram)
            pending_bytes += len(datagram) + 512
            if number % SYNC_EVERY == 0 or pending_bytes > SYNC_BYTES:
                raw.drain()
                raw.ping()     # answered only after everything sent before it
                pending_bytes = 0
        raw.ping()
        elapsed = time.monotonic() - started
        after = raw.stats()

    expected = reference.counters
    grew = {name: after[name] - before[name] for name in ("malformed", "errors", "replayed",
                                                          "internal_errors")}
    print(f"{DATAGRAMS} datagrams in {elapsed:.1f}s; the service counted {grew}; the "
          f"reference {expected}; kinds sent {garbage.kinds}")
    assert grew["internal_errors"] == expected["internal_errors"] == 0, "a datagram hit a bug"
    # Most are malformed; the rest are well formed but refused (no such DHT,
    # bucket not here), or harmless (a mutated ping is still a ping).
    assert expected["malformed"] >= 0.75 * DATAGRAMS, "the generator makes too few bad ones"
    assert expected["malformed"] + expected["errors"] >= 0.95 * DATAGRAMS
    assert grew["malformed"] == expected["malformed"]
    assert grew["errors"] == expected["errors"]
    assert after["requests"] - before["requests"] >= DATAGRAMS

    # Still serving, and no record changed.
    assert_untouched(dht, model)
    dht["after"] = "works"
    assert dht["after"] == "works"

    # The supervisor hears about it with the next heartbeat.
    def reported() -> bool:
        stats = {entry["name"]: entry["stats"] for entry in cluster.services()}[TARGET]
        return stats.get("malformed", 0) >= after["malformed"]

    wait_until(reported, timeout=15, what="the heartbeat to report the malformed count")


def target_keys(dht, model) -> list:
    return [key for key in model if owner_of(dht, key) == TARGET]


# ------------------------------------------------------------------ TCP

class RawTcp:
    """A bare TCP connection to a service; ``handshake``: it first proves
    it holds the deployment's secret (domus.wire.auth), and its frames are
    then sealed."""

    def __init__(self, address: str, handshake: bool = True) -> None:
        host, port = address.rsplit(":", 1)
        assert host == LOOPBACK
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.client_id = 77
        self.request_id = 0
        self.session = None
        if handshake:
            self.session = transport.handshake(self.sock, secret.keys(), f"service {address}")

    def close(self) -> None:
        self.sock.close()

    def send_frame(self, message: bytes) -> None:
        if self.session is not None:
            message = self.session.seal(message)
        self.sock.sendall(FRAME.pack(len(message)) + message)

    def recv_exactly(self, size: int) -> bytes:
        chunks = []
        while size:
            chunk = self.sock.recv(min(size, 1 << 20))
            if not chunk:
                raise ConnectionError("closed")
            chunks.append(chunk)
            size -= len(chunk)
        return b"".join(chunks)

    def recv_frame(self) -> bytes:
        (size,) = FRAME.unpack(self.recv_exactly(FRAME.size))
        frame = self.recv_exactly(size)
        return self.session.open(frame) if self.session is not None else frame

    def call(self, message: bytes) -> tuple[int, bytes]:
        self.send_frame(message)
        request_id = message[4:8]
        while True:
            frame = self.recv_frame()
            if frame[4:8] == request_id:
                return frame[2], frame[wire.REPLY_HEADER_SIZE:]

    def next_id(self) -> int:
        self.request_id += 1
        return self.request_id

    def closed_by_peer(self, timeout: float) -> bool:
        self.sock.settimeout(timeout)
        try:
            while self.sock.recv(65536):
                pass
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False
        return True


def tcp_get(address: str, dht, key) -> tuple[int, bytes]:
    tcp = RawTcp(address)
    try:
        return tcp.call(wire.encode_keyed(wire.OP_GET, tcp.next_id(), tcp.client_id, dht.id,
                                          bucket_of_key(dht, key), encode_key(key)))
    finally:
        tcp.close()


@pytest.mark.parametrize("claimed", [wire.MAX_FRAME_BYTES + 1, 0xFFFFFFFF])
def test_a_tcp_frame_over_the_limit_closes_only_that_connection(cluster, stored, claimed):
    dht, model = stored
    key = target_keys(dht, model)[0]
    address = service_addresses(cluster)[TARGET]
    with RawUdp(address) as raw:
        before = raw.stats()
    bystander = RawTcp(address)          # another client's connection, opened before
    offender = RawTcp(address, handshake=False)
    try:
        offender.sock.sendall(FRAME.pack(claimed) + b"\x00" * 1000)
        assert offender.closed_by_peer(timeout=10), "the service kept an oversized frame open"
        status, body = bystander.call(wire.encode_keyed(
            wire.OP_GET, bystander.next_id(), bystander.client_id, dht.id,
            bucket_of_key(dht, key), encode_key(key)))
        assert status == wire.ST_OK and wire.unpack(body) == model[key]
    finally:
        offender.close()
        bystander.close()
    status, body = tcp_get(address, dht, key)
    assert status == wire.ST_OK and wire.unpack(body) == model[key]
    with RawUdp(address) as raw:
        after = raw.stats()
        assert raw.ping()["name"] == TARGET
    assert after["oversized"] == before.get("oversized", 0) + 1
    assert_untouched(dht, model)


def test_bad_tcp_frames_are_answered_and_the_connection_keeps_working(cluster, stored):
    dht, model = stored
    key = target_keys(dht, model)[0]
    bucket, encoded = bucket_of_key(dht, key), encode_key(key)
    address = service_addresses(cluster)[TARGET]
    tcp = RawTcp(address)
    try:
        def get_stored() -> None:
            status, body = tcp.call(wire.encode_keyed(wire.OP_GET, tcp.next_id(), tcp.client_id,
                                                      dht.id, bucket, encoded))
            assert status == wire.ST_OK and wire.unpack(body) == model[key]

        tcp.send_frame(b"")                               # empty: ignored
        tcp.send_frame(b"\x42" * 40)                      # bad magic: dropped
        tcp.send_frame(b"\xd0\x01")                       # shorter than a header: dropped
        get_stored()
        bad_version = bytearray(wire.request_header(wire.OP_GET, tcp.next_id(), 1))
        bad_version[1] = 9
        status, _ = tcp.call(bytes(bad_version))
        assert status == wire.ST_BAD_VERSION
        status, _ = tcp.call(wire.request_header(wire.OP_DELETE, tcp.next_id(), 1)
                             + wire.KEYED.pack(dht.id, bucket, 0xFFFF) + encoded)
        assert status == wire.ST_MALFORMED
        status, _ = tcp.call(wire.encode_keyed(wire.OP_DELETE, tcp.next_id(), 1, dht.id, bucket,
                                               encoded) + b"stray")
        assert status == wire.ST_MALFORMED
        status, _ = tcp.call(wire.request_header(0x7E, tcp.next_id(), 1))
        assert status == wire.ST_UNKNOWN_OP
        # A control request with a body that is not msgpack, or not a map.
        status, _ = tcp.call(wire.request_header(wire.OP_CONTROL, tcp.next_id(), 1) + b"\xc1")
        assert status == wire.ST_CONTROL_ERROR
        status, _ = tcp.call(wire.request_header(wire.OP_CONTROL, tcp.next_id(), 1)
                             + wire.pack([1, 2]))
        assert status == wire.ST_CONTROL_ERROR
        get_stored()
    finally:
        tcp.close()
    assert_untouched(dht, model)


def test_clients_cannot_send_supervisor_commands_to_a_service(cluster, stored):
    dht, model = stored
    address = service_addresses(cluster)[TARGET]
    tcp = RawTcp(address)
    try:
        for body in ({"op": "shutdown"}, {"op": "drop", "id": dht.id},
                     {"op": "sync", "dhts": []}, {"op": "assign", "dht": {}}):
            status, reply = tcp.call(wire.encode_control(tcp.next_id(), 1, body))
            assert status == wire.ST_CONTROL_ERROR, body
            assert "only from the supervisor" in wire.unpack(reply)["message"]
        status, reply = tcp.call(wire.encode_control(tcp.next_id(), 1, {"op": "stats"}))
        assert status == wire.ST_OK and wire.unpack(reply)["name"] == TARGET
    finally:
        tcp.close()
    time.sleep(0.2)   # a shutdown, had it been obeyed, takes effect after 0.05 s
    with RawUdp(address) as raw:
        assert raw.ping()["name"] == TARGET
    assert_untouched(dht, model)


@pytest.mark.timeout(120)
def test_a_value_over_the_limit_sent_raw_is_refused_and_stores_nothing(cluster, stored):
    dht, model = stored
    key = "raw-oversized"
    address = service_addresses(cluster)[owner_of(dht, key)]
    tcp = RawTcp(address)
    try:
        message = wire.encode_keyed(wire.OP_PUT, tcp.next_id(), 1, dht.id,
                                    bucket_of_key(dht, key), encode_key(key),
                                    b"\x00" * (wire.MAX_VALUE_BYTES + 1))
        status, reply = tcp.call(message)
        assert status == wire.ST_TOO_LARGE, reply[:200]
    finally:
        tcp.close()
    assert key not in dht
    assert_untouched(dht, model)


# ------------------------------------------------------------------ the supervisor

BAD_CONTROL_CALLS = [
    ("register", {"name": 5, "address": "127.0.0.1:9", "resources": {}}),
    ("register", {"name": "", "address": "127.0.0.1:9", "resources": {}}),
    ("register", {"name": {"a": 1}, "address": "127.0.0.1:9", "resources": {}}),
    ("register", {"name": "junk1", "address": "nonsense", "resources": {}}),
    ("register", {"name": "junk2", "address": 5, "resources": {}}),
    ("register", {"name": "junk3", "address": "127.0.0.1:9", "resources": "x"}),
    ("register", {"name": "junk4", "address": "127.0.0.1:9", "resources": {1: 2, "a": 3}}),
    ("register", {"name": "junk5", "address": "127.0.0.1:9", "resources": {},
                  "version": b"\xff bytes"}),
    ("register", {"name": "junk6"}),
    ("create_dht", {"name": 5}),
    ("create_dht", {"name": "junk", "attributes": 5}),
    ("create_dht", {"name": "junk", "attributes": ["hash"]}),
    ("create_dht", {"name": "junk", "attributes": {"buckets": "64"}}),
    ("open_dht", {"name": [1]}),
    ("destroy_dht", {"name": {}}),
    ("dht_info", {}),
    ("heartbeat", {"name": "s1", "load": {}}),     # not from s1's own link
    ("remove_service", {"name": ["s1"]}),
    ("no_such_op", {}),
    ("__init__", {}),
]


@pytest.mark.timeout(120)
def test_malformed_control_calls_do_not_wedge_the_supervisor(deployment, cluster):
    dht = cluster.create_dht("before")
    dht.put_many({number: number for number in range(100)})
    for op, params in BAD_CONTROL_CALLS:
        with pytest.raises(SupervisorError):
            cluster.supervisor.call(op, **params)
        cluster.supervisor.close()   # a fresh link each time: no junk stays registered

    # Junk frames on the supervisor's port: answered or dropped, never fatal.
    junk = RawTcp(deployment.supervisor_address)
    try:
        junk.send_frame(b"\x42" * 30)
        junk.send_frame(b"")
        status, _ = junk.call(wire.encode_keyed(wire.OP_GET, 9, 1, 1, 0, b"\x03k"))
        assert status == wire.ST_UNKNOWN_OP
        status, _ = junk.call(wire.request_header(wire.OP_CONTROL, 10, 1) + b"\xc1")
        assert status == wire.ST_CONTROL_ERROR
        junk.sock.sendall(FRAME.pack(0xFFFFFFFF))
        assert junk.closed_by_peer(timeout=10)
    finally:
        junk.close()

    def healthy() -> None:
        assert sorted(entry["name"] for entry in cluster.services()) == ["s1", "s2", "s3"]
        assert [entry["name"] for entry in cluster.list_dhts()] == ["before"]
        assert cluster.status()["supervisor"]["address"] == deployment.supervisor_address
        assert cluster.open_dht("before").get_many(range(100)) == {n: n for n in range(100)}

    healthy()
    made = cluster.create_dht("after")
    made["x"] = 1
    cluster.destroy_dht("after")
    # What it saved is still readable by the next supervisor.
    deployment.stop_supervisor()
    assert deployment.supervisor.returncode == 0
    deployment.start_supervisor()
    wait_until(lambda: [e["state"] for e in cluster.services()] == ["up"] * 3, timeout=30,
               what="services to re-register")
    healthy()
