"""The ``/metrics`` page that the supervisor and every service serve when
started with ``--metrics HOST:PORT``: Prometheus text over HTTP, on the
process's own Twisted reactor.

Each process keeps a ``prometheus_client.CollectorRegistry`` of its own
(never the library's global one) whose collectors read the process's state
when the page is fetched; nothing is computed on the request path.  The page
is rendered on the reactor thread, between two requests, like any other
event: prometheus_client's own ``twisted.MetricsResource`` runs the
collectors in the reactor's thread pool instead, where they would race
with the reactor over the dicts they read (and a service runs no threads).

Content negotiation is prometheus_client's (``choose_encoder``: the
Prometheus text format 0.0.4, or OpenMetrics when the scraper asks for it),
``?name[]=...`` limits the page to those metric families, and the page is
gzipped for a scraper that accepts it.  ``GET /`` says where the metrics
are; every other path is 404.

The metrics each process exposes are listed in docs/operations.md,
"Metrics"; ``process_families`` gives the CPU and memory ones, which both
sides share.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.registry import CollectorRegistry
from twisted.web.pages import notFound
from twisted.web.resource import Resource
from twisted.web.server import Request, Site

from domus.wire import address as addresses

PATH = b"metrics"


class MetricsPage(Resource):
    """``/metrics``: the registry's collectors, read now."""

    isLeaf = True

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__()
        self.registry = registry

    def render_GET(self, request: Request) -> bytes:  # noqa: N802 (twisted.web's name)
        accept = (request.getHeader("accept") or "")
        encoder, content_type = choose_encoder(accept)
        query = parse_qs(urlsplit(request.uri.decode("latin-1")).query)
        registry: Any = self.registry
        if "name[]" in query:
            registry = registry.restricted_registry(query["name[]"])
        page = encoder(registry)
        request.setHeader(b"content-type", content_type.encode("ascii"))
        if gzip_accepted(request.getHeader("accept-encoding") or ""):
            page = gzip.compress(page)
            request.setHeader(b"content-encoding", b"gzip")
        return page


class _Root(Resource):
    """``/`` names the page; ``/metrics`` is it; anything else is 404."""

    def __init__(self, registry: CollectorRegistry, title: str) -> None:
        super().__init__()
        self.title = title
        self.putChild(PATH, MetricsPage(registry))

    def getChild(self, path: bytes, request: Request) -> Resource:  # noqa: N802
        if path == b"":
            return self
        return notFound("No such page", f"The metrics are at /{PATH.decode()}.")

    def render_GET(self, request: Request) -> bytes:  # noqa: N802
        request.setHeader(b"content-type", b"text/plain; charset=utf-8")
        return f"{self.title}: Prometheus metrics at /{PATH.decode()}\n".encode()


class _QuietSite(Site):
    """A Site that logs no line per request (a scrape every few seconds
    would fill the process's log)."""

    noisy = False

    def log(self, request: Request) -> None:
        pass


def listen(reactor: Any, address: str, registry: CollectorRegistry, title: str) -> Any:
    """Serve ``registry`` at ``http://address/metrics`` on ``reactor``;
    returns the listening port (stopListening() ends it).  Raises
    ValueError for a malformed address and twisted's CannotListenError
    when the port cannot be bound."""
    host, port = addresses.parse(address)
    return reactor.listenTCP(port, _QuietSite(_Root(registry, title)), interface=host)


class ProcessCounters:
    """This process's CPU time, memory and file descriptors (psutil), as
    metric families named ``<prefix>_...`` with ``labels``."""

    def __init__(self, prefix: str, labels: dict[str, str]) -> None:
        self.prefix = prefix
        self.labels = labels
        self.process = psutil.Process(os.getpid())

    def families(self) -> Iterator[Metric]:
        names, values = list(self.labels), list(self.labels.values())
        with self.process.oneshot():
            cpu = self.process.cpu_times()
            memory = self.process.memory_info()
            try:
                descriptors: int | None = self.process.num_fds()
            except (AttributeError, psutil.Error):   # (not on every system)
                descriptors = None
            started = self.process.create_time()
        seconds = CounterMetricFamily(f"{self.prefix}_cpu_seconds",
                                      "CPU time this process used, by mode",
                                      labels=[*names, "mode"])
        seconds.add_metric([*values, "user"], cpu.user)
        seconds.add_metric([*values, "system"], cpu.system)
        yield seconds
        yield gauge(f"{self.prefix}_resident_memory_bytes",
                    "resident set size of this process (RSS)", self.labels, memory.rss)
        yield gauge(f"{self.prefix}_virtual_memory_bytes",
                    "virtual memory size of this process", self.labels, memory.vms)
        if descriptors is not None:
            yield gauge(f"{self.prefix}_open_fds", "file descriptors this process has open",
                        self.labels, descriptors)
        yield gauge(f"{self.prefix}_start_time_seconds",
                    "when this process started, in seconds since the epoch", self.labels,
                    started)


def gauge(name: str, documentation: str, labels: dict[str, str], value: float) -> Metric:
    """A gauge family of one sample."""
    family = GaugeMetricFamily(name, documentation, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def counter(name: str, documentation: str, labels: dict[str, str], value: float) -> Metric:
    """A counter family of one sample (``name`` without ``_total``)."""
    family = CounterMetricFamily(name, documentation, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


__all__ = ["MetricsPage", "ProcessCounters", "counter", "gauge", "listen"]
