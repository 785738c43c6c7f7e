"""The supervisor's load from many services' heartbeats.

    python -m benchmarks.scalability.heartbeats SERVICES SECONDS

Starts a supervisor (a process, on 127.0.0.1) and, in one other process,
SERVICES real ``DomusService`` objects on one reactor (each its own ports,
its own link to the supervisor, a heartbeat a second: the protocol of real
services; only their processes are shared), waits until every one is up,
then measures the supervisor's CPU for SECONDS.  Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import psutil

from domus.ops.deploy import LocalDeployment, free_port_block


def simulate(supervisor: str, services: int, base_port: int, data_dir: str) -> None:
    """(The simulated services' process.)"""
    import resource

    # (each service holds several descriptors: sockets, its link, psutil's)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 20 * services + 256)), hard))
    from twisted.internet import reactor

    from domus.service.server import DomusService

    started = []
    for index in range(services):
        service = DomusService(supervisor=supervisor, listen=f"127.0.0.1:{base_port + index}",
                               data_dir=os.path.join(data_dir, f"sim{index}"),
                               name=f"sim{index}", heartbeat=1.0)
        started.append(service)
        reactor.callWhenRunning(service.startService)
    reactor.run()


def measure(services: int, seconds: float) -> dict[str, Any]:
    data_dir = tempfile.mkdtemp(prefix="domus-heartbeats-")
    with LocalDeployment(0, port=free_port_block(1), data_dir=data_dir,
                         supervisor_args=["--balance", "manual"]) as deployment:
        base = free_port_block(services)
        env = dict(os.environ, DOMUS_SECRET_FILE=deployment.secret_file,
                   DOMUS_LOG_LEVEL="warn")
        simulator = subprocess.Popen(
            [sys.executable, "-c", "import sys; from benchmarks.scalability.heartbeats import "
             "simulate; simulate(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])",
             deployment.supervisor_address, str(services), str(base), data_dir],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        try:
            with deployment.connect() as cluster:
                deadline = time.monotonic() + 120
                while sum(s["state"] != "down" for s in cluster.services()) < services:
                    if simulator.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the {services} simulated services did not all "
                                           f"come up")
                    time.sleep(0.5)
            supervisor = psutil.Process(deployment.supervisor.pid)
            before = supervisor.cpu_times()
            time.sleep(seconds)
            after = supervisor.cpu_times()
        finally:
            simulator.terminate()
            simulator.wait(30)
    shutil.rmtree(data_dir, ignore_errors=True)
    cpu = (after.user + after.system - before.user - before.system) / seconds
    return {"services": services, "seconds": seconds, "supervisor_cpu": cpu,
            "cpu_per_service": cpu / services,
            "services_per_core": (services / cpu) if cpu else None}


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]), float(sys.argv[2]))))
