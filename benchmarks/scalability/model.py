"""A model of aggregate throughput beyond this machine, fitted to the
measured per-request costs.

Per request a service spends ``s`` CPU seconds per message it handles and a
client ``c``; a lookup strategy costs ``m`` messages per request at the
services (1 for D; 1 + hops for the distributed ones, hops growing as
``a * log2(buckets)``, buckets = 64 per service).  On n nodes of one core,
with M service nodes and N = n - M client nodes, throughput is
min(M / (s m), N / c), best at M / N = s m / c, which gives

    throughput(n) = n / (s m + c)

linear in n: the paper's linear(max(N Xcli M 1srv)).  Where it breaks is
what the model leaves out: the supervisor's heartbeat load (measured: CPU
per service), the network's bisection (bytes per request, measured), and
everything a real cluster adds (other jobs, switches, stragglers).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

NODES = (16, 32, 64, 128, 256, 512, 1024)
BUCKETS_PER_SERVICE = 64


def _median(values: list[float]) -> float | None:
    values = [value for value in values if value and math.isfinite(value)]
    return statistics.median(values) if values else None


def fit(points: list[dict[str, Any]], heartbeats: dict[str, Any] | None) -> dict[str, Any]:
    domus = [p for p in points if p.get("system") == "domus" and p["throughput"] > 0]
    disjoint = [p for p in domus if p["experiment"] == "N Xcli M 1srv"]
    service_cost = _median([sum(p["service_cpu"].get(f"{h}", 0.0) for h in p["service_cpu"])
                            / p["throughput"] for p in disjoint])
    client_cost = _median([sum(p["client_cpu"].values()) / p["throughput"] for p in disjoint])
    wire = _median([sum(p["network_bytes_per_s"].values()) / 2 / p["throughput"]
                    for p in disjoint])
    hops = {}
    for p in domus:
        if p["experiment"] == "lookup strategies":
            buckets = BUCKETS_PER_SERVICE * p["services"]
            # a request costs its hops in messages at services: 1 for a
            # direct lookup, more for a distributed one, whose hops past the
            # first grow with log2(buckets)
            hops[p["lookup"]] = {"hops": p["hops"], "buckets": buckets,
                                 "per_log2_bucket": max(0.0, p["hops"] - 1.0)
                                 / math.log2(buckets) if buckets > 1 else 0.0}
    model: dict[str, Any] = {"service_cpu_per_message_s": service_cost,
                             "client_cpu_per_request_s": client_cost,
                             "bytes_per_request": wire, "hops": hops,
                             "supervisor": heartbeats, "predictions": {}}
    if not service_cost or not client_cost:
        model["error"] = "not enough Domus points to fit"
        return model
    for strategy, measured in {"D": {"per_log2_bucket": 0.0}, **hops}.items():
        rows = []
        for nodes in NODES:
            # the best split for this strategy (one core per node)
            share = 1.0 / (1.0 + client_cost / service_cost)
            services = max(1, round(nodes * share))
            messages = 1.0 + measured["per_log2_bucket"] * math.log2(
                BUCKETS_PER_SERVICE * services)
            rate = nodes / (service_cost * messages + client_cost)
            rows.append({"nodes": nodes, "service_nodes": services,
                         "messages_per_request": round(messages, 2), "throughput": rate})
        model["predictions"][strategy] = rows
    if heartbeats and heartbeats.get("cpu_per_service"):
        model["supervisor_saturates_at_services"] = 1.0 / heartbeats["cpu_per_service"]
    return model


def describe(model: dict[str, Any], measured: dict[int, float]) -> list[str]:
    """The model's table as lines, measured points beside it."""
    if "error" in model:
        return [f"model: {model['error']}"]
    lines = [f"model: service {model['service_cpu_per_message_s'] * 1e6:.1f} us CPU per "
             f"message, client {model['client_cpu_per_request_s'] * 1e6:.1f} us CPU per "
             f"request, {model['bytes_per_request'] or 0:.0f} bytes on the wire per request"]
    for strategy, info in model["hops"].items():
        lines.append(f"  {strategy}: {info['hops']:.2f} hops at {info['buckets']} buckets "
                     f"({info['per_log2_bucket']:.3f} per log2 bucket)")
    for nodes, rate in sorted(measured.items()):
        lines.append(f"  measured: {nodes} nodes: {rate:,.0f} put1/s")
    strategies = list(model["predictions"])
    lines.append("  nodes  " + "  ".join(f"{s:>14}" for s in strategies))
    for index, nodes in enumerate(NODES):
        lines.append(f"  {nodes:>5}  " + "  ".join(
            f"{model['predictions'][s][index]['throughput']:>12,.0f}/s" for s in strategies))
    saturates = model.get("supervisor_saturates_at_services")
    if saturates:
        lines.append(f"  the supervisor's heartbeat load reaches one core at about "
                     f"{saturates:,.0f} services (1 heartbeat/s each)")
    return lines
