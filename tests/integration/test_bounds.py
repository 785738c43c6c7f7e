"""Issue 15, point 6: every exhaustion case tried from outside, against a
real service process on 127.0.0.1, on a secure deployment (an authenticated
but hostile or buggy client must not exhaust a service either, and some
cases need no secret at all) and on an --insecure one.  Each test shows that
the service's memory (psutil RSS) stays bounded and that it keeps serving
another client meanwhile.

The service runs with short timeouts and small caps (its options), so that
the tests reach them quickly; docs/operations.md (Bounds) has the defaults.
"""

from __future__ import annotations

import os
import socket
import struct
import time

import psutil
import pytest

from domus.client.transport import _send_frame, handshake
from domus.wire import protocol as wire
from domus.wire import secret
from domus.wire.keys import encode_key

from .conftest import _stop_all, own_secret_variable, start_deployment
from .support import (
    CLIENT_TIMEOUT,
    RawUdp,
    bucket_of_key,
    service_stats,
    wait_until,
)

MiB = 1 << 20
FRAME = struct.Struct(">I")
IDLE = 2.0              # --idle-timeout and --write-timeout of the service
MAX_PER_HOST = 24       # --max-connections-per-host
INPUT_BUDGET = 24 * MiB
MAX_SCAN_KEYS = 120_000
HOSTILE = "127.0.0.2"
SERVICE_ARGS = ("--idle-timeout", str(IDLE), "--write-timeout", str(IDLE),
                "--max-connections-per-host", str(MAX_PER_HOST),
                "--input-budget", str(INPUT_BUDGET), "--max-scan-keys", str(MAX_SCAN_KEYS))


@pytest.fixture(scope="module", params=["secure", "insecure"])
def bounded(request, tmp_path_factory):
    """One service (s1) with tight bounds, and a DHT of one bucket on it."""
    with own_secret_variable():
        deployment = start_deployment(tmp_path_factory.mktemp(request.param), services=1,
                                      service_args=SERVICE_ARGS,
                                      insecure=request.param == "insecure")
        try:
            with deployment.connect(timeout=CLIENT_TIMEOUT) as cluster:
                cluster.create_dht("bounded", buckets=1)
            yield deployment
        finally:
            _stop_all(deployment)


@pytest.fixture
def cluster(bounded):
    with bounded.connect(timeout=CLIENT_TIMEOUT) as connected:
        yield connected


def rss(deployment) -> int:
    return psutil.Process(deployment.services["s1"].pid).memory_info().rss


def address(deployment) -> str:
    return deployment.service_address(0)


def keys_of(deployment):
    return secret.keys(deployment.secret_file) if deployment.secret_file else None


def still_serves(cluster, tag: str) -> None:
    """Another client is served meanwhile, reads and writes."""
    dht = cluster.open_dht("bounded")
    dht[f"alive-{tag}"] = tag
    assert dht[f"alive-{tag}"] == tag


def stat(deployment, name: str) -> int:
    return service_stats(address(deployment)).get(name, 0)


def connect_raw(deployment, authenticate: bool = True):
    """A TCP connection to s1, past the handshake (``authenticate``), and
    its session (None: insecure, or not authenticated)."""
    host, port = address(deployment).split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    session = None
    if authenticate:
        session = handshake(sock, keys_of(deployment), f"service s1 ({host}:{port})")
    return sock, session


def closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """Whether the service closes the connection within ``timeout`` (what
    it sent meanwhile is read and thrown away)."""
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not sock.recv(1 << 20):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return False


# ------------------------------------------------------------ TCP output

def test_a_connection_that_never_reads_stops_getting_replies_and_is_dropped(bounded, cluster):
    # Issue 15: after one 8 MiB value was stored, 60 GETs of 38 bytes on a
    # connection that never read took the service from 59 to 547 MiB.
    dht = cluster.open_dht("bounded")
    dht["big"] = b"x" * (8 * MiB)
    before = rss(bounded)
    sock, session = connect_raw(bounded)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    dropped = stat(bounded, "tcp_slow_readers")
    bucket = bucket_of_key(dht, "big")
    for request_id in range(1, 61):
        _send_frame(sock, wire.encode_keyed(wire.OP_GET, request_id, 77, dht.id, bucket,
                                            encode_key("big")), session)
    peak = before
    deadline = time.monotonic() + IDLE + 10
    while stat(bounded, "tcp_slow_readers") == dropped:
        peak = max(peak, rss(bounded))
        still_serves(cluster, "slow-reader")
        assert time.monotonic() < deadline, "the slow reader was never dropped"
    # At most the high-water mark (4 MiB) and one reply: not 60 replies.
    assert peak - before < 40 * MiB, f"RSS grew by {(peak - before) / MiB:.0f} MiB"
    assert closed_by_peer(sock, 5)
    sock.close()
    still_serves(cluster, "after-slow-reader")


# ------------------------------------------------------------ TCP input and count

def test_partial_frames_are_bounded_by_the_caps_the_budget_and_the_idle_timeout(bounded, cluster):
    # Issue 15: partial 16 MiB frames were buffered per connection with no
    # cap on connections and no idle timeout.  (No handshake: a peer
    # without the secret holds a partial frame as well as one with it.)
    before = rss(bounded)
    counts = {name: stat(bounded, name) for name in ("tcp_refused", "tcp_input_overflows",
                                                      "tcp_idle_closed")}
    host, port = address(bounded).split(":")
    socks = []
    chunk = os.urandom(2 * MiB)
    for _ in range(MAX_PER_HOST + 6):
        # (From another loopback address: the test's own requests from
        # 127.0.0.1 are not held back by this host's cap.)
        socks.append(socket.create_connection((host, int(port)), timeout=10,
                                              source_address=(HOSTILE, 0)))
    wait_until(lambda: stat(bounded, "tcp_refused") - counts["tcp_refused"] >= 6,
               timeout=10, what="connections past the per-host cap refused")
    for sock in socks:
        try:
            sock.sendall(FRAME.pack(wire.MAX_FRAME_BYTES) + chunk)      # a partial frame
        except (ConnectionResetError, BrokenPipeError):
            pass
    # 24 connections of 2 MiB would hold 48 MiB: the budget (24 MiB) cuts
    # some off, and every other is closed once idle.
    wait_until(lambda: stat(bounded, "tcp_input_overflows") > counts["tcp_input_overflows"],
               timeout=10, what="connections past the input budget aborted")
    still_serves(cluster, "partial-frames")
    assert rss(bounded) - before < INPUT_BUDGET + 24 * MiB
    wait_until(lambda: all(closed_by_peer(sock, 0.05) for sock in socks),
               timeout=IDLE * 4 + 10, what="every connection with a partial frame closed")
    assert stat(bounded, "tcp_idle_closed") > counts["tcp_idle_closed"]
    for sock in socks:
        sock.close()
    still_serves(cluster, "after-partial-frames")


def test_a_partial_frame_the_kernel_holds_is_closed_once_idle(bounded, cluster):
    """A frame of up to 2 MiB is read once it has all come (SO_RCVLOWAT),
    so a peer that sends part of one and stops leaves its bytes in the
    kernel, not in the service: the service, never woken by them, still
    closes the connection once idle, and serves meanwhile."""
    closed = stat(bounded, "tcp_idle_closed")
    host, port = address(bounded).split(":")
    sock = socket.create_connection((host, int(port)), timeout=10,
                                    source_address=(HOSTILE, 0))
    try:
        sock.sendall(FRAME.pack(2 * MiB) + os.urandom(MiB))    # half a frame
        still_serves(cluster, "beside-a-half-frame")
        wait_until(lambda: closed_by_peer(sock, 0.05), timeout=IDLE * 4 + 10,
                   what="the connection holding half a frame closed")
    finally:
        sock.close()
    assert stat(bounded, "tcp_idle_closed") > closed
    still_serves(cluster, "after-a-half-frame")


def test_an_idle_client_connection_is_closed_and_the_client_reconnects(bounded, cluster):
    dht = cluster.open_dht("bounded")
    dht["large"] = b"y" * 100_000                         # over TCP: past a datagram
    closed = stat(bounded, "tcp_idle_closed")
    wait_until(lambda: stat(bounded, "tcp_idle_closed") > closed, timeout=IDLE * 4 + 10,
               what="the client's idle connection closed")
    assert dht["large"] == b"y" * 100_000                 # a new connection, unnoticed


def test_large_values_cross_whole_and_every_byte_each_way_is_counted(bounded):
    # The service sends a reply to its socket itself when nothing waits in
    # Twisted's buffer, and reads the rest of a large frame as soon as the
    # socket has it: the bytes must still all arrive, in order, and be
    # counted (the metrics' tcp bytes).
    values = {f"counted-{size}": os.urandom(size)
              for size in (wire.MAX_UDP_PAYLOAD + 1, 64 * 1024, 3 * MiB + 7)}
    received, sent = stat(bounded, "tcp_bytes_received"), stat(bounded, "tcp_bytes_sent")
    with bounded.connect(timeout=CLIENT_TIMEOUT) as cluster:
        dht = cluster.open_dht("bounded")
        for key, value in values.items():
            dht[key] = value
        for key, value in values.items():
            assert dht[key] == value
    total = sum(map(len, values.values()))
    # (each value once each way, with its headers, the handshake and tags)
    assert total <= stat(bounded, "tcp_bytes_received") - received <= total + 4096
    assert total <= stat(bounded, "tcp_bytes_sent") - sent <= total + 4096


def test_large_values_of_every_kind_come_back_as_they_were(bounded):
    # A large GET reply whose value is msgpack bin 32 is received with the
    # value apart (transport.ValueReply); every other large value (a str,
    # a list, a raw DHT's bytes) is decoded from the whole frame as before.
    values = {"big-str": "é" * 100_000, "big-list": list(range(40_000)),
              "big-bytes": os.urandom(200_000), "big-nested": [os.urandom(70_000), "x"],
              "big-bytearray": bytearray(os.urandom(100_000))}
    with bounded.connect(timeout=CLIENT_TIMEOUT) as cluster:
        dht = cluster.open_dht("bounded")
        for key, value in values.items():
            dht[key] = value
        for key, value in values.items():
            got = dht[key]
            assert got == value
            assert type(got) is (bytes if isinstance(value, bytearray) else type(value))
            assert dht.get(key) == value
        raw = cluster.create_dht("bounded-raw", buckets=1, codec="raw")
        try:
            # (a raw value that begins as a msgpack bin 32 header of the
            # rest would: it is still the raw value, header and all)
            tricky = b"\xc6" + (100_000).to_bytes(4, "big") + os.urandom(100_000)
            raw["tricky"] = tricky
            assert raw["tricky"] == tricky
        finally:
            cluster.destroy_dht("bounded-raw")


# ------------------------------------------------------------ SCAN

def fill(dht, count: int) -> None:
    for start in range(0, count, 2000):
        dht.put_many({f"scan-{n}": n for n in range(start, min(start + 2000, count))})


def first_pages(deployment, dht_id: int, count: int, between=None) -> list[int]:
    """Send ``count`` first-page SCAN datagrams, one after the other's reply
    (``between()`` after each), each from a client id of its own, as
    spoofed ones would be; their statuses."""
    statuses = []
    with RawUdp(address(deployment), keys_of(deployment) or False) as raw:
        raw.sock.settimeout(5)
        for request_id in range(1, count + 1):
            raw.send(wire.encode_scan(request_id, 10**6 + request_id, dht_id, 0, 0, 0))
            while True:
                reply = raw.sock.recv(65536)
                if wire.U32.unpack_from(reply, 4)[0] == request_id:
                    statuses.append(reply[2])
                    break
            if between is not None:
                between()
    return statuses


def test_first_page_scans_share_a_snapshot_and_are_bounded(bounded, cluster):
    # Issue 15: each first-page SCAN copied the bucket's key list and kept
    # it 120 s: 300 datagrams on a 200k-key bucket took 86 -> 521 MiB.
    dht = cluster.create_dht("scanned", buckets=1)
    fill(dht, 60_000)
    before = rss(bounded)
    statuses = first_pages(bounded, dht.id, 300)
    assert statuses == [wire.ST_OK] * 300
    stats = wait_until(lambda: (lambda stats: stats["scans"] >= 300 and stats)(
        service_stats(address(bounded))), timeout=10, what="300 scans open")
    assert stats["scan_keys"] == 60_000                 # one snapshot, shared
    assert rss(bounded) - before < 20 * MiB
    still_serves(cluster, "scans")
    # Writes between first pages make each take a snapshot of its own:
    # past --max-scan-keys, first pages get BUSY, nothing live is dropped.
    writes = iter(range(10**6))
    statuses = first_pages(bounded, dht.id, 40,
                           between=lambda: dht.__setitem__(f"w-{next(writes)}", 1))
    assert wire.ST_BUSY in statuses
    stats = service_stats(address(bounded))
    assert stats["scan_keys"] <= MAX_SCAN_KEYS
    assert rss(bounded) - before < 40 * MiB
    still_serves(cluster, "after-scans")


# ------------------------------------------------------------ replies and junk

def test_junk_is_not_cached_and_malformed_replies_are_no_larger_than_the_datagram(bounded):
    # Issue 15: junk PUT headers filled the reply cache (466k entries).
    with RawUdp(address(bounded), keys_of(bounded) or False) as raw:
        cached = raw.stats()["reply_cache"]
        for request_id in range(1, 2001):
            raw.send(wire.request_header(wire.OP_PUT, request_id, raw.client_id) + b"\x01")
        for request_id, datagram in enumerate([
                wire.request_header(0x7E, 0, raw.client_id),                  # unknown op
                bytes((wire.REQUEST_MAGIC, 9)) + bytes(14),                   # bad version
                wire.request_header(wire.OP_GET, 0, raw.client_id) + b"\x00"]):  # malformed
            stamp = raw.send(datagram)
            raw.sock.settimeout(5)
            while True:
                reply = raw.sock.recv(65536)
                opened = raw.opened(reply, datagram, [stamp])
                if opened is not None and opened[4:8] == datagram[4:8] \
                        and opened[2] in wire.MALFORMED_STATUSES:
                    break
            sent = len(datagram) + (12 if raw.key is not None else 0)
            assert len(reply) <= sent, (request_id, reply)
        wait_until(lambda: raw.stats()["malformed"] >= 2000, timeout=10,
                   what="the junk counted")
        assert raw.stats()["reply_cache"] == cached


def test_a_small_get_of_a_big_value_is_no_amplifier_on_an_insecure_deployment(bounded, cluster):
    # Issue 15: a 30-byte GET of a big value returned a 65,008-byte datagram
    # to any source address.
    dht = cluster.open_dht("bounded")
    dht["wide"] = b"z" * 60_000
    request = wire.encode_keyed(wire.OP_GET, 5, 9, dht.id, bucket_of_key(dht, "wide"),
                                encode_key("wide"))
    if bounded.insecure:
        with RawUdp(address(bounded), False) as raw:
            raw.send(request)
            raw.sock.settimeout(5)
            reply = raw.sock.recv(65536)
        assert reply[2] == wire.ST_REPLY_TOO_LARGE
        assert len(reply) <= 16 * len(request)
    else:
        # Secure: a datagram without the MAC gets nothing at all.
        with RawUdp(address(bounded), False) as raw:
            raw.send_unsealed(request)
            raw.sock.settimeout(1)
            with pytest.raises(TimeoutError):
                raw.sock.recv(65536)
    assert dht["wide"] == b"z" * 60_000                  # clients still read it (over TCP)


# ------------------------------------------------------------ overload

def test_a_standing_queue_is_shed_with_busy_and_the_rest_served(bounded, cluster):
    # A service that fell behind (here: stopped while requests kept coming
    # for 0.6 s, a queue that stood longer than an interval) answers BUSY,
    # unserved, to what waited past --shed-after (0.1 s), and serves the rest.
    dht = cluster.open_dht("bounded")
    dht["hot"] = 0
    bucket = bucket_of_key(dht, "hot")
    shed = stat(bounded, "shed")
    process = psutil.Process(bounded.services["s1"].pid)
    sent = []
    with RawUdp(address(bounded), keys_of(bounded) or False) as raw:
        process.suspend()
        try:
            for step in range(60):
                for n in range(4):
                    request_id = step * 4 + n + 1
                    sent.append(request_id)
                    raw.send(wire.encode_keyed(wire.OP_PUT, request_id, raw.client_id, dht.id,
                                               bucket, encode_key("hot"), wire.pack(request_id)))
                # (Ageing is what is tested: the requests must arrive over
                # more than an interval while the service reads nothing.)
                time.sleep(0.01)
        finally:
            process.resume()
        raw.sock.settimeout(5)
        replies = {}
        while len(replies) < len(sent):
            reply = raw.sock.recv(65536)
            replies[wire.U32.unpack_from(reply, 4)[0]] = reply[2]
    statuses = list(replies.values())
    assert set(statuses) == {wire.ST_OK, wire.ST_BUSY}
    assert stat(bounded, "shed") - shed == statuses.count(wire.ST_BUSY)
    # The last put served is the value now: no shed put was applied.
    last_served = max(request_id for request_id, status in replies.items()
                      if status == wire.ST_OK)
    assert dht["hot"] == last_served
    still_serves(cluster, "shed")
