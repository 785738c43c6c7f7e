"""``/metrics`` of a real deployment (a supervisor and three services, each
started with ``--metrics``): fetched over HTTP with urllib, parsed by
prometheus_client's parser, and checked against what the test did: puts,
gets, misses, malformed datagrams, a request over TCP, a refused control
request and a bucket moved by hand.

Requests go out as hand-built datagrams, each sent once and answered once
(the client library retries a request whose reply is late, and a retry is
another request in the counts), so every count is known exactly."""

from __future__ import annotations

import socket
import struct
import urllib.error
import urllib.request
from collections import Counter

import pytest
from prometheus_client.parser import text_string_to_metric_families

import domus
from domus.errors import UnknownDht
from domus.wire import address as addresses
from domus.wire import protocol as wire
from domus.wire.keys import encode_key

from .conftest import _stop_all, start_deployment
from .support import CLIENT_TIMEOUT, LOOPBACK, bucket_of_key, owner_of, service_addresses

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
    """Datagrams sent once each, each waiting for its one reply."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((LOOPBACK, 0))
        self.sock.settimeout(10)
        self.client_id = 0x5EED
        self.request_id = 0

    def next_id(self) -> int:
        self.request_id += 1
        return self.request_id

    def call(self, address: str, datagram: bytes) -> bytes:
        self.sock.sendto(datagram, addresses.parse(address))
        reply, _peer = self.sock.recvfrom(65536)
        assert reply[4:8] == datagram[4:8]
        return reply

    def send(self, address: str, datagram: bytes) -> None:
        self.sock.sendto(datagram, addresses.parse(address))

    def close(self) -> None:
        self.sock.close()


def over_tcp(address: str, request: bytes) -> bytes:
    with socket.create_connection(addresses.parse(address), timeout=10) as connection:
        connection.sendall(FRAME.pack(len(request)) + request)
        data = b""
        while len(data) < FRAME.size or len(data) < FRAME.size + FRAME.unpack_from(data)[0]:
            chunk = connection.recv(65536)
            assert chunk, "the service closed the connection"
            data += chunk
    return data[FRAME.size:]


def delta(after: dict, before: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after[key] - before.get(key, 0.0)


@pytest.mark.timeout(180)
def test_the_metrics_of_a_deployment_match_what_was_done(tmp_path, request):
    deployment = start_deployment(tmp_path, metrics=True)
    udp = OneShot()
    try:
        cluster = domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT)
        dht = cluster.create_dht("m", buckets=8)
        services = service_addresses(cluster)
        names = sorted(services)
        where = {name: deployment.metrics_address(name) for name in ["supervisor", *names]}

        # what curl sees: the page, its root, and nothing else
        status, content_type, body = fetch(where["supervisor"], "/")
        assert (status, body) == (200, "Domus supervisor: Prometheus metrics at /metrics\n")
        assert fetch(where["s1"], "/nothing")[0] == 404

        before = {name: scrape(address) for name, address in where.items()}
        sent: dict[str, Counter[str]] = {name: Counter() for name in names}

        def call(service: str, datagram: bytes) -> bytes:
            reply = udp.call(services[service], datagram)
            sent[service]["in"] += len(datagram)
            sent[service]["out"] += len(reply)
            return reply

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
        udp.send(services["s1"], b"junk")
        sent["s1"]["in"] += len(b"junk")
        # one GET over TCP, at the owner of its key
        key = keys[0]
        tcp_owner = owner_of(dht, key)
        tcp_request = wire.encode_keyed(wire.OP_GET, udp.next_id(), udp.client_id, dht.id,
                                        bucket_of_key(dht, key), encode_key(key))
        tcp_reply = over_tcp(services[tcp_owner], tcp_request)
        assert tcp_reply[2] == wire.ST_OK
        # a control request the supervisor refuses
        with pytest.raises(UnknownDht):
            cluster.open_dht("no-such-dht")

        after = {name: scrape(address) for name, address in where.items()}
        held = {entry["name"]: entry["buckets"]["m"] for entry in cluster.services()}
        for name in names:
            mine, was, counts = after[name], before[name], sent[name]
            me = {"service": name}
            is_tcp_owner = name == tcp_owner
            assert delta(mine, was, "domus_service_requests_total", op="put", **me) \
                == counts["put"]
            assert delta(mine, was, "domus_service_requests_total", op="get", **me) \
                == counts["get"] + is_tcp_owner
            assert delta(mine, was, "domus_service_replies_total", status="ok", **me) \
                == counts["put"] + counts["found"] + is_tcp_owner
            assert delta(mine, was, "domus_service_replies_total", status="not_found",
                         **me) == counts["missed"]
            assert delta(mine, was, "domus_service_replies_total", status="bad_version",
                         **me) == (name == "s1")
            assert delta(mine, was, "domus_service_malformed_requests_total", **me) \
                == 2 * (name == "s1")
            assert delta(mine, was, "domus_service_bytes_received_total", transport="udp",
                         **me) == counts["in"]
            assert delta(mine, was, "domus_service_bytes_sent_total", transport="udp",
                         **me) == counts["out"]
            assert delta(mine, was, "domus_service_bytes_received_total", transport="tcp",
                         **me) == (FRAME.size + len(tcp_request)) * is_tcp_owner
            assert delta(mine, was, "domus_service_bytes_sent_total", transport="tcp",
                         **me) == (FRAME.size + len(tcp_reply)) * is_tcp_owner
            assert value(mine, "domus_service_records", dht="m", **me) == counts["put"]
            assert value(mine, "domus_service_buckets", dht="m", role="primary", **me) \
                == held[name]["storage"]
            assert value(mine, "domus_service_buckets", dht="m", role="routing", **me) \
                == held[name]["routing"]
            for counter in ("unauthenticated", "internal_errors", "storage_errors",
                            "replayed"):
                assert value(mine, f"domus_service_{counter}_total", **me) == 0
            assert value(mine, "domus_service_registered", **me) == 1
            assert value(mine, "domus_service_resident_memory_bytes", **me) > 0
            assert value(mine, "domus_service_info", hot_path="c", version=domus.__version__,
                         **me) == 1
        assert sum(sent[name]["put"] for name in names) == PUTS

        supervising, was = after["supervisor"], before["supervisor"]
        assert value(supervising, "domus_supervisor_services", state="up") == 3
        assert value(supervising, "domus_supervisor_dhts", state="active") == 1
        assert value(supervising, "domus_supervisor_dht_buckets", dht="m") == 8
        assert value(supervising, "domus_supervisor_registrations_total") == 3
        assert value(supervising, "domus_supervisor_heartbeats_total") > 0
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
        udp.close()
        _stop_all(deployment, request)

