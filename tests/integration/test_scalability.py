"""``python -m benchmarks.scalability --quick``: the suite runs end to end
on network namespaces (as root), measures Domus, Redis Cluster and MariaDB
in the same run, the YCSB workloads and the model, writes its JSON and
figures, and leaves no namespace or process behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="the scalability suite makes network namespaces (ip netns, "
    "veth, a bridge): it needs root")


def test_quick_run_measures_every_system_and_cleans_up(tmp_path):
    for tool in ("ip", "redis-server", "mariadbd"):
        if not any((Path(d) / tool).exists() for d in
                   os.environ.get("PATH", "").split(":") + ["/usr/sbin", "/sbin"]):
            pytest.fail(f"{tool} is missing: `make` installs it (iproute2, redis-server, "
                        f"mariadb-server)")
    output = tmp_path / "run.json"
    finished = subprocess.run(
        [sys.executable, "-m", "benchmarks.scalability", "--quick", "--json", str(output),
         "--png-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    run = json.loads(output.read_text())
    assert run["notes"] == [], run["notes"]
    # the delay is either applied or its absence said, on the terminal too
    assert run["netem"].startswith(("50 us one way", "NO DELAY"))
    assert run["netem"] in finished.stdout
    assert "load average" in finished.stdout
    points = run["points"]
    assert all(point["throughput"] > 0 and point["ops"] > 0 for point in points)

    def having(**fields):
        return [p for p in points if all(p.get(k) == v for k, v in fields.items())]

    # both classes, with more hosts than one, and the baselines on the same hosts
    for system in ("domus", "redis", "mariadb"):
        assert {p["nodes"] for p in having(system=system, experiment="N Xcli M 1srv",
                                           op="put1")} >= {2, 3}, system
        assert having(system=system, op="get"), system
    assert {p["nodes"] for p in having(experiment="N Xcli 1srv")} == {1, 2}
    assert {p["lookup"] for p in having(experiment="lookup strategies")} == {"D", "C,R 0.5",
                                                                             "R"}
    assert having(experiment="disk") and having(experiment="8 DHTs")
    assert {p["instances"] for p in having(experiment="--instances")} == {1, 2}
    # YCSB A-F on Domus and Redis, with latency percentiles per operation
    for system in ("domus", "redis"):
        ycsb = {p["experiment"]: p for p in having(system=system, op="ycsb")}
        assert set(ycsb) == {f"YCSB {w}" for w in "ABCDEF"}, system
        assert set(ycsb["YCSB A"]["latency"]) == {"read", "update"}
        assert set(ycsb["YCSB E"]["latency"]) <= {"scan", "insert"}
        assert "scan" in ycsb["YCSB E"]["latency"]
        assert set(ycsb["YCSB F"]["latency"]) == {"read", "rmw"}
        for figures in ycsb["YCSB A"]["latency"].values():
            assert 0 < figures["p50_us"] <= figures["p99_us"] <= figures["p999_us"]
    # CPU and network use per host were measured
    disjoint = having(system="domus", experiment="N Xcli M 1srv")
    assert all(p["service_cpu"] and p["client_cpu"] and p["network_bytes_per_s"]
               for p in disjoint)
    # the model, and the supervisor under simulated heartbeats
    assert run["model"]["predictions"]["D"][-1]["nodes"] == 1024
    assert run["model"]["supervisor"]["services"] == run["plan"]["heartbeat_services"]
    for figure in run["figures"]:
        assert (tmp_path / figure).read_bytes()[:8] == PNG_MAGIC
    assert len(run["figures"]) == 4
    # nothing left behind: namespaces, processes, the work dir
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{run['namespace_tag']}-" not in namespaces
    survivors = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if run["work_dir"] in cmdline or f"{run['namespace_tag']}-" in cmdline:
            survivors.append((process.pid, cmdline))
    assert not survivors
    assert not os.path.exists(run["work_dir"])
