"""A service's Prometheus metrics (``domus service --metrics HOST:PORT``).

Nothing here runs on the request path.  The counters are the ones the
service keeps anyway: the C hot path's (``FastPath.by_op``, ``by_status``,
``replayed``, ``fallbacks``, ``unauthenticated``, bytes and socket errors,
kept in C), the Python handler's (the same, for the requests it answers,
and its error, ``unauthenticated`` and ``stale`` counters), the UDP
socket's and the TCP port's byte counts, and each hosted DHT's records,
buckets, lookups and moves.  ``ServiceCollector`` reads them
when ``/metrics`` is fetched and adds C's and Python's up (docs/
operations.md, "Metrics", lists every metric).

Every sample has the label ``service`` (the service's name); per-DHT ones
``dht`` too.  A DHT's series go when the service stops hosting it (its
counters start again from 0 if it comes back, which Prometheus's ``rate``
takes as a reset).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

from domus._version import __version__
from domus.service.handler import STATUS_KEYS, RequestHandler, status_name
from domus.wire import metrics
from domus.wire import protocol as wire

# The ops a request may name, by their names; any other op byte counts as
# "unknown".
OPS = wire.OP_NAMES
UNKNOWN_OP = "unknown"
# (counter name, key in handler.counters, what it counts)
HANDLER_COUNTERS = (
    ("malformed_requests", "malformed", "requests that could not be parsed (answered MALFORMED, "
     "BAD_VERSION or UNKNOWN_OP, or dropped when not even a request id could be read), "
     "and TCP frames that were not requests"),
    ("errors", "errors", "well-formed requests refused (NOT_OWNER, UNKNOWN_DHT, INACTIVE, "
     "MOVING, TOO_LARGE, ...), answered in Python"),
    ("internal_errors", "internal_errors", "bugs met while answering (INTERNAL replies, or a "
     "C path failure answered again in Python); each is logged"),
    ("storage_errors", "storage_errors", "storage failures (STORAGE_ERROR replies, failed "
     "flushes and activations); each is logged"),
    ("stale_requests", "stale", "requests whose MAC checked but whose time was more than "
     "TIME_WINDOW seconds from this service's clock (a replay, or a clock that is off), "
     "answered STALE_REQUEST and never applied"),
    ("oversized_frames", "oversized", "TCP frames over the size limit (the connection is "
     "closed)"),
    ("replicated", "replicated", "changes applied here as a backup, sent by their primary"),
    ("replication_failures", "replication_failures", "changes not acknowledged because a "
     "backup did not take them (answered MOVING; the client retries)"),
)
# (metric name, key of HostedDht.moves, what it counts)
MOVE_COUNTERS = (
    ("move_freezes", "frozen", "buckets frozen here as a move's (or a backup copy's) source"),
    ("move_frozen_seconds", "frozen_seconds", "seconds buckets stayed frozen here, summed "
     "(requests on a frozen bucket are answered MOVING and retried)"),
    ("move_buckets_sent", "sent", "frozen buckets that left this service (the move was done)"),
    ("move_buckets_thawed", "thawed", "frozen buckets served here again (a backup copy "
     "finished, a move undone or abandoned, a freeze lease that ran out)"),
    ("move_buckets_staged", "staged", "buckets whose records began to be staged here as a "
     "move's or a copy's target"),
    ("move_records_staged", "records_staged", "records (and deletions) staged here"),
    ("move_buckets_received", "received", "staged buckets this service took on, as primary "
     "or backup"),
    ("regroups", "regroups", "regroupings of this service's buckets after a resize, done"),
    ("regrouped_records", "records_regrouped", "records copied by those regroupings"),
)


class ServiceCollector:
    """The metrics of ``service`` (a domus.service.server.DomusService, or
    anything with its ``handler``, ``udp``, ``service_name`` and
    ``registered``), read at each collect()."""

    def __init__(self, service: Any) -> None:
        self.service = service
        self.process = metrics.ProcessCounters("domus_service",
                                               {"service": service.service_name})

    def collect(self) -> Iterator[Metric]:
        service = self.service
        handler: RequestHandler = service.handler
        name = service.service_name
        me = {"service": name}
        fast = handler.fast
        udp = service.udp
        counters = handler.counters

        yield from self._requests(handler, name)
        yield metrics.counter("domus_service_replayed", "changes answered from the reply "
                              "cache (a client's retry, applied once)", me,
                              counters["replayed"] + (fast.replayed if fast else 0))
        yield metrics.counter("domus_service_hot_path_fallbacks", "requests the C hot path "
                              "handed to the Python handler (errors, other ops, a DHT or "
                              "repository C does not drive)", me,
                              fast.fallbacks if fast else 0)
        yield metrics.counter("domus_service_unauthenticated", "requests dropped, "
                              "unanswered, for a missing or wrong MAC (by C or Python), and "
                              "TCP connections refused at the handshake (a peer without the "
                              "deployment's secret)", me,
                              counters["unauthenticated"]
                              + (fast.unauthenticated if fast else 0))
        for metric, key, documentation in HANDLER_COUNTERS:
            value = counters.get(key, 0)
            if key == "replicated" and fast is not None:
                value += fast.replicated        # (the REPLICATEs C applied)
            yield metrics.counter(f"domus_service_{metric}", documentation, me, value)
        yield metrics.counter("domus_service_forwarded", "replicated changes the C path sent "
                              "to their backups as REPLICATE datagrams", me,
                              fast.forwarded if fast else 0)
        yield metrics.counter("domus_service_forward_resends", "REPLICATE datagrams sent "
                              "again, unanswered in time (a backup slow, paused or gone)", me,
                              fast.forward_resends if fast else 0)
        yield metrics.counter("domus_service_late_answers", "backups' answers to REPLICATEs "
                              "no longer waited for (to a resend, or to a change already "
                              "failed), dropped", me, fast.late_answers if fast else 0)
        yield metrics.counter("domus_service_busy", "requests answered BUSY, unapplied: "
                              "the reply cache full of replies still young, or a SCAN past "
                              "its bounds (by C or Python)", me,
                              counters.get("busy", 0) + (fast.busy if fast else 0))
        yield metrics.counter("domus_service_shed", "datagrams answered BUSY unserved: they "
                              "waited too long in a standing queue (overload)", me,
                              counters.get("shed", 0) + (fast.shed if fast else 0))
        yield metrics.gauge("domus_service_reply_cache_entries", "replies held in the reply "
                            "cache", me, len(handler.reply_cache))

        received = CounterMetricFamily("domus_service_bytes_received", "bytes of requests "
                                       "received, by transport (UDP payloads, MACs and "
                                       "dropped datagrams included; TCP as read, frame "
                                       "headers, handshakes and tags included)",
                                       labels=["service", "transport"])
        sent = CounterMetricFamily("domus_service_bytes_sent", "bytes of replies sent, by "
                                   "transport (as for bytes received)",
                                   labels=["service", "transport"])
        received.add_metric([name, "udp"], (fast.bytes_received if fast else 0)
                            + (udp.bytes_received if udp else 0))
        sent.add_metric([name, "udp"], (fast.bytes_sent if fast else 0)
                        + (udp.bytes_sent if udp else 0))
        received.add_metric([name, "tcp"], counters.get("tcp_bytes_received", 0))
        sent.add_metric([name, "tcp"], counters.get("tcp_bytes_sent", 0))
        yield received
        yield sent
        socket_errors = CounterMetricFamily("domus_service_udp_socket_errors", "errors the "
                                            "UDP socket reported and the service went past "
                                            "(a reply not sent, an ICMP error of an earlier "
                                            "datagram); the client retries",
                                            labels=["service", "direction"])
        socket_errors.add_metric([name, "receive"], (fast.recv_errors if fast else 0)
                                 + (udp.recv_errors if udp else 0))
        socket_errors.add_metric([name, "send"], (fast.send_errors if fast else 0)
                                 + (udp.send_errors if udp else 0))
        yield socket_errors
        yield metrics.counter("domus_service_udp_kernel_drops", "datagrams the kernel "
                              "dropped, the UDP socket's buffer full (SO_RXQ_OVFL, as last "
                              "read with a datagram; modulo 2**32): overload that the "
                              "service sheds from then on", me,
                              max(fast.kernel_drops if fast else 0,
                                  udp.shedder.drops if udp else 0))

        room = handler.headroom
        if room is not None:
            yield metrics.gauge("domus_service_disk_free_bytes", "free bytes on the "
                                "filesystem of the service's data dir (as an unprivileged "
                                "process may use them)", me, room.free)
            yield metrics.gauge("domus_service_disk_reserve_bytes", "the free space the "
                                "service keeps there (--disk-reserve)", me, room.reserve_bytes)
            yield metrics.gauge("domus_service_disk_full", "1 while the disk is at its "
                                "reserve: puts on disk DHTs are refused (StorageFull)", me,
                                1 if room.full else 0)
        yield metrics.counter("domus_service_storage_full", "changes refused for want of room "
                              "(the disk reserve, no space left, a full RAM Berkeley DB "
                              "cache): nothing stored", me, counters.get("storage_full", 0))
        yield from self._dhts(handler, name)
        yield from self.process.families()
        info = GaugeMetricFamily("domus_service_info", "always 1: the service's version, "
                                 "whether its hot path is C or Python, and whether it is "
                                 "secure (its datagrams and connections authenticated)",
                                 labels=["service", "version", "hot_path", "secure"])
        info.add_metric([name, __version__, "c" if fast is not None else "python",
                         "true" if handler.data_key is not None else "false"], 1)
        yield info
        yield metrics.gauge("domus_service_registered", "1 while the service is registered "
                            "with the supervisor (it serves data either way)", me,
                            1 if service.registered else 0)

    @staticmethod
    def _requests(handler: RequestHandler, name: str) -> Iterator[Metric]:
        by_op, by_status = list(handler.by_op), list(handler.by_status)
        fast = handler.fast
        if fast is not None:
            by_op = [mine + theirs for mine, theirs in zip(by_op, fast.by_op)]
            by_status = [mine + theirs for mine, theirs in zip(by_status, fast.by_status)]
        requests = CounterMetricFamily("domus_service_requests", "requests received, by "
                                       "operation (whichever path answered them; a retry "
                                       "counts again)", labels=["service", "op"])
        for op, op_name in OPS.items():
            requests.add_metric([name, op_name], by_op[op])
        requests.add_metric([name, UNKNOWN_OP],
                            sum(count for op, count in enumerate(by_op) if op not in OPS))
        yield requests
        replies = CounterMetricFamily("domus_service_replies", "replies given, by status "
                                      "(ok, not_found, and each error)",
                                      labels=["service", "status"])
        for status in sorted(STATUS_KEYS.keys() | {s for s, n in enumerate(by_status) if n}):
            replies.add_metric([name, status_name(status)], by_status[status])
        yield replies

    @staticmethod
    def _dhts(handler: RequestHandler, name: str) -> Iterator[Metric]:
        per_dht = ["service", "dht"]
        records = GaugeMetricFamily("domus_service_records", "records stored here (primary "
                                    "copies, and buckets frozen for a move)", labels=per_dht)
        storage_bytes = GaugeMetricFamily("domus_service_storage_bytes", "bytes the DHT's "
                                          "records occupy here, where its platform can tell "
                                          "(Berkeley DB: its pages)", labels=per_dht)
        buckets = GaugeMetricFamily("domus_service_buckets", "buckets held here, by role "
                                    "(primary: stored and served; backup: a replica; "
                                    "routing: routed by this service)",
                                    labels=[*per_dht, "role"])
        active = GaugeMetricFamily("domus_service_dht_active", "1 if the DHT is active here, "
                                   "0 if deactivated", labels=per_dht)
        lost = GaugeMetricFamily("domus_service_lost_buckets", "buckets of the DHT whose "
                                 "every copy was lost (DATA_LOST until the loss is accepted)",
                                 labels=per_dht)
        frozen = GaugeMetricFamily("domus_service_move_buckets_frozen", "buckets frozen here "
                                   "now (being moved away, or copied to a backup)",
                                   labels=per_dht)
        unopened = GaugeMetricFamily("domus_service_storage_unopened", "1 while the DHT's "
                                     "store, or a bucket of it, will not open here (the "
                                     "service tries again with backoff)", labels=per_dht)
        lookups = CounterMetricFamily("domus_service_lookups", "distributed LOOKUP hops "
                                      "answered here: found (the target bucket is routed "
                                      "here: the last hop) or forwarded (told the next hop)",
                                      labels=[*per_dht, "result"])
        moves = {metric: CounterMetricFamily(f"domus_service_{metric}", documentation,
                                             labels=per_dht)
                 for metric, _key, documentation in MOVE_COUNTERS}
        for hosted in list(handler.dhts.values()):
            labels = [name, hosted.name]
            records.add_metric(labels, hosted.records())
            size = hosted.storage_bytes()
            if size is not None:
                storage_bytes.add_metric(labels, size)
            buckets.add_metric([*labels, "primary"], len(hosted.repos) + len(hosted.frozen))
            buckets.add_metric([*labels, "backup"], len(hosted.backups))
            buckets.add_metric([*labels, "routing"], hosted.routing_bucket_count)
            active.add_metric(labels, 1 if hosted.active else 0)
            lost.add_metric(labels, len(hosted.lost))
            frozen.add_metric(labels, len(hosted.frozen))
            unopened.add_metric(labels, 1 if hosted.needs_retry() else 0)
            for result, count in hosted.lookups.items():
                lookups.add_metric([*labels, result], count)
            for metric, key, _documentation in MOVE_COUNTERS:
                moves[metric].add_metric(labels, hosted.moves[key])
        yield from (records, storage_bytes, buckets, active, lost, frozen, unopened, lookups,
                    *moves.values())


def registry_of(service: Any) -> CollectorRegistry:
    """A registry of this service's own (not prometheus_client's global
    one) holding its collector (described by a first collect, so that
    ``?name[]=`` can pick its families)."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(ServiceCollector(service))
    return registry


def listen(reactor: Any, address: str, service: Any) -> Any:
    """Serve ``service``'s metrics at ``http://address/metrics``; returns
    the listening port."""
    return metrics.listen(reactor, address, registry_of(service),
                          f"Domus service {service.service_name}")


__all__ = ["ServiceCollector", "listen", "registry_of"]
