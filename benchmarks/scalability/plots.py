"""The paper's figures from a run's points (matplotlib, no display)."""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

from benchmarks.scalability.model import NODES


def _best_by_nodes(points: list[dict[str, Any]]) -> dict[int, float]:
    best: dict[int, float] = {}
    for point in points:
        best[point["nodes"]] = max(best.get(point["nodes"], 0.0), point["throughput"])
    return dict(sorted(best.items()))


def curves(points: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    """Label -> {#nodes: best throughput over X}: each class and M, per
    system, and Domus's max over M."""
    grouped: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for point in points:
        if point["op"] != "put1" or point["experiment"] not in ("N Xcli M 1srv", "N Xcli 1srv"):
            continue
        if point["experiment"] == "N Xcli 1srv":
            grouped[f"{point['system']} N Xcli 1srv"].append(point)
        else:
            grouped[f"{point['system']} N Xcli {point['services']} 1srv"].append(point)
    result = {label: _best_by_nodes(group) for label, group in sorted(grouped.items())}
    disjoint = [p for p in points if p["system"] == "domus" and p["op"] == "put1"
                and p["experiment"] == "N Xcli M 1srv"]
    if disjoint:
        result["domus max(N Xcli M 1srv)"] = _best_by_nodes(disjoint)
    return result


def draw(run: dict[str, Any], directory: str, prefix: str = "scalability") -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy

    points = run["points"]
    made = []
    subtitle = (f"{run['date']}, {run['machine_short']}, delay: "
                f"{'none' if run['netem'].startswith('NO') else run['netem'].split(' (')[0]}, "
                f"load {run['load_average'][0]}")

    # Figure 1: aggregate put1 throughput against #nodes, per class
    figure, axes = plt.subplots(figsize=(8, 5))
    for label, series in curves(points).items():
        style = "-o" if label.startswith("domus") else "--s"
        width = 2.5 if "max" in label else 1.2
        axes.plot(list(series), [v / 1000 for v in series.values()], style, label=label,
                  linewidth=width)
        if "max" in label and len(series) > 1:
            slope, intercept = numpy.polyfit(list(series), list(series.values()), 1)
            xs = numpy.array(sorted(series))
            axes.plot(xs, (slope * xs + intercept) / 1000, ":", color="black",
                      label="linear(max(N Xcli M 1srv))")
    axes.set_xlabel("#nodes (hosts: network namespaces)")
    axes.set_ylabel("aggregate put1 throughput (1000 ops/s)")
    axes.set_title(f"Aggregate throughput per class\n{subtitle}", fontsize=9)
    axes.legend(fontsize=7)
    axes.grid(alpha=0.3)
    made.append(_save(figure, directory, f"{prefix}-throughput.png"))

    # Figure 2: CPU and network use per host (Domus N Xcli M 1srv)
    figure, (cpu_axes, net_axes) = plt.subplots(1, 2, figsize=(10, 4.5))
    disjoint = sorted((p for p in points if p["system"] == "domus" and p["op"] == "put1"
                       and p["experiment"] == "N Xcli M 1srv"),
                      key=lambda p: (p["services"], p["clients_per_host"], p["nodes"]))
    series: dict[str, list[tuple[int, float, float, float]]] = defaultdict(list)
    for point in disjoint:
        services = list(point["service_cpu"].values())
        clients = list(point["client_cpu"].values())
        traffic = list(point["network_bytes_per_s"].values())
        series[f"N {point['clients_per_host']}cli {point['services']} 1srv"].append(
            (point["nodes"], sum(services) / max(1, len(services)),
             sum(clients) / max(1, len(clients)),
             sum(traffic) / max(1, len(traffic)) * 8 / 1e6))
    for label, rows in series.items():
        xs = [row[0] for row in rows]
        line = cpu_axes.plot(xs, [row[1] for row in rows], "-o", label=f"u(cpu, srv, {label})")
        cpu_axes.plot(xs, [row[2] for row in rows], "--^", color=line[0].get_color(),
                      label=f"u(cpu, cli, {label})")
        net_axes.plot(xs, [row[3] for row in rows], "-o", label=label)
    cpu_axes.set_xlabel("#nodes")
    cpu_axes.set_ylabel("CPU per host (cores busy)")
    cpu_axes.set_title("CPU per service host and client host", fontsize=9)
    cpu_axes.legend(fontsize=6)
    net_axes.set_xlabel("#nodes")
    net_axes.set_ylabel("network per host (Mbit/s, in + out)")
    net_axes.set_title("Network per host", fontsize=9)
    net_axes.legend(fontsize=6)
    figure.suptitle(subtitle, fontsize=8)
    made.append(_save(figure, directory, f"{prefix}-resources.png"))

    # Figure 3: YCSB A-F, Domus and Redis Cluster
    ycsb = [p for p in points if p["op"] == "ycsb"]
    if ycsb:
        figure, axes = plt.subplots(figsize=(8, 4.5))
        workloads = sorted({p["experiment"].split()[-1] for p in ycsb})
        systems = sorted({p["system"] for p in ycsb})
        width = 0.8 / len(systems)
        for offset, system in enumerate(systems):
            rates = {p["experiment"].split()[-1]: p["throughput"] for p in ycsb
                     if p["system"] == system}
            axes.bar([i + offset * width for i in range(len(workloads))],
                     [rates.get(w, 0) / 1000 for w in workloads], width, label=system)
        axes.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(workloads))],
                        [f"YCSB {w}" for w in workloads])
        axes.set_ylabel("throughput (1000 ops/s)")
        axes.set_title(f"YCSB core workloads\n{subtitle}", fontsize=9)
        axes.legend()
        made.append(_save(figure, directory, f"{prefix}-ycsb.png"))

    # Figure 4: the model beyond this machine, measured points beside it
    model = run.get("model") or {}
    if model.get("predictions"):
        figure, axes = plt.subplots(figsize=(7, 4.5))
        for strategy, rows in model["predictions"].items():
            axes.plot([r["nodes"] for r in rows], [r["throughput"] for r in rows], "-",
                      label=f"model, lookup {strategy}")
        measured = curves(points).get("domus max(N Xcli M 1srv)", {})
        axes.plot(list(measured), list(measured.values()), "ko", label="measured (Domus, D)")
        saturates = model.get("supervisor_saturates_at_services")
        if saturates and saturates < NODES[-1] * 2:
            axes.axvline(saturates, color="red", linestyle=":",
                         label="supervisor heartbeat load = 1 core")
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xlabel("#nodes (one core each)")
        axes.set_ylabel("aggregate put1 throughput (ops/s)")
        axes.set_title(f"Model fitted to this run's per-request costs\n{subtitle}", fontsize=9)
        axes.legend(fontsize=7)
        axes.grid(alpha=0.3, which="both")
        made.append(_save(figure, directory, f"{prefix}-model.png"))
    plt.close("all")
    return made


def _save(figure: Any, directory: str, name: str) -> str:
    path = os.path.join(directory, name)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return path
