"""``domus service --instances N``: N services on one node, on distinct
ports, that the supervisor knows share a host (copies of a bucket go to
services of different hosts), stopped together."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

import psutil
import pytest

from domus.ops.deploy import LocalDeployment, free_port_block
from domus.placement import replicas

from .support import wait_until

INSTANCES = 2


@pytest.fixture
def supervisor_only(tmp_path, monkeypatch) -> Iterator[LocalDeployment]:
    deployment = LocalDeployment(0, port=free_port_block(1 + 2 * INSTANCES),
                                 data_dir=str(tmp_path / "deployment"), heartbeat=0.2,
                                 supervisor_args=["--balance", "manual"])
    with deployment:
        monkeypatch.setenv("DOMUS_SECRET_FILE", deployment.secret_file)
        yield deployment


def start_instances(deployment: LocalDeployment, port: int, host: str,
                    data_dir: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "domus", "service", "--instances", str(INSTANCES),
         "--supervisor", deployment.supervisor_address, "--listen", f"127.0.0.1:{port}",
         "--data-dir", data_dir, "--host", host, "--heartbeat", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def pids_of(stderr: str) -> list[int]:
    found = re.search(r"\(pids ([\d ]+)\)", stderr)
    assert found, stderr
    return [int(pid) for pid in found.group(1).split()]


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        process.wait(30)


def test_instances_share_a_host_and_replicas_never_do(supervisor_only, tmp_path):
    base = supervisor_only.port + 1
    nodes = [start_instances(supervisor_only, base, "node-a", str(tmp_path / "a")),
             start_instances(supervisor_only, base + INSTANCES, "node-b", str(tmp_path / "b"))]
    try:
        with supervisor_only.connect() as cluster:
            services = wait_until(
                lambda: [s for s in cluster.services() if s["state"] == "up"]
                if sum(s["state"] == "up" for s in cluster.services()) == 2 * INSTANCES
                else None, timeout=60, what=f"{2 * INSTANCES} services up")
            ports = sorted(int(s["address"].rsplit(":", 1)[1]) for s in services)
            assert ports == list(range(base, base + 2 * INSTANCES))
            host_of = {s["name"]: s["resources"]["hostname"] for s in services}
            assert sorted(host_of.values()) == ["node-a"] * INSTANCES + ["node-b"] * INSTANCES
            # one core each: every instance pinned to one CPU
            assert all(s["resources"]["cores"] == 1 for s in services)
            dht = cluster.create_dht("copies", buckets=64, replicas=2)
            dht.put_many({n: n for n in range(500)})
            info = cluster.dht_info("copies")
            for bucket in range(64):
                held = replicas.holders(info, bucket)
                assert len(held) == 2, (bucket, held)
                assert host_of[held[0]] != host_of[held[1]], (bucket, held, host_of)
            assert dht.get_many(range(500)) == {n: n for n in range(500)}
        # `domus deployment shutdown` stops every instance; each parent exits 0
        shutdown = subprocess.run([sys.executable, "-m", "domus", "deployment", "shutdown",
                                   "--supervisor", supervisor_only.supervisor_address],
                                  capture_output=True, text=True, timeout=120)
        assert shutdown.returncode == 0, shutdown.stderr
        for node in nodes:
            out, err = node.communicate(timeout=60)
            assert node.returncode == 0, err[-2000:]
            assert not [pid for pid in pids_of(err) if psutil.pid_exists(pid)
                        and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    finally:
        for node in nodes:
            stop(node)


def test_an_instance_that_cannot_start_stops_the_others_and_fails(supervisor_only, tmp_path):
    base = supervisor_only.port + 1
    taken = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    taken.bind(("127.0.0.1", base + 1))          # instance 1's port
    try:
        node = start_instances(supervisor_only, base, "node-a", str(tmp_path / "a"))
        try:
            _out, err = node.communicate(timeout=60)
        finally:
            stop(node)
    finally:
        taken.close()
    assert node.returncode != 0
    assert f"instance 1 (listening on 127.0.0.1:{base + 1}) exited with code 1" in err
    assert "Address already in use" in err
    assert not [pid for pid in pids_of(err) if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


def test_instances_signalled_stop_cleanly(supervisor_only, tmp_path):
    node = start_instances(supervisor_only, supervisor_only.port + 1, "node-a",
                           str(tmp_path / "a"))
    try:
        with supervisor_only.connect() as cluster:
            wait_until(lambda: sum(s["state"] == "up" for s in cluster.services()) == INSTANCES,
                       timeout=60, what="the instances up")
        node.send_signal(signal.SIGTERM)
        _out, err = node.communicate(timeout=60)
    finally:
        stop(node)
    assert node.returncode == 0, err[-2000:]
    assert "stopping" in err
    assert os.path.isdir(tmp_path / "a" / "instance-0") and os.path.isdir(
        tmp_path / "a" / "instance-1")
