"""A full disk, for real: a service whose data dir is a 16 MiB tmpfs, a
`sync` disk DHT stored on it alone, filled through Domus and from outside.

- Puts get StorageFull once free space is down to the service's reserve,
  before the filesystem is full; reads and deletes go on; `domus status`
  shows the alarm; the service killed with SIGKILL at the reserve comes
  back with every acknowledged record; deletes give room back and writes
  resume by themselves.
- A store that cannot be opened (the tmpfs filled from outside while the
  service was down) answers StorageError naming the DHT, the bucket, the
  path and the cause (never DhtInactive), `domus status` shows why, and it
  serves by itself within seconds of the space coming back.

Every acknowledged record is read back at the end of each test.  Mounting
a tmpfs needs root: the tests are skipped, saying so, otherwise.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import domus
from domus.errors import DhtInactive, StorageError, StorageFull
from domus.ops.cli import format_status
from domus.ops.deploy import free_port_block
from domus.storage.headroom import filesystem_space, hysteresis

from .conftest import TrackedDeployment, _stop_all, start_deployment
from .support import CLIENT_TIMEOUT, LOOPBACK, wait_until

DISK = "16m"
RESERVE = 4 << 20          # --disk-reserve 4m
VALUE = b"v" * 1000
REFUSALS = 10

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="filling a real disk needs a small "
                                "tmpfs, and mounting one needs root")


class SmallDisk:
    """A deployment (one ordinary service, s1, which routes) and a service
    "small" whose data dir is a 16 MiB tmpfs."""

    def __init__(self, deployment: TrackedDeployment) -> None:
        self.deployment = deployment
        self.mount = os.path.join(deployment.data_dir, "small")
        os.makedirs(self.mount)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", self.mount],
                       check=True, capture_output=True)
        self.address = f"{LOOPBACK}:{free_port_block(1)}"
        self.process: Any = None
        self.start()

    def start(self) -> None:
        self.process = self.deployment.spawn_service(
            "small", self.address, extra=("--disk-reserve", "4m"))
        self.deployment.wait_until_up(["small"], timeout=30)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def free(self) -> int:
        return filesystem_space(self.mount)[0]

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", self.mount], check=False, capture_output=True)


@pytest.fixture
def small(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SmallDisk]:
    deployment = start_deployment(tmp_path, services=1)
    disk = None
    try:
        disk = SmallDisk(deployment)
        yield disk
    finally:
        _stop_all(deployment, request)
        if disk is not None:
            disk.unmount()


def create(cluster: domus.Cluster) -> Any:
    return cluster.create_dht("full", buckets=8, storage="disk", platform="domus-bsddb-btree",
                              durability="sync", routing_services=["s1"],
                              storage_services=["small"])


def fill(dht: Any, acknowledged: dict[int, bytes], start: int = 0) -> StorageFull:
    """Put until puts are refused (StorageFull), and go on trying until
    they are refused REFUSALS times in a row, a polling interval apart: a
    checkpoint that lets log files go may give room for a few more.
    Returns the last refusal."""
    numbers = iter(range(start, start + 100_000))
    refusals: list[StorageFull] = []

    def refused_in_a_row() -> bool:
        number = next(numbers)
        try:
            dht[number] = VALUE
        except StorageFull as refused:
            refusals.append(refused)
            return len(refusals) >= REFUSALS
        acknowledged[number] = VALUE
        refusals.clear()
        return False

    for number in numbers:                  # at full speed to the reserve
        try:
            dht[number] = VALUE
        except StorageFull as refused:
            refusals.append(refused)
            break
        acknowledged[number] = VALUE
    else:
        raise AssertionError(f"100,000 records of 1 KB went into an {DISK} disk unrefused")
    wait_until(refused_in_a_row, timeout=30, interval=0.1, what="puts to stay refused")
    return refusals[-1]


def read_back(dht: Any, acknowledged: dict[int, bytes]) -> None:
    """Every acknowledged record, with its value, and nothing else."""
    assert len(dht) == len(acknowledged)
    keys = list(acknowledged)
    for first in range(0, len(keys), 500):
        chunk = keys[first:first + 500]
        assert dht.get_many(chunk) == {key: acknowledged[key] for key in chunk}


def service_view(cluster: domus.Cluster, name: str = "small") -> dict[str, Any]:
    return next(entry for entry in cluster.services() if entry["name"] == name)


@pytest.mark.timeout(240)
def test_a_full_disk_refuses_puts_at_its_reserve_and_loses_nothing(small: SmallDisk) -> None:
    with domus.connect(small.deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as cluster:
        dht = create(cluster)
        acknowledged: dict[int, bytes] = {}
        refused = fill(dht, acknowledged)
        # Refused at the reserve, before the filesystem was full.
        assert "service small refused a put on DHT 'full': its disk is at its reserve" \
            in str(refused)
        assert small.mount in str(refused) and "free under" in str(refused)
        assert small.free() > 0
        assert len(acknowledged) > 1000
        with pytest.raises(StorageFull):
            dht.put_many({"batch-a": 1, "batch-b": 2})
        assert "batch-a" not in dht and "batch-b" not in dht
        # The alarm: in the heartbeats, `domus status`, and no storage moves there.
        view = wait_until(lambda: (view := service_view(cluster))["load"].get("disk_full")
                          and view, timeout=15, what="small's heartbeat to say disk full")
        assert view["load"]["disk_reserve"] == RESERVE
        assert 0 < view["load"]["free_disk"] < RESERVE + hysteresis(RESERVE)
        assert "small: DISK FULL" in format_status(cluster.status())
        read_back(dht, acknowledged)

        # SIGKILL at the reserve, and a restart: recovery has the reserve.
        small.kill()
        small.start()
        read_back(dht, acknowledged)
        fill(dht, acknowledged, start=500_000)     # (recovery may have let a log file go)
        read_back(dht, acknowledged)

        # Deletes go on, and give the room back: writes resume by themselves.
        deleted = list(acknowledged)[: len(acknowledged) // 2]
        for key in deleted:
            del dht[key]
            del acknowledged[key]

        def put_taken() -> bool:
            try:
                dht["resumed"] = VALUE
            except StorageFull:
                return False
            return True

        wait_until(put_taken, timeout=30, what="puts to be taken again after the deletes")
        acknowledged["resumed"] = VALUE      # type: ignore[index]
        wait_until(lambda: not service_view(cluster)["load"].get("disk_full"), timeout=15,
                   what="the disk full alarm to clear")
        more = fill(dht, acknowledged, start=1_000_000)
        assert "at its reserve" in str(more)
        read_back(dht, acknowledged)


@pytest.mark.timeout(240)
def test_a_store_that_will_not_open_says_why_and_serves_once_there_is_room(
        small: SmallDisk) -> None:
    with domus.connect(small.deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as cluster:
        dht = create(cluster)
        acknowledged = {number: VALUE for number in range(1_000)}
        dht.put_many(acknowledged)
        small.kill()
        # Another job fills the disk while the service is down.
        filler = os.path.join(small.mount, "another-jobs-scratch")
        with open(filler, "wb") as scratch:
            try:
                while True:
                    scratch.write(b"\0" * (64 << 10))
                    scratch.flush()
            except OSError:
                pass
        assert small.free() < 64 << 10
        small.start()
        with pytest.raises(StorageError) as failure:
            dht[1]
        text = str(failure.value)
        assert not isinstance(failure.value, DhtInactive)
        assert "of DHT 'full' is not served on service small" in text
        assert "cannot open and recover its Berkeley DB environment" in text
        assert os.path.join(small.mount, "dhts") in text           # the path
        assert "its filesystem has" in text and "free space there" in text   # the cause
        assert "tries again by itself" in text
        with pytest.raises(StorageError):
            dht[5_000] = VALUE
        alarms = wait_until(lambda: "NOT SERVED" in (text := format_status(cluster.status()))
                            and text, timeout=15, what="domus status to show the failed DHT")
        assert "small: DHT 'full' NOT SERVED (retrying)" in alarms
        # The operator makes room: it serves again, with no restart.
        os.remove(filler)
        wait_until(lambda: dht.get(1) == VALUE, timeout=15, what="the store to open by itself")
        read_back(dht, acknowledged)
        dht[5_000] = VALUE
        acknowledged[5_000] = VALUE
        read_back(dht, acknowledged)
        log = Path(small.deployment.log_path("small")).read_text(encoding="utf-8")
        assert "Unhandled error" not in log and "Traceback" not in log
        assert "serves again: its storage opened after" in log
