"""``/metrics`` of a real, secure deployment (a supervisor and three
services, each started with ``--metrics``): fetched over HTTP with urllib,
parsed by prometheus_client's parser, and checked against what the test
did: puts, gets, misses, malformed datagrams, an unsealed datagram and a
stale one, a request over TCP, connections refused for a wrong secret, a
refused control request and a bucket moved by hand.

Requests go out as hand-built datagrams, sealed with the deployment's
secret, each sent once and answered once (the client library retries a
request whose reply is late, and a retry is another request in the
counts), so every count is known exactly; the TCP connections make the
handshake by hand, so that their bytes are known too."""

from __future__ import annotations

import socket
import struct
import time
import urllib.error
import urllib.request
from collections import Counter

import pytest
from prometheus_client.parser import text_string_to_metric_families

import domus
from domus.errors import AuthenticationError, UnknownDht
from domus.wire import address as addresses
from domus.wire import auth, secret
from domus.wire import protocol as wire
from domus.wire.keys import encode_key

from .conftest import _stop_all, start_deployment
from .support import (
    CLIENT_TIMEOUT,
    LOOPBACK,
    bucket_of_key,
    owner_of,
    service_addresses,
    wait_until,
)

PUTS = 40
GETS = 25
MISSES = 15
FRAME = struct.Struct(">I")


def fetch(address: str, path: str = "/metrics") -> tuple[int, str, str]:
    """(HTTP status, content type, body) of a GET, as curl would see it."""
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as answer:
            return answer.status, answer.headers["Content-Type"], answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read().decode()


def scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, content_type, body = fetch(address)
    assert status == 200 and content_type.startswith("text/plain; version=0.0.4")
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(body) for sample in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


class OneShot:
    """Datagrams sealed with ``key`` (the deployment's data key) and sent
    once each, each waiting for its one reply; the bytes that went out and
    came back, as on the wire, in ``sent[service]``."""

    def __init__(self, key: bytes, services: dict[str, str]) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((LOOPBACK, 0))
        self.sock.settimeout(10)
        self.key = key
        self.services = services
        self.sent: dict[str, Counter[str]] = {name: Counter() for name in services}
        self.client_id = 0x5EED
        self.request_id = 0

    def next_id(self) -> int:
        self.request_id += 1
        return self.request_id

    def call(self, service: str, datagram: bytes, seconds: int | None = None) -> bytes:
        """The reply to ``datagram`` (sealed with the time ``seconds``:
        now by default), its MAC checked and taken off."""
        sealed = auth.seal_request(self.key, datagram, seconds)
        self.send(service, sealed)
        reply, _peer = self.sock.recvfrom(65536)
        self.sent[service]["out"] += len(reply)
        opened = auth.open_reply(self.key, reply, datagram[8:16], sealed[-12:-8])
        assert opened is not None and opened[4:8] == datagram[4:8]
        return opened

    def send(self, service: str, datagram: bytes) -> None:
        """``datagram`` as it is (no reply expected)."""
        self.sock.sendto(datagram, addresses.parse(self.services[service]))
        self.sent[service]["in"] += len(datagram)

    def close(self) -> None:
        self.sock.close()


class TcpPeer:
    """A TCP connection to a Domus process, counting its bytes each way as
    on the wire."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock = socket.create_connection(addresses.parse(address), timeout=10)
        self.bytes_sent = self.bytes_received = 0
        self._buffer = b""
        self.session: auth.Session | None = None

    def handshake(self, keys: secret.Keys) -> None:
        """The Domus handshake, made with ``keys``; with a wrong secret's,
        AuthenticationError once the peer refused it and closed."""
        handshake = auth.Connecting(keys, self.address)
        try:
            self._send(handshake.hello(self._frame()))
            self.session = handshake.verdict(self._frame())
        except AuthenticationError:
            self.close()                # (after the peer closed: every byte counted)
            raise
        assert self.session is not None

    def _send(self, frame: bytes) -> None:
        data = FRAME.pack(len(frame)) + frame
        self.sock.sendall(data)
        self.bytes_sent += len(data)

    def _read(self) -> bytes:
        chunk = self.sock.recv(65536)
        self.bytes_received += len(chunk)
        return chunk

    def _frame(self) -> bytes:
        while (len(self._buffer) < FRAME.size
               or len(self._buffer) < FRAME.size + FRAME.unpack_from(self._buffer)[0]):
            chunk = self._read()
            assert chunk, "the peer closed the connection"
            self._buffer += chunk
        end = FRAME.size + FRAME.unpack_from(self._buffer)[0]
        frame, self._buffer = self._buffer[FRAME.size:end], self._buffer[end:]
        return frame

    def call(self, request: bytes) -> bytes:
        assert self.session is not None, "no handshake made"
        self._send(self.session.seal(request))
        return self.session.open(self._frame())

    def close(self) -> None:
        """Close, once the peer has: what it sent is all read (and what it
        read, counted on its side)."""
        self.sock.shutdown(socket.SHUT_WR)
        while self._read():
            pass
        self.sock.close()


def delta(after: dict, before: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after[key] - before.get(key, 0.0)


@pytest.mark.timeout(180)
def test_the_metrics_of_a_deployment_match_what_was_done(tmp_path, request):
    deployment = start_deployment(tmp_path, metrics=True)
    ours = secret.keys(deployment.secret_file)
    other = secret.Keys.from_secret(secret.create(str(tmp_path / "other" / "secret")),
                                    "another deployment's")
    udp = None
    try:
        cluster = domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT)
        dht = cluster.create_dht("m", buckets=8)
        services = service_addresses(cluster)
        names = sorted(services)
        udp = OneShot(ours.data, services)
        sent = udp.sent
        where = {name: deployment.metrics_address(name) for name in ["supervisor", *names]}

        # what curl sees: the page, its root, and nothing else
        status, content_type, body = fetch(where["supervisor"], "/")
        assert (status, body) == (200, "Domus supervisor: Prometheus metrics at /metrics\n")
        assert fetch(where["s1"], "/nothing")[0] == 404

        before = {name: scrape(address) for name, address in where.items()}
        call = udp.call
        keys = [f"k-{number}" for number in range(PUTS)]
        for key in keys:
            owner = owner_of(dht, key)
            reply = call(owner, wire.encode_keyed(wire.OP_PUT, udp.next_id(), udp.client_id,
                                                  dht.id, bucket_of_key(dht, key),
                                                  encode_key(key), b"value of " + key.encode()))
            assert reply[2] == wire.ST_OK
            sent[owner]["put"] += 1
        for key in keys[:GETS] + [f"absent-{number}" for number in range(MISSES)]:
            owner = owner_of(dht, key)
            reply = call(owner, wire.encode_keyed(wire.OP_GET, udp.next_id(), udp.client_id,
                                                  dht.id, bucket_of_key(dht, key),
                                                  encode_key(key)))
            found = key in keys
            assert reply[2] == (wire.ST_OK if found else wire.ST_NOT_FOUND)
            sent[owner]["get"] += 1
            sent[owner]["found" if found else "missed"] += 1
        # garbage at s1: a datagram of an unknown protocol version (answered
        # BAD_VERSION) and one without even a request id (dropped)
        bad_version = b"\xd0\x63" + wire.request_header(wire.OP_GET, udp.next_id(),
                                                        udp.client_id)[2:]
        assert call("s1", bad_version)[2] == wire.ST_BAD_VERSION
        udp.send("s1", auth.seal_request(udp.key, b"junk"))
        # at s2, a PUT without a MAC (dropped, unanswered: the next reply
        # the socket gets is the next request's), and a GET sealed a minute
        # ago (a replay, or a clock that is off: refused as stale)
        key = keys[1]
        unsealed = wire.encode_keyed(wire.OP_PUT, udp.next_id(), udp.client_id, dht.id,
                                     bucket_of_key(dht, key), encode_key(key), b"forged")
        udp.send("s2", unsealed)
        replayed = wire.encode_keyed(wire.OP_GET, udp.next_id(), udp.client_id, dht.id,
                                     bucket_of_key(dht, key), encode_key(key))
        assert call("s2", replayed, int(time.time()) - 60)[2] == wire.ST_STALE_REQUEST
        # one GET over TCP, at the owner of its key, after the handshake;
        # a connection with another deployment's secret, refused, at s3
        key = keys[0]
        tcp_owner = owner_of(dht, key)
        tcp_request = wire.encode_keyed(wire.OP_GET, udp.next_id(), udp.client_id, dht.id,
                                        bucket_of_key(dht, key), encode_key(key))
        peer = TcpPeer(services[tcp_owner])
        peer.handshake(ours)
        tcp_reply = peer.call(tcp_request)
        assert tcp_reply[2] == wire.ST_OK
        peer.close()
        sent[tcp_owner].update(tcp_in=peer.bytes_sent, tcp_out=peer.bytes_received)
        refused = TcpPeer(services["s3"])
        with pytest.raises(AuthenticationError, match="refused"):
            refused.handshake(other)
        refused_in, refused_out = refused.bytes_sent, refused.bytes_received
        # the supervisor refuses another deployment's client, and a
        # control request it cannot answer
        with pytest.raises(AuthenticationError, match="refused"):
            TcpPeer(deployment.supervisor_address).handshake(other)
        with pytest.raises(UnknownDht):
            cluster.open_dht("no-such-dht")

        # (the datagrams sent without a reply to wait for -- s1's junk, s2's
        # unsealed PUT -- may still be on their way: wait until they are
        # counted, then compare everything)
        wait_until(lambda: delta(scrape(where["s1"]), before["s1"],
                                 "domus_service_malformed_requests_total", service="s1") >= 2
                   and delta(scrape(where["s2"]), before["s2"],
                             "domus_service_unauthenticated_total", service="s2") >= 1,
                   timeout=10, what="s1 to count its junk and s2 the unsealed PUT")
        after = {name: scrape(address) for name, address in where.items()}
        held = {entry["name"]: entry["buckets"]["m"] for entry in cluster.services()}
        for name in names:
            mine, was, counts = after[name], before[name], sent[name]
            me = {"service": name}
            is_tcp_owner = name == tcp_owner
            assert delta(mine, was, "domus_service_requests_total", op="put", **me) \
                == counts["put"]
            assert delta(mine, was, "domus_service_requests_total", op="get", **me) \
                == counts["get"] + is_tcp_owner + (name == "s2")
            assert delta(mine, was, "domus_service_replies_total", status="ok", **me) \
                == counts["put"] + counts["found"] + is_tcp_owner
            assert delta(mine, was, "domus_service_replies_total", status="not_found",
                         **me) == counts["missed"]
            assert delta(mine, was, "domus_service_replies_total", status="bad_version",
                         **me) == (name == "s1")
            assert delta(mine, was, "domus_service_malformed_requests_total", **me) \
                == 2 * (name == "s1")
            # (s2's unsealed PUT; s3's refused connection)
            assert delta(mine, was, "domus_service_unauthenticated_total", **me) \
                == (name in ("s2", "s3"))
            assert delta(mine, was, "domus_service_stale_requests_total", **me) \
                == (name == "s2")
            assert delta(mine, was, "domus_service_replies_total", status="stale_request",
                         **me) == (name == "s2")
            assert delta(mine, was, "domus_service_bytes_received_total", transport="udp",
                         **me) == counts["in"]
            assert delta(mine, was, "domus_service_bytes_sent_total", transport="udp",
                         **me) == counts["out"]
            assert delta(mine, was, "domus_service_bytes_received_total", transport="tcp",
                         **me) == counts["tcp_in"] + refused_in * (name == "s3")
            assert delta(mine, was, "domus_service_bytes_sent_total", transport="tcp",
                         **me) == counts["tcp_out"] + refused_out * (name == "s3")
            assert value(mine, "domus_service_records", dht="m", **me) == counts["put"]
            assert value(mine, "domus_service_buckets", dht="m", role="primary", **me) \
                == held[name]["storage"]
            assert value(mine, "domus_service_buckets", dht="m", role="routing", **me) \
                == held[name]["routing"]
            for counter in ("internal_errors", "storage_errors", "replayed"):
                assert value(mine, f"domus_service_{counter}_total", **me) == 0
            assert value(mine, "domus_service_registered", **me) == 1
            assert value(mine, "domus_service_resident_memory_bytes", **me) > 0
            assert value(mine, "domus_service_info", hot_path="c", version=domus.__version__,
                         secure="true", **me) == 1
        assert sum(sent[name]["put"] for name in names) == PUTS

        supervising, was = after["supervisor"], before["supervisor"]
        assert value(supervising, "domus_supervisor_services", state="up") == 3
        assert value(supervising, "domus_supervisor_dhts", state="active") == 1
        assert value(supervising, "domus_supervisor_dht_buckets", dht="m") == 8
        assert value(supervising, "domus_supervisor_registrations_total") == 3
        # (a heartbeat may not have come yet on a quick machine: wait for one)
        wait_until(lambda: value(scrape(where["supervisor"]),
                                 "domus_supervisor_heartbeats_total") > 0,
                   timeout=15, what="the supervisor to count a heartbeat")
        assert delta(supervising, was, "domus_supervisor_refused_connections_total") == 1
        assert value(supervising, "domus_supervisor_info", version=domus.__version__,
                     balance="manual", secure="true") == 1
        for name in names:
            for role in ("routing", "storage"):
                assert value(supervising, "domus_supervisor_buckets", dht="m", service=name,
                             role=role) == held[name][role]
        assert value(supervising, "domus_supervisor_control_requests_total", op="create_dht",
                     outcome="ok") == 1
        assert delta(supervising, was, "domus_supervisor_control_requests_total",
                     op="open_dht", outcome="UnknownDht") == 1

        # a bucket of s1's, with records, moved by hand to s3
        source, target = "s1", "s3"
        moved_bucket = Counter(bucket_of_key(dht, key) for key in keys
                               if owner_of(dht, key) == source).most_common(1)[0]
        bucket, records = moved_bucket
        answer = cluster.move_bucket("m", bucket, storage=target)
        assert answer["changed"] and answer["records"] == records
        moved = {name: scrape(where[name]) for name in (source, target, "supervisor")}
        supervising = moved["supervisor"]
        assert value(supervising, "domus_supervisor_moves_total", by="hand", role="storage",
                     outcome="done") == 1
        assert value(supervising, "domus_supervisor_move_seconds_count", by="hand",
                     role="storage") == 1
        assert 0 < value(supervising, "domus_supervisor_move_seconds_sum", by="hand",
                         role="storage") <= answer["seconds"] + 0.05
        assert value(supervising, "domus_supervisor_buckets", dht="m", service=source,
                     role="storage") == held[source]["storage"] - 1
        assert value(supervising, "domus_supervisor_buckets", dht="m", service=target,
                     role="storage") == held[target]["storage"] + 1
        mine = {"service": source, "dht": "m"}
        assert value(moved[source], "domus_service_move_freezes_total", **mine) == 1
        assert value(moved[source], "domus_service_move_buckets_sent_total", **mine) == 1
        assert value(moved[source], "domus_service_move_frozen_seconds_total", **mine) > 0
        assert value(moved[source], "domus_service_records", **mine) \
            == sent[source]["put"] - records
        assert value(moved[source], "domus_service_buckets", role="primary", **mine) \
            == held[source]["storage"] - 1
        theirs = {"service": target, "dht": "m"}
        assert value(moved[target], "domus_service_move_buckets_staged_total", **theirs) == 1
        assert value(moved[target], "domus_service_move_records_staged_total", **theirs) \
            == records
        assert value(moved[target], "domus_service_move_buckets_received_total", **theirs) == 1
        assert value(moved[target], "domus_service_records", **theirs) \
            == sent[target]["put"] + records
        cluster.close()
    finally:
        if udp is not None:
            udp.close()
        _stop_all(deployment, request)

