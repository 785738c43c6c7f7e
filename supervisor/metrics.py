"""The supervisor's Prometheus metrics (``domus supervisor --metrics
HOST:PORT``).

``SupervisorMetrics`` counts what the supervisor does as it does it
(registrations, heartbeats, control requests by op and outcome, bucket
moves and their seconds, failovers, repairs): plain counts, kept whether or
not metrics are served, at the cost of an increment.  Its collector reads
those, the connections the supervisor refused at the handshake (its own
``auth_failures``) and, at each scrape, the deployment's shape from the
supervisor's state: services by state, DHTs, buckets per DHT, service and
role, missing copies and lost buckets.  docs/operations.md, "Metrics", lists them all.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import CollectorRegistry
from twisted.internet import defer
from twisted.python.failure import Failure

from domus._version import __version__
from domus.placement import layout, replicas
from domus.wire import metrics
from domus.wire.control import ControlError

SERVICE_STATES = ("up", "unresponsive", "down")
ROLES = ("routing", "storage", "backup")
# Who moved a bucket: by hand (``domus dht move``), the balancer by itself,
# ``domus dht rebalance``, a drain, ``domus dht services``, or a halving
# (its odd buckets first go to their pair's service).
MOVERS = ("hand", "balancer", "rebalance", "drain", "services", "resize")
# Upper bounds of the move-duration histogram's buckets, in seconds.
MOVE_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                300.0, 600.0)
UNKNOWN_OP = "unknown"


def mover(by: str) -> str:
    """The ``by`` label of a move made on behalf of ``by`` (what the
    supervisor's ``_carry_out`` is told: "balancer", "rebalance", "dht
    services", "drain of s2"...)."""
    if by in MOVERS:
        return by
    if by.startswith("drain"):
        return "drain"
    if by.endswith("services"):
        return "services"
    return by.split()[0] if by.split() else "other"


class SupervisorMetrics:
    """What ``supervisor`` (a domus.supervisor.server.SupervisorService)
    has done, counted; and a registry of its own that serves those counts
    and the deployment's shape."""

    def __init__(self, supervisor: Any) -> None:
        self.supervisor = supervisor
        self.registrations = 0
        self.heartbeats = 0
        self.failovers = 0
        self.repairs: Counter[str] = Counter()            # outcome -> copies
        self.control: Counter[tuple[str, str]] = Counter()    # (op, outcome)
        self.moves: Counter[tuple[str, str, str]] = Counter()  # (by, role, outcome)
        # (by, role) -> [count per histogram bucket (the last: over the top)], sum
        self.move_seconds: dict[tuple[str, str], tuple[list[int], list[float]]] = {}
        self.process = metrics.ProcessCounters("domus_supervisor", {})

    # ------------------------------------------------------------ counting
    def moved(self, by: str, role: str, seconds: float) -> None:
        """A bucket move (or a backup's) done, in ``seconds``."""
        by = mover(by)
        self.moves[(by, role, "done")] += 1
        counts, total = self.move_seconds.setdefault((by, role),
                                                     ([0] * (len(MOVE_SECONDS) + 1), [0.0]))
        counts[bisect.bisect_left(MOVE_SECONDS, seconds)] += 1
        total[0] += seconds

    def move_failed(self, by: str, role: str) -> None:
        """A move that was started and failed (undone: nothing moved)."""
        self.moves[(mover(by), role, "failed")] += 1

    def counted(self, control: Callable[[dict[str, Any], Any], Any]) -> Callable[..., Any]:
        """``control`` (the supervisor's control handler), counting each
        request by op and outcome: "ok", or the error it was refused with
        (the domus.errors class a client raises), or "internal" for a bug.
        An op the supervisor has not is counted as "unknown" (a peer
        chooses the op: it must not choose the label)."""
        supervisor = self.supervisor

        def handle(body: dict[str, Any], link: Any) -> Any:
            op = body.get("op")
            label = op if isinstance(op, str) and callable(
                getattr(supervisor, f"op_{op}", None)) else UNKNOWN_OP
            try:
                result = control(body, link)
            except ControlError as exc:
                self.control[(label, exc.kind)] += 1
                raise
            except Exception:
                self.control[(label, "internal")] += 1
                raise
            if isinstance(result, defer.Deferred):
                return result.addBoth(self._outcome, label)
            self.control[(label, "ok")] += 1
            return result

        return handle

    def _outcome(self, result: Any, label: str) -> Any:
        if isinstance(result, Failure):
            kind = result.value.kind if isinstance(result.value, ControlError) else "internal"
            self.control[(label, kind)] += 1
        else:
            self.control[(label, "ok")] += 1
        return result

    # ------------------------------------------------------------ exposing
    def collect(self) -> Iterator[Metric]:
        yield metrics.counter("domus_supervisor_registrations", "services' registrations "
                              "accepted (a service registers again after it reconnects)",
                              {}, self.registrations)
        yield metrics.counter("domus_supervisor_heartbeats", "heartbeats received from "
                              "services", {}, self.heartbeats)
        yield metrics.counter("domus_supervisor_refused_connections", "TCP connections "
                              "refused at the handshake: a peer without the deployment's "
                              "secret, or with another one (each is logged)", {},
                              self.supervisor.auth_failures)
        yield metrics.counter("domus_supervisor_failovers", "failovers: a service taken out "
                              "of the copies of the replicated DHTs it held, its primaries' "
                              "backups promoted", {}, self.failovers)
        repairs = CounterMetricFamily("domus_supervisor_repairs", "missing backups copied "
                                      "to another service (done), or tried and failed",
                                      labels=["outcome"])
        for outcome in ("done", "failed"):
            repairs.add_metric([outcome], self.repairs[outcome])
        yield repairs
        control = CounterMetricFamily("domus_supervisor_control_requests", "control requests "
                                      "answered, by op and outcome (ok, or the error class "
                                      "the caller gets)", labels=["op", "outcome"])
        for (op, outcome), count in sorted(self.control.items()):
            control.add_metric([op, outcome], count)
        yield control
        moves = CounterMetricFamily("domus_supervisor_moves", "bucket moves, by who asked "
                                    "(hand, balancer, rebalance, drain, services, resize), "
                                    "role (routing, storage, backup) and outcome (done, "
                                    "failed: undone, nothing moved)",
                                    labels=["by", "role", "outcome"])
        shown = {(by, role, outcome): 0 for by in ("hand", "balancer") for role in ROLES
                 for outcome in ("done", "failed")}
        shown.update(self.moves)
        for (by, role, outcome), count in sorted(shown.items()):
            moves.add_metric([by, role, outcome], count)
        yield moves
        seconds = HistogramMetricFamily("domus_supervisor_move_seconds", "how long each "
                                        "bucket move that was done took, from the request "
                                        "to the new layout (the bucket is frozen for the "
                                        "last catch-up only)", labels=["by", "role"])
        for (by, role), (counts, total) in sorted(self.move_seconds.items()):
            cumulative, running = [], 0
            for bound, count in zip((*MOVE_SECONDS, float("inf")), counts):
                running += count
                cumulative.append((repr(bound) if bound != float("inf") else "+Inf", running))
            seconds.add_metric([by, role], cumulative, total[0])
        yield seconds
        yield from self._shape()
        yield from self.process.families()
        yield metrics.gauge("domus_supervisor_balancer_busy", "1 while the balancer (or a "
                            "rebalance, drain, repair or resize) is moving buckets",
                            {}, 1 if self.supervisor._balancing else 0)
        info = GaugeMetricFamily("domus_supervisor_info", "always 1: the supervisor's "
                                 "version, balance mode and whether it is secure (it has a "
                                 "secret: every connection authenticated)",
                                 labels=["version", "balance", "secure"])
        info.add_metric([__version__, self.supervisor.balance,
                         "true" if self.supervisor.keys is not None else "false"], 1)
        yield info

    def _shape(self) -> Iterator[Metric]:
        """The deployment as the supervisor's state describes it now."""
        supervisor = self.supervisor
        state = supervisor.state
        states = {name: supervisor.service_state(name) for name in sorted(state.services)}
        services = GaugeMetricFamily("domus_supervisor_services", "registered services, by "
                                     "state (up, unresponsive: no heartbeat lately, down: "
                                     "no link)", labels=["state"])
        tally = Counter(states.values())
        for name in SERVICE_STATES:
            services.add_metric([name], tally[name])
        yield services
        service_up = GaugeMetricFamily("domus_supervisor_service_up", "1 if the service is "
                                       "up, 0 if unresponsive or down", labels=["service"])
        for name, now in states.items():
            service_up.add_metric([name], 1 if now == "up" else 0)
        yield service_up
        draining = GaugeMetricFamily("domus_supervisor_service_draining", "1 while the "
                                     "service is being drained", labels=["service"])
        for name in states:
            draining.add_metric([name], 1 if name in supervisor.draining else 0)
        yield draining

        dht_states: Counter[str] = Counter()
        buckets = GaugeMetricFamily("domus_supervisor_dht_buckets", "the DHT's bucket count",
                                    labels=["dht"])
        active = GaugeMetricFamily("domus_supervisor_dht_active", "1 if the DHT is active, "
                                   "0 if deactivated", labels=["dht"])
        copies = GaugeMetricFamily("domus_supervisor_dht_replicas", "copies the DHT keeps "
                                   "of each bucket", labels=["dht"])
        held = GaugeMetricFamily("domus_supervisor_buckets", "buckets each service holds "
                                 "of each DHT, by role (routing; storage: primary copies; "
                                 "backup), moves included", labels=["dht", "service", "role"])
        missing = GaugeMetricFamily("domus_supervisor_missing_copies", "backup copies the "
                                    "DHT lacks (repaired by themselves when a service can "
                                    "take them)", labels=["dht"])
        lost = GaugeMetricFamily("domus_supervisor_lost_buckets", "buckets whose every copy "
                                 "was lost (DataLost until `domus dht accept-loss`)",
                                 labels=["dht"])
        for name, descriptor in sorted(state.dhts.items()):
            dht_state = descriptor.get("state", "active")
            dht_states[dht_state] += 1
            buckets.add_metric([name], descriptor["buckets"])
            active.add_metric([name], 1 if dht_state == "active" else 0)
            copies.add_metric([name], descriptor.get("replicas") or 1)
            counts: dict[str, Counter[str]] = {
                "routing": _held(layout.owners(descriptor, "routing")),
                "storage": _held(layout.owners(descriptor, "storage")),
                "backup": sum((_held(copy) for copy in replicas.backups(descriptor)),
                              Counter())}
            involved = {entry["name"] for role in ("routing_services", "storage_services")
                        for entry in descriptor[role]}
            for service in sorted(involved | {s for c in counts.values() for s in c}):
                for role in ROLES:
                    held.add_metric([name, service, role], counts[role][service])
            missing.add_metric([name], sum(end - first for _rank, first, end
                                           in replicas.missing(descriptor)))
            lost.add_metric([name], len(descriptor.get("storage_lost") or {}))
        dhts = GaugeMetricFamily("domus_supervisor_dhts", "DHTs, by state", labels=["state"])
        for name in ("active", "inactive"):
            dhts.add_metric([name], dht_states[name])
        yield from (dhts, buckets, active, copies, held, missing, lost)


def _held(owners: Any) -> Counter[str]:
    """service -> buckets it owns in a bucket map."""
    held: Counter[str] = Counter()
    for first, end, owner in owners.ranges():
        if owner is not None:
            held[owner] += end - first
    return held


def registry_of(supervisor_metrics: SupervisorMetrics) -> CollectorRegistry:
    """A registry of this supervisor's own (not prometheus_client's global
    one) holding its collector (described by a first collect, so that
    ``?name[]=`` can pick its families)."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(supervisor_metrics)
    return registry


def listen(reactor: Any, address: str, supervisor_metrics: SupervisorMetrics) -> Any:
    """Serve the supervisor's metrics at ``http://address/metrics``;
    returns the listening port."""
    return metrics.listen(reactor, address, registry_of(supervisor_metrics),
                          "Domus supervisor")


__all__ = ["SupervisorMetrics", "listen", "mover", "registry_of"]
