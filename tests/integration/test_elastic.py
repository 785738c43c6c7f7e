"""An elastic deployment, as issue 13 asks it to be: writers put without
pause while services join, a service drains, the DHT doubles and halves,
and the balancer moves routing off a node that another process keeps busy;
at the end every acknowledged write reads back with its value, exactly
once, and no writer met an error."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

import domus
from domus.ops.deploy import free_port_block

from .conftest import TrackedDeployment, start_deployment
from .support import CLIENT_TIMEOUT, LOOPBACK, first_difference, wait_until

# Quick to settle (a test's seconds), damping off (the writers keep the
# services busy; what is checked is capacity, and other work's CPU), and a
# fast average of the CPU that other work uses on each node.
AUTO = ("--balance", "auto", "--balance-settle", "1", "--balance-cooldown", "2",
        "--balance-cpu-busy", "101", "--balance-smoothing", "0.5")
BUCKETS = 32
STRATEGIES = ("D", "D,C,R", "C,R")


class Writer:
    """Puts from its own client until stopped: new keys, and every tenth
    write an earlier key again with a new value, at most ``rate`` puts a
    second (so that the test's CPU stays the balancer's to measure).  Keeps
    the last acknowledged value of every key and any error it met."""

    def __init__(self, address: str, name: str, tag: str, lookup: str,
                 rate: float = 400.0) -> None:
        self.acknowledged: dict[str, int] = {}
        self.errors: list[BaseException] = []
        self.stats: dict = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(address, name, tag, lookup,
                                                                rate))
        self._thread.start()

    def _run(self, address: str, name: str, tag: str, lookup: str, rate: float) -> None:
        try:
            with domus.connect(address, timeout=CLIENT_TIMEOUT) as own:
                dht = own.open_dht(name, lookup=lookup)
                number = 0
                started = time.monotonic()
                while not self._stop.is_set():
                    key = f"{tag}{number // 10 if number % 10 == 9 else number}"
                    dht[key] = number
                    self.acknowledged[key] = number
                    number += 1
                    ahead = number / rate - (time.monotonic() - started)
                    if ahead > 0:
                        self._stop.wait(ahead)
                self.stats = dht.stats()
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)

    def written(self) -> int:
        return len(self.acknowledged)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)
        assert not self._thread.is_alive(), "a writer did not stop"


def held(cluster: domus.Cluster, dht: str, role: str) -> dict[str, int]:
    return {entry["name"]: entry["buckets"].get(dht, {}).get(role, 0)
            for entry in cluster.services() if entry["state"] == "up"}


def spawn(deployment: TrackedDeployment, name: str, *extra: str) -> None:
    deployment.spawn_service(name, f"{LOOPBACK}:{free_port_block(1)}", extra=extra)
    deployment.wait_until_up([name], timeout=30)


def keeps_writing(writers: list[Writer], more: int = 100) -> None:
    """Wait until every writer has written ``more`` keys since now."""
    marks = [writer.written() for writer in writers]
    wait_until(lambda: all(writer.written() >= mark + more
                           for writer, mark in zip(writers, marks)) or any(
        writer.errors for writer in writers), timeout=60, what="the writers to go on")


@pytest.fixture
def pinned(tmp_path) -> Iterator[tuple[TrackedDeployment, domus.Cluster]]:
    """A supervisor with the balancer on, and s1 and s2 each on a CPU of
    its own (--cpus), as services on two nodes would be."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs to pin two services apart")
    deployment = start_deployment(tmp_path, services=0, supervisor_args=AUTO)
    cluster = domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT)
    try:
        cpus = sorted(os.sched_getaffinity(0))
        spawn(deployment, "s1", "--cpus", str(cpus[0]))
        spawn(deployment, "s2", "--cpus", str(cpus[1]))
        yield deployment, cluster
    finally:
        cluster.close()
        deployment.stop_everything()


# (serial: it watches the balancer follow the CPU another process takes,
# which other tests running beside it would blur)
@pytest.mark.serial
@pytest.mark.timeout(420)
def test_writes_go_on_through_joins_a_drain_resizes_and_a_busy_node(pinned):
    deployment, cluster = pinned
    dht = cluster.create_dht("elastic", buckets=BUCKETS)
    writers = [Writer(deployment.supervisor_address, "elastic", f"{index}-", lookup)
               for index, lookup in enumerate(STRATEGIES)]
    burners: list[subprocess.Popen] = []
    try:
        keeps_writing(writers)

        # Two services join: the DHT follows the deployment.
        spawn(deployment, "s3")
        spawn(deployment, "s4")
        wait_until(lambda: sorted(held(cluster, "elastic", "storage").values()) == [8] * 4,
                   timeout=90, what="s3 and s4 to get their share of the storage")
        keeps_writing(writers)

        # Double, double again, then halve twice: back to BUCKETS.
        for count in (BUCKETS * 2, BUCKETS * 4, BUCKETS * 2, BUCKETS):
            answer = cluster.resize_dht("elastic", count)
            assert answer["buckets"] == count
            assert all(not step.get("lagging") for step in answer["steps"]), answer
            keeps_writing(writers)
        assert cluster.dht_info("elastic")["buckets"] == BUCKETS

        # s4 drains and leaves.
        drained = cluster.drain_service("s4")
        assert drained["drained"] == "s4"
        cluster.remove_service("s4")
        keeps_writing(writers)

        # Another job keeps s2's CPU busy: routing moves to s1 (a CPU of its
        # own) until s1 routes more than s2; then that job moves to s1's
        # CPU, and routing follows back.  (Whatever else this machine runs,
        # the busy CPU is the busier one.)
        cpus = sorted(os.sched_getaffinity(0))
        for busy, idle, cpu in (("s2", "s1", cpus[1]), ("s1", "s2", cpus[0])):
            while burners:
                burner = burners.pop()
                burner.kill()
                burner.wait(10)
            for _ in range(2):
                burners.append(subprocess.Popen(
                    ["taskset", "-c", str(cpu), sys.executable, "-c", "while True: pass"]))
            started = time.time()
            wait_until(lambda busy=busy, idle=idle: (
                lambda routing: routing[busy] < routing[idle])(
                    held(cluster, "elastic", "routing")),
                timeout=90, what=f"routing to move off busy {busy} to {idle}")
            if busy == "s1":        # (s2 routed less than s1 before: this was the job's doing)
                decisions = [d["decision"] for d in cluster.balancer_status()["decisions"]
                             if d["at"] >= started]
                assert any("routing of bucket" in text and "from s1 to" in text
                           for text in decisions), decisions
            keeps_writing(writers)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait(10)
        for writer in writers:
            writer.stop()
    for writer in writers:
        assert writer.errors == [], writer.errors
    # Every acknowledged write, once, with its last value, read by a fresh
    # client and by each writer's own strategy; and the clients that kept
    # writing through it all learned the layouts as they changed.
    expected = {key: value for writer in writers for key, value in writer.acknowledged.items()}
    fresh = cluster.open_dht("elastic")
    assert first_difference(fresh.get_many(list(expected)), expected) == []
    assert len(fresh) == len(expected)
    keys = list(fresh)
    assert len(keys) == len(set(keys)) == len(expected)
    for strategy in STRATEGIES:
        assert cluster.open_dht("elastic", lookup=strategy).get_many(list(expected)) == expected
    for writer in writers:
        assert writer.stats["refreshes"] > 0, writer.stats
    assert dht.get_many(list(expected)) == expected          # opened at the start
