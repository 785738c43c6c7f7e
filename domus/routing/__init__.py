"""Routing graphs over a DHT's buckets, for distributed lookups.

    from domus.routing import make_graph, local_ranges
    graph = make_graph("bruijn", 65536, degree=4)
    local = local_ranges(bucket_map, "service-3")      # [(first, end), ...]
    graph.next_bucket(local, target, "fewest-hops")    # the next hop

Pure and in-process: no sockets, no state beyond the graph's parameters.
``domus.routing.base`` states what every graph guarantees; ``chord`` and
``bruijn`` say why their lookups end within ``hop_bound()`` hops.
"""

from __future__ import annotations

from domus.placement.bucketmap import local_ranges
from domus.routing.base import (
    FEWEST_HOPS,
    LEAST_WORK,
    MAX_BUCKETS,
    Ranges,
    RoutingGraph,
    check_ranges,
)
from domus.routing.bruijn import BruijnGraph
from domus.routing.chord import ChordGraph

GRAPHS: dict[str, type[RoutingGraph]] = {"chord": ChordGraph, "bruijn": BruijnGraph}


def make_graph(name: str, bucket_count: int, degree: int | None = None) -> RoutingGraph:
    """The routing graph ``name`` ("chord" or "bruijn") over ``bucket_count``
    buckets.  ``degree`` is the de Bruijn degree (default 2); chord has none.
    Raises ValueError for an unknown name, a degree given to chord, or a
    bucket count or degree the graph cannot use."""
    if name not in GRAPHS:
        raise ValueError(f"routing graph {name!r} is unknown; choose one of {list(GRAPHS)}")
    if name == "bruijn":
        return BruijnGraph(bucket_count, 2 if degree is None else degree)
    if degree is not None:
        raise ValueError(f"{name} graphs have no degree (got {degree!r}); leave it unset")
    return GRAPHS[name](bucket_count)


__all__ = ["GRAPHS", "make_graph", "RoutingGraph", "ChordGraph", "BruijnGraph",
           "local_ranges", "check_ranges", "Ranges", "FEWEST_HOPS", "LEAST_WORK",
           "MAX_BUCKETS"]
