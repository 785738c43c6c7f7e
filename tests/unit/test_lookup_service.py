"""The AS side of distributed lookups: LOOKUP hop by hop across real request
handlers (no sockets), and the redirect in a NOT_OWNER reply."""

import random

import pytest
from test_handler import CLIENT_A, DHT_ID, call, descriptor, keys_in, next_id, put

from domus.routing import make_graph
from domus.service.handler import RequestHandler
from domus.wire import protocol as wire

SERVICES = ["s1", "s2", "s3", "s4", "s5"]


def spread(buckets, graph="chord", degree=None, algorithm="fewest-hops", counts=None,
           routing_moves=None):
    """A DHT routed by five services (uneven counts) and stored by two."""
    counts = counts or [buckets // 8, buckets // 4, buckets // 8, buckets // 4, buckets // 4]
    return descriptor(
        buckets=buckets, routing=graph, routing_degree=degree, routing_algorithm=algorithm,
        routing_services=[{"name": name, "address": f"127.0.0.1:{index + 1}", "count": count}
                          for index, (name, count) in enumerate(zip(SERVICES, counts))],
        storage_services=[{"name": "s1", "address": "127.0.0.1:1", "count": buckets // 2},
                          {"name": "s2", "address": "127.0.0.1:2", "count": buckets // 2}],
        **({"routing_moves": routing_moves} if routing_moves else {}))


def handlers_for(dht):
    handlers = {}
    for name in SERVICES:
        handlers[name] = RequestHandler(name)
        handlers[name].assign(dht)
    return handlers


def lookup(handler, target, current=None):
    request = wire.encode_lookup(next_id(), CLIENT_A, DHT_ID, target, current)
    reply = handler.handle(request)
    if reply[2] != wire.ST_OK:
        return reply[2], reply
    return wire.ST_OK, wire.decode_lookup_reply(reply)


def walk(handlers, start_service, start_bucket, target):
    """The chain a client follows: (services asked, storage service found)."""
    service, current, asked = start_service, start_bucket, []
    for _hop in range(64):
        asked.append(service)
        status, answer = lookup(handlers[service], target, current)
        assert status == wire.ST_OK, answer
        kind, bucket, name, address = answer
        assert address == f"127.0.0.1:{SERVICES.index(name) + 1}"
        if kind == wire.LOOKUP_FOUND:
            assert bucket == target
            return asked, name
        service, current = name, bucket
    raise AssertionError("lookup did not end")


@pytest.mark.parametrize("graph, degree, algorithm", [
    ("chord", None, "fewest-hops"), ("chord", None, "least-work"),
    ("bruijn", 2, "fewest-hops"), ("bruijn", 2, "least-work"),
    ("bruijn", 4, "fewest-hops"), ("bruijn", 4, "least-work"),
])
def test_every_lookup_ends_at_the_storage_service_within_the_hop_bound(graph, degree,
                                                                        algorithm):
    buckets = 256
    dht = spread(buckets, graph, degree, algorithm)
    handlers = handlers_for(dht)
    bound = make_graph(graph, buckets, degree).hop_bound()
    routers = {name: [b for b in range(buckets)
                      if any(first <= b < end for first, end in handlers[name].dhts[DHT_ID].routed)]
               for name in SERVICES}
    rng = random.Random(7)
    for target in range(buckets):
        start = rng.choice(SERVICES)
        asked, storage = walk(handlers, start, rng.choice(routers[start]), target)
        assert storage == ("s1" if target < buckets // 2 else "s2")
        assert len(asked) - 1 <= bound
        assert target in routers[asked[-1]]
    forwarded = sum(h.dhts[DHT_ID].lookups["forwarded"] for h in handlers.values())
    found = sum(h.dhts[DHT_ID].lookups["found"] for h in handlers.values())
    assert found == buckets and forwarded > 0
    stats = handlers["s2"].stats()["dhts"]["t"]["lookups"]
    assert stats == handlers["s2"].dhts[DHT_ID].lookups


def test_lookups_follow_routing_moves():
    dht = spread(64, routing_moves={"0": "s5", "63": "s1"})
    handlers = handlers_for(dht)
    asked, storage = walk(handlers, "s3", None, 0)
    assert asked[-1] == "s5" and storage == "s1"
    asked, storage = walk(handlers, "s2", None, 63)
    assert asked[-1] == "s1" and storage == "s2"


def test_a_stale_current_bucket_is_routed_from_the_services_own_buckets():
    """A client whose layout is old names a current bucket this AS no longer
    routes: the AS routes from its own buckets instead (never refuses)."""
    dht = spread(64, "bruijn", 2, "least-work")
    handlers = handlers_for(dht)
    not_here = 63        # routed by s5
    status, (kind, _bucket, _name, _address) = lookup(handlers["s1"], 40, not_here)
    assert status == wire.ST_OK and kind == wire.LOOKUP_NEXT


def test_lookup_errors_name_the_problem():
    handlers = handlers_for(spread(64))
    status, reply = lookup(handlers["s1"], 64)
    assert status == wire.ST_MALFORMED and b"bucket 64" in reply
    bad = wire.encode_lookup(next_id(), CLIENT_A, DHT_ID, 3)[:-1]
    assert call(handlers["s1"], bad)[0] == wire.ST_MALFORMED
    unknown = wire.encode_lookup(next_id(), CLIENT_A, DHT_ID + 1, 3)
    assert call(handlers["s1"], unknown)[0] == wire.ST_UNKNOWN_DHT
    # A service that routes nothing of the DHT redirects to one that does.
    idle = RequestHandler("s9")
    dht = spread(64)
    dht["routing_services"] = [*dht["routing_services"],
                               {"name": "s9", "address": "127.0.0.1:9", "count": 0}]
    idle.assign(dht)
    status, reply = lookup(idle, 5)
    assert status == wire.ST_NOT_OWNER
    name, address, message = wire.decode_redirect(reply)
    assert (name, address) == ("s1", "127.0.0.1:1") and "routes no bucket" in message


def test_a_request_for_a_bucket_stored_elsewhere_is_redirected_and_stores_nothing():
    handler = RequestHandler("s1")
    handler.assign(descriptor())
    key = keys_in(6, 1)[0]          # s2 stores buckets 4..7
    request_reply = handler.handle(
        wire.encode_keyed(wire.OP_PUT, next_id(), CLIENT_A, DHT_ID, 6, key, b"v"))
    assert request_reply[2] == wire.ST_NOT_OWNER
    name, address, message = wire.decode_redirect(request_reply)
    assert (name, address) == ("s2", "127.0.0.1:2")
    assert "does not store bucket 6" in message
    assert handler.dhts[DHT_ID].records() == 0
    assert put(handler, keys_in(1, 1)[0], b"v")[0] == wire.ST_OK


@pytest.mark.parametrize("body", [b"", b"\x03ab", b"\x01a\x05ab", b"\x01\xff\x01a"])
def test_a_truncated_or_bad_service_reference_is_a_protocol_error(body):
    reply = wire.reply_prefix(wire.ST_NOT_OWNER) + b"\x00\x00\x00\x01" + body
    with pytest.raises(wire.ProtocolError):
        wire.decode_redirect(reply)


def test_lookup_round_trips_on_the_wire():
    for current in (None, 0, 7):
        request = wire.encode_lookup(9, 10, 11, 12, current)
        assert wire.decode_lookup(request) == (11, 12, current)
    reply = wire.encode_lookup_reply(b"\x00\x00\x00\x09", wire.LOOKUP_NEXT, 5, "s2",
                                     "127.0.0.1:2")
    assert wire.decode_lookup_reply(reply) == (wire.LOOKUP_NEXT, 5, "s2", "127.0.0.1:2")
    with pytest.raises(wire.ProtocolError):
        wire.decode_lookup_reply(reply + b"x")
    with pytest.raises(wire.ProtocolError):
        wire.decode_lookup_reply(reply[:10])


def test_the_c_hot_path_leaves_lookups_to_python():
    handler = RequestHandler("s1")
    handler.assign(descriptor())
    request = wire.encode_lookup(next_id(), CLIENT_A, DHT_ID, 3, 3)
    reply = handler.handle_fast(request)
    assert wire.decode_lookup_reply(reply) == (wire.LOOKUP_FOUND, 3, "s1", "127.0.0.1:1")
    assert handler.by_op[wire.OP_LOOKUP] == 1
