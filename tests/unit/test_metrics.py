"""The metrics collectors (domus.service.metrics, domus.supervisor.metrics)
and the /metrics page (domus.wire.metrics): what a scrape says after known
requests, moves and control calls, parsed as Prometheus parses it.

The services and the supervisor here are real objects driven without
sockets, as in test_supervisor (whose fixture this reuses)."""

import gzip
import re
import socket
import time
from pathlib import Path

import pytest
from domus.supervisor import metrics as supervisor_metrics
from domus.supervisor.server import SupervisorService
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families
from test_auth import Reactor, exchange
from test_handler import BUCKETS, DHT_ID, descriptor, key_in, keyed, keys_in
from test_supervisor import NAME, deployment, result_of  # noqa: F401 (a fixture)
from twisted.web.resource import getChildForRequest
from twisted.web.test.requesthelper import DummyRequest

from domus._version import __version__
from domus.service import hotpath
from domus.service import metrics as service_metrics
from domus.service.server import DomusService
from domus.service.udp import UdpServer
from domus.wire import auth, launch, secret
from domus.wire import metrics as page
from domus.wire import protocol as wire
from domus.wire.control import ControlError

HAND = object()         # a client's link: a move asked for by hand


def scrape(registry):
    """{(sample name, ((label, value), ...)): value} of one scrape, read by
    prometheus_client's parser from the text format."""
    samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name, **labels):
    return samples[(name, tuple(sorted(labels.items())))]


def service(tmp_path, name="s1"):
    made = DomusService(supervisor="127.0.0.1:1", listen="127.0.0.1:1",
                        data_dir=str(tmp_path / name), name=name)
    made.handler.assign(descriptor())
    return made


# ------------------------------------------------------------ a service

@pytest.mark.parametrize("path", ["c", "python"])
def test_requests_are_counted_by_op_and_by_reply_status(tmp_path, monkeypatch, path):
    if path == "python":
        monkeypatch.setattr(hotpath, "FastPath", None)      # as DOMUS_PURE_PYTHON=1 does
    elif hotpath.FastPath is None:
        pytest.skip("the C hot path is not built")
    served = service(tmp_path)
    handler = served.handler
    registry = service_metrics.registry_of(served)
    before = scrape(registry)
    assert value(before, "domus_service_requests_total", service="s1", op="put") == 0
    assert value(before, "domus_service_replies_total", service="s1", status="not_owner") == 0

    puts = [keyed(wire.OP_PUT, key, b"v%d" % index)
            for index, key in enumerate(keys_in(0, 3) + keys_in(3, 2))]
    requests = [*puts,
                *(keyed(wire.OP_GET, key) for key in keys_in(0, 3)),    # found
                keyed(wire.OP_GET, key_in(1)), keyed(wire.OP_GET, key_in(2)),   # absent
                keyed(wire.OP_GET, key_in(5)),                          # not stored here
                puts[0],                                                # a retry
                b"\xd0\x63" + puts[1][2:],                              # protocol version 99
                b"garbage",                                             # not even an id
                wire.request_header(0x7F, 77, 1)]                       # no such op
    for request in requests:
        handler.handle_fast(request)
    samples = scrape(registry)

    def requests_of(op):
        return value(samples, "domus_service_requests_total", service="s1", op=op)

    def replies_of(status):
        return value(samples, "domus_service_replies_total", service="s1", status=status)

    assert (requests_of("put"), requests_of("get"), requests_of("unknown")) == (6, 6, 1)
    assert requests_of("delete") == 0
    assert (replies_of("ok"), replies_of("not_found"), replies_of("not_owner"),
            replies_of("bad_version"), replies_of("unknown_op")) == (9, 2, 1, 1, 1)
    assert value(samples, "domus_service_malformed_requests_total", service="s1") == 3
    assert value(samples, "domus_service_errors_total", service="s1") == 1
    assert value(samples, "domus_service_replayed_total", service="s1") == 1
    assert value(samples, "domus_service_records", service="s1", dht="t") == 5
    assert value(samples, "domus_service_buckets", service="s1", dht="t", role="primary") == 4
    assert value(samples, "domus_service_buckets", service="s1", dht="t", role="routing") == 8
    assert value(samples, "domus_service_buckets", service="s1", dht="t", role="backup") == 0
    assert value(samples, "domus_service_dht_active", service="s1", dht="t") == 1
    assert value(samples, "domus_service_reply_cache_entries", service="s1") == 5
    assert value(samples, "domus_service_info", service="s1", version=__version__,
                 hot_path=path, secure="false") == 1
    fallbacks = value(samples, "domus_service_hot_path_fallbacks_total", service="s1")
    if path == "c":
        # C answered the puts, the gets and the retry, and read its own
        # counters: the rest (4 requests) it handed to Python
        assert handler.fast.requests == 11 and fallbacks == 4
    else:
        assert fallbacks == 0
    # (the process's own figures, from psutil)
    assert value(samples, "domus_service_cpu_seconds_total", service="s1", mode="user") > 0
    assert value(samples, "domus_service_resident_memory_bytes", service="s1") > 10 << 20
    served.handler.close()


def test_counters_the_collector_reads_from_the_handler(tmp_path):
    served = service(tmp_path)
    registry = service_metrics.registry_of(served)
    assert value(scrape(registry), "domus_service_unauthenticated_total", service="s1") == 0
    # what the deployment secret's MAC check counts into, read as it is
    served.handler.counters["unauthenticated"] = 3
    served.handler.counters["tcp_bytes_received"] = 120
    samples = scrape(registry)
    assert value(samples, "domus_service_unauthenticated_total", service="s1") == 3
    assert value(samples, "domus_service_bytes_received_total", service="s1",
                 transport="tcp") == 120
    assert value(samples, "domus_service_bytes_received_total", service="s1",
                 transport="udp") == 0
    assert value(samples, "domus_service_registered", service="s1") == 0
    served.handler.close()


@pytest.mark.parametrize("path", ["c", "python"])
def test_what_the_deployment_secret_refuses_is_counted(tmp_path, monkeypatch, path):
    if path == "python":
        monkeypatch.setattr(hotpath, "FastPath", None)
    elif hotpath.FastPath is None:
        pytest.skip("the C hot path is not built")
    secret_file = str(tmp_path / "secret" / "secret")
    secret.create(secret_file)
    served = DomusService(supervisor="127.0.0.1:1", listen="127.0.0.1:1",
                          data_dir=str(tmp_path / "s1"), name="s1", secret_file=secret_file)
    handler = served.handler
    handler.assign(descriptor())
    reactor = Reactor()
    served.udp = UdpServer(handler, "127.0.0.1", 0)
    served.udp.start(reactor)
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        client.connect(served.udp.address[:2])
        client.setblocking(False)
        key = served.keys.data
        put, get = keyed(wire.OP_PUT, key_in(0), b"v"), keyed(wire.OP_GET, key_in(0))
        forged = bytearray(auth.seal_request(key, put))
        forged[-1] ^= 1
        datagrams = [put,                                       # no MAC
                     bytes(forged),                             # a wrong one
                     auth.seal_request(key, get, int(time.time()) - 60),   # stale
                     auth.seal_request(key, put)]               # answered
        replies = exchange(reactor, client, datagrams, 2)
        assert len(replies) == 2
        samples = scrape(service_metrics.registry_of(served))
        me = {"service": "s1"}
        assert value(samples, "domus_service_unauthenticated_total", **me) == 2
        assert value(samples, "domus_service_stale_requests_total", **me) == 1
        assert value(samples, "domus_service_replies_total", status="stale_request", **me) == 1
        assert value(samples, "domus_service_replies_total", status="ok", **me) == 1
        assert value(samples, "domus_service_requests_total", op="put", **me) == 1
        assert value(samples, "domus_service_requests_total", op="get", **me) == 1
        assert value(samples, "domus_service_malformed_requests_total", **me) == 0
        assert value(samples, "domus_service_bytes_received_total", transport="udp",
                     **me) == sum(map(len, datagrams))
        assert value(samples, "domus_service_bytes_sent_total", transport="udp",
                     **me) == sum(map(len, replies))
        assert value(samples, "domus_service_info", version=__version__, hot_path=path,
                     secure="true", **me) == 1
        assert handler.stats()["unauthenticated"] == 2 and handler.stats()["stale"] == 1
        if path == "c":
            # C dropped the two and counted them; the stale one it handed over
            assert handler.fast.unauthenticated == 2
            assert handler.counters["unauthenticated"] == 0
        # what a refused TCP connection counts into (the data port's links)
        served._auth_failed("a peer without the secret")
        assert value(scrape(service_metrics.registry_of(served)),
                     "domus_service_unauthenticated_total", **me) == 3
    finally:
        client.close()
        served.udp.stop()
        handler.close()


def test_a_dht_that_goes_takes_its_series_with_it(tmp_path):
    served = service(tmp_path)
    registry = service_metrics.registry_of(served)
    assert ("domus_service_records", (("dht", "t"), ("service", "s1"))) in scrape(registry)
    served.handler.drop({"id": DHT_ID})
    assert not [key for key in scrape(registry) if ("dht", "t") in key[1]]


# ------------------------------------------------------------ moves

def test_a_move_by_hand_is_counted_by_the_supervisor_and_both_services(deployment):  # noqa: F811
    supervisor, links, records = deployment
    registries = {name: service_metrics.registry_of(link.service)
                  for name, link in links.items()}
    supervising = supervisor_metrics.registry_of(supervisor.metrics)
    before = scrape(supervising)
    assert value(before, "domus_supervisor_buckets", dht=NAME, service="s1",
                 role="storage") == 4
    answer = result_of(supervisor.op_move_bucket(HAND, name=NAME, bucket=2, role="storage",
                                                 service="s3"))
    assert answer["records"] == 20
    after = scrape(supervising)
    done = dict(by="hand", role="storage")
    assert value(after, "domus_supervisor_moves_total", outcome="done", **done) == 1
    assert value(after, "domus_supervisor_moves_total", outcome="failed", **done) == 0
    assert value(after, "domus_supervisor_move_seconds_count", **done) == 1
    assert value(after, "domus_supervisor_move_seconds_sum", **done) == pytest.approx(
        answer["seconds"], abs=0.01)
    assert value(after, "domus_supervisor_move_seconds_bucket", le="+Inf", **done) == 1
    for service_name, held in (("s1", 3), ("s2", 4), ("s3", 1)):
        assert value(after, "domus_supervisor_buckets", dht=NAME, service=service_name,
                     role="storage") == held
    source, target = scrape(registries["s1"]), scrape(registries["s3"])
    mine = dict(service="s1", dht=NAME)
    assert value(source, "domus_service_move_freezes_total", **mine) == 1
    assert value(source, "domus_service_move_buckets_sent_total", **mine) == 1
    assert value(source, "domus_service_move_buckets_thawed_total", **mine) == 0
    assert value(source, "domus_service_move_buckets_frozen", **mine) == 0
    assert 0 < value(source, "domus_service_move_frozen_seconds_total", **mine) < answer["seconds"]
    assert value(source, "domus_service_records", **mine) == 60
    assert value(source, "domus_service_buckets", role="primary", **mine) == 3
    theirs = dict(service="s3", dht=NAME)
    assert value(target, "domus_service_move_buckets_staged_total", **theirs) == 1
    assert value(target, "domus_service_move_records_staged_total", **theirs) == 20
    assert value(target, "domus_service_move_buckets_received_total", **theirs) == 1
    assert value(target, "domus_service_records", **theirs) == 20
    assert value(target, "domus_service_buckets", role="primary", **theirs) == 1


def test_a_failed_move_is_counted_as_failed_and_its_freeze_as_thawed(deployment):  # noqa: F811
    supervisor, links, records = deployment
    links["s3"].fail("assign", 2, ConnectionError("connection to service s3 lost"))
    with pytest.raises(ControlError):
        result_of(supervisor.op_move_bucket(HAND, name=NAME, bucket=2, role="storage",
                                            service="s3"))
    samples = scrape(supervisor_metrics.registry_of(supervisor.metrics))
    assert value(samples, "domus_supervisor_moves_total", by="hand", role="storage",
                 outcome="failed") == 1
    assert value(samples, "domus_supervisor_moves_total", by="hand", role="storage",
                 outcome="done") == 0
    source = scrape(service_metrics.registry_of(links["s1"].service))
    assert value(source, "domus_service_move_freezes_total", service="s1", dht=NAME) == 1
    assert value(source, "domus_service_move_buckets_thawed_total", service="s1",
                 dht=NAME) == 1
    assert value(source, "domus_service_move_buckets_sent_total", service="s1", dht=NAME) == 0
    assert value(source, "domus_service_records", service="s1", dht=NAME) == 80


def test_moves_by_the_supervisor_itself_are_labelled_by_who_asked(tmp_path):
    assert [supervisor_metrics.mover(by) for by in (
        "balancer", "rebalance", "dht services", "drain of s2", "resize", "hand")] == [
        "balancer", "rebalance", "services", "drain", "resize", "hand"]
    counted = SupervisorService(listen="127.0.0.1:1", data_dir=str(tmp_path)).metrics
    for seconds in (0.004, 0.01, 0.3, 700.0):
        counted.moved("drain of s2", "storage", seconds)
    buckets = {sample.labels["le"]: sample.value for family in counted.collect()
               if family.name == "domus_supervisor_move_seconds"
               for sample in family.samples if sample.name.endswith("_bucket")}
    # cumulative, each bound inclusive (0.01 counts in le="0.01")
    assert (buckets["0.01"], buckets["0.25"], buckets["0.5"], buckets["600.0"],
            buckets["+Inf"]) == (2, 2, 3, 3, 4)


# ------------------------------------------------------------ the supervisor

def test_control_requests_are_counted_by_op_and_outcome(deployment):  # noqa: F811
    supervisor, links, records = deployment
    control = supervisor.metrics.counted(supervisor.control)
    assert "version" in control({"op": "ping"}, HAND)
    for body, kind in (({"op": "open_dht", "name": "nope"}, "UnknownDht"),
                       ({"op": "no_such_op"}, "SupervisorError"),
                       ({"op": "open_dht", "wrong": 1}, "SupervisorError")):
        with pytest.raises(ControlError) as refused:
            control(body, HAND)
        assert refused.value.kind == kind
    # an op answered later counts when it is answered
    moving = control({"op": "move_bucket", "name": NAME, "bucket": 2, "role": "storage",
                      "service": "s3"}, HAND)
    result_of(moving)
    links["s3"].fail("stage_bucket", 1, ConnectionError("connection to service s3 lost"))
    failing = control({"op": "move_bucket", "name": NAME, "bucket": 3, "role": "storage",
                       "service": "s3"}, HAND)
    with pytest.raises(ControlError):
        result_of(failing)
    samples = scrape(supervisor_metrics.registry_of(supervisor.metrics))
    assert {labels: count for (name, labels), count in samples.items()
            if name == "domus_supervisor_control_requests_total"} == {
        (("op", "ping"), ("outcome", "ok")): 1,
        (("op", "open_dht"), ("outcome", "UnknownDht")): 1,
        (("op", "open_dht"), ("outcome", "SupervisorError")): 1,
        (("op", "unknown"), ("outcome", "SupervisorError")): 1,
        (("op", "move_bucket"), ("outcome", "ok")): 1,
        (("op", "move_bucket"), ("outcome", "SupervisorError")): 1}


def test_the_deployments_shape(deployment):  # noqa: F811
    supervisor, links, records = deployment
    # a replicated DHT with one backup range missing and one bucket lost
    supervisor.state.dhts["r"] = descriptor(
        id=2, name="r", replicas=2, storage_backups=[[[0, 4, "s2"], [6, 8, "s1"]]],
        storage_lost={"1": "s1"}, state="inactive")
    links["s3"].connected = False
    supervisor.draining.add("s2")
    supervisor.metrics.registrations += 3
    for why in ("no secret", "another secret"):
        supervisor._auth_failed(why)        # (what its links call, refusing a peer)
    supervisor.metrics.heartbeats += 7
    samples = scrape(supervisor_metrics.registry_of(supervisor.metrics))
    assert [value(samples, "domus_supervisor_services", state=state)
            for state in ("up", "unresponsive", "down")] == [2, 0, 1]
    assert [value(samples, "domus_supervisor_service_up", service=name)
            for name in ("s1", "s2", "s3")] == [1, 1, 0]
    assert value(samples, "domus_supervisor_service_draining", service="s2") == 1
    assert [value(samples, "domus_supervisor_dhts", state=state)
            for state in ("active", "inactive")] == [1, 1]
    assert value(samples, "domus_supervisor_dht_buckets", dht="r") == BUCKETS
    assert value(samples, "domus_supervisor_dht_active", dht="r") == 0
    assert value(samples, "domus_supervisor_dht_replicas", dht="r") == 2
    assert value(samples, "domus_supervisor_buckets", dht="r", service="s2",
                 role="backup") == 4
    assert value(samples, "domus_supervisor_buckets", dht="r", service="s1",
                 role="backup") == 2
    assert value(samples, "domus_supervisor_buckets", dht="r", service="s1",
                 role="routing") == 8
    assert value(samples, "domus_supervisor_missing_copies", dht="r") == 2     # 4 and 5
    assert value(samples, "domus_supervisor_missing_copies", dht=NAME) == 0
    assert value(samples, "domus_supervisor_lost_buckets", dht="r") == 1
    assert value(samples, "domus_supervisor_registrations_total") == 3
    assert value(samples, "domus_supervisor_heartbeats_total") == 7
    assert value(samples, "domus_supervisor_failovers_total") == 0
    assert value(samples, "domus_supervisor_refused_connections_total") == 2
    assert value(samples, "domus_supervisor_info", version=__version__,
                 balance=supervisor.balance,
                 secure="true" if supervisor.keys is not None else "false") == 1
    assert value(samples, "domus_supervisor_balancer_busy") == 0


# ------------------------------------------------------------ the page

def fetch(registry, path, **headers):
    """What the /metrics site answers a GET of ``path``: (status, headers,
    body)."""
    root = page._Root(registry, "Domus test")
    location, _, _query = path.partition("?")
    request = DummyRequest([part.encode() for part in location.strip("/").split("/")])
    request.uri = path.encode()
    for name, header in headers.items():
        request.requestHeaders.setRawHeaders(name.replace("_", "-").encode(), [header.encode()])
    body = getChildForRequest(root, request).render(request)
    return request.responseCode or 200, request.responseHeaders, body


def test_the_page_serves_the_registry_in_the_format_asked_for(tmp_path):
    registry = service_metrics.registry_of(service(tmp_path))
    status, headers, body = fetch(registry, "/metrics")
    assert status == 200
    assert headers.getRawHeaders(b"content-type") == [b"text/plain; version=0.0.4; "
                                                      b"charset=utf-8"]
    families = {family.name for family in text_string_to_metric_families(body.decode())}
    assert {"domus_service_requests", "domus_service_records",
            "domus_service_cpu_seconds"} <= families
    # what Prometheus asks for when it prefers OpenMetrics
    status, headers, body = fetch(
        registry, "/metrics", accept="application/openmetrics-text;version=1.0.0,text/plain;"
        "version=0.0.4;q=0.5")
    assert headers.getRawHeaders(b"content-type")[0].startswith(b"application/openmetrics-text")
    assert "domus_service_requests" in {family.name
                                        for family in openmetrics_families(body.decode())}
    # only some families; gzipped when the scraper accepts it
    status, headers, body = fetch(registry, "/metrics?name[]=domus_service_records_total"
                                  "&name[]=domus_service_records", accept_encoding="gzip")
    assert headers.getRawHeaders(b"content-encoding") == [b"gzip"]
    assert {family.name for family in text_string_to_metric_families(
        gzip.decompress(body).decode())} == {"domus_service_records"}


def test_the_page_names_itself_at_the_root_and_nothing_else_exists(tmp_path):
    registry = service_metrics.registry_of(service(tmp_path))
    assert fetch(registry, "/")[2] == b"Domus test: Prometheus metrics at /metrics\n"
    status, _headers, body = fetch(registry, "/metrics/more")
    assert status == 200      # (a leaf: whatever follows /metrics is the page too)
    status, _headers, body = fetch(registry, "/nothing")
    assert status == 404


def test_a_bad_metrics_address_is_refused_before_anything_starts(tmp_path):
    for bad in ("nowhere", "127.0.0.1:http", "127.0.0.1:70000"):
        with pytest.raises(ValueError, match="port"):
            DomusService(supervisor="127.0.0.1:1", listen="127.0.0.1:1",
                         data_dir=str(tmp_path), metrics=bad)


def test_the_flag_is_in_the_launch_record(tmp_path):
    made = DomusService(supervisor="127.0.0.1:1", listen="127.0.0.1:1",
                        data_dir=str(tmp_path), name="s1", metrics="127.0.0.1:9101")
    arguments = launch.arguments(made.launch)
    assert arguments[arguments.index("--metrics") + 1] == "127.0.0.1:9101"
    made.handler.close()
    plain = DomusService(supervisor="127.0.0.1:1", listen="127.0.0.1:1",
                         data_dir=str(tmp_path / "p"), name="s2")
    assert "--metrics" not in launch.arguments(plain.launch)
    plain.handler.close()
    supervising = SupervisorService(listen="127.0.0.1:1", data_dir=str(tmp_path / "sup"),
                                    metrics="127.0.0.1:9100")
    arguments = launch.arguments(supervising.state.launch)
    assert arguments[arguments.index("--metrics") + 1] == "127.0.0.1:9100"



def documented_metrics():
    """metric -> type, from the tables of docs/operations.md, "Metrics"."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    section = text[text.index("\n## Metrics\n"):]
    return dict(re.findall(r"^\| `(domus_\w+)` \| (\w+) \|", section, re.MULTILINE))


def test_every_metric_is_documented_with_its_type_and_nothing_else_is(tmp_path):
    families = [*service_metrics.ServiceCollector(service(tmp_path)).collect(),
                *SupervisorService(listen="127.0.0.1:1",
                                   data_dir=str(tmp_path / "sup")).metrics.collect()]
    exposed = {family.name + ("_total" if family.type == "counter" else ""): family.type
               for family in families}
    assert exposed == documented_metrics()
