"""No deletion on absence (issue 15): a supervisor restarted on an empty
data dir (a new deployment id, no DHTs) while services hold RAM and disk
DHTs deletes nothing; the services keep and report them, `domus status`
shows them as unknown to the supervisor, new DHTs get other ids, and
`domus service discard` removes exactly the one it names."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from domus.errors import SupervisorError

from .conftest import _stop_all, start_deployment
from .support import CLIENT_TIMEOUT, RawUdp, wait_until

COMMAND_TIMEOUT = 60
RESTART_TIMEOUT = 30
RAM = {f"ram-{number}": number for number in range(200)}
DISK = {f"disk-{number}": number for number in range(200)}


@pytest.fixture
def insecure(tmp_path, monkeypatch):
    """An insecure deployment: no process of the test may name another
    deployment's secret ($DOMUS_SECRET_FILE of an earlier module)."""
    monkeypatch.delenv("DOMUS_SECRET_FILE", raising=False)
    deployment = start_deployment(tmp_path, supervisor_args=("--balance", "manual",
                                                             "--insecure"))
    try:
        yield deployment
    finally:
        _stop_all(deployment)


def held(deployment) -> dict[str, dict[str, int]]:
    """service -> DHT name -> records it holds (asked of each service)."""
    result = {}
    for index in range(deployment.service_count):
        with RawUdp(deployment.service_address(index), keys=None) as raw:
            stats = raw.stats()
        result[deployment.service_name(index)] = {
            name: dht["records"] for name, dht in stats["dhts"].items()}
    return result


def domus_cmd(deployment, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "domus", *args], capture_output=True,
                          text=True, env=dict(os.environ, **deployment.environment()),
                          timeout=COMMAND_TIMEOUT, stdin=subprocess.DEVNULL)


@pytest.mark.timeout(180)
def test_a_supervisor_restarted_on_an_empty_data_dir_deletes_nothing(insecure):
    deployment = insecure
    with deployment.connect(timeout=CLIENT_TIMEOUT) as cluster:
        cluster.create_dht("ramdht", buckets=16).update(RAM)
        cluster.create_dht("diskdht", buckets=16, storage="disk",
                           platform="domus-bsddb-btree").update(DISK)
        ids = {dht["name"]: dht["id"] for dht in cluster.list_dhts()}
        old_deployment = cluster.status()["supervisor"]["deployment"]
    before = held(deployment)
    assert sum(counts["ramdht"] for counts in before.values()) == len(RAM)
    assert sum(counts["diskdht"] for counts in before.values()) == len(DISK)

    deployment.stop_supervisor(signal.SIGTERM)
    state_dir = Path(deployment.data_dir, "supervisor")
    shutil.move(state_dir, state_dir.with_name("supervisor-old"))     # the wrong data dir
    deployment.start_supervisor()
    with deployment.connect(timeout=CLIENT_TIMEOUT) as cluster:
        wait_until(lambda: [entry["state"] for entry in cluster.services()] == ["up"] * 3,
                   timeout=RESTART_TIMEOUT, what="every service registered again")
        status = cluster.status()
        assert status["supervisor"]["deployment"] != old_deployment
        assert status["dhts"] == []
        # Every service keeps what it held, and reports it.
        wait_until(lambda: all(len(entry["unknown_dhts"]) == 2
                               for entry in cluster.services()),
                   timeout=RESTART_TIMEOUT, what="every service's orphans reported")
        for entry in cluster.services():
            orphans = {orphan["name"]: orphan for orphan in entry["unknown_dhts"]}
            assert {name: orphan["id"] for name, orphan in orphans.items()} == ids
            assert orphans["ramdht"]["records"] == before[entry["name"]]["ramdht"]
            assert all(orphan["deployment"] == old_deployment for orphan in orphans.values())
        assert held(deployment) == before
        for index in range(3):
            home = Path(deployment.data_dir, deployment.service_name(index), "dhts")
            assert sorted(os.listdir(home)) == sorted(str(dht_id) for dht_id in ids.values())
        # A new DHT of the new deployment gets an id none of them has.
        fresh = cluster.create_dht("fresh", buckets=8)
        assert fresh.id > max(ids.values())
        fresh["k"] = "v"
        assert fresh["k"] == "v"

    said = domus_cmd(deployment, "status")
    assert said.returncode == 0, said.stderr
    assert "unknown to the supervisor" in said.stdout
    assert "ramdht" in said.stdout and "diskdht" in said.stdout
    listed = json.loads(domus_cmd(deployment, "status", "--json").stdout)
    assert all(len(entry["unknown_dhts"]) == 2 for entry in listed["services"])

    # Discard removes exactly what it names: s1's copy of ramdht.
    said = domus_cmd(deployment, "service", "discard", "s1", str(ids["ramdht"]))
    assert said.returncode == 0, said.stderr
    assert "discarded DHT 'ramdht'" in said.stdout
    after = held(deployment)
    assert "ramdht" not in after["s1"]
    assert after["s1"]["diskdht"] == before["s1"]["diskdht"]
    for name in ("s2", "s3"):
        assert after[name]["ramdht"] == before[name]["ramdht"]
        assert after[name]["diskdht"] == before[name]["diskdht"]
    assert not Path(deployment.data_dir, "s1", "dhts", str(ids["ramdht"])).exists()
    assert Path(deployment.data_dir, "s2", "dhts", str(ids["ramdht"])).exists()

    with deployment.connect(timeout=CLIENT_TIMEOUT) as cluster:
        with pytest.raises(SupervisorError, match="reports no DHT with id"):
            cluster.discard_dht("s1", ids["ramdht"])            # (gone already)
        with pytest.raises(SupervisorError, match="reports no DHT with id"):
            cluster.discard_dht("s2", fresh.id)                 # the supervisor's own
        cluster.destroy_dht("fresh")
        wait_until(lambda: {entry["name"]: len(entry["unknown_dhts"])
                            for entry in cluster.services()} == {"s1": 1, "s2": 2, "s3": 2},
                   timeout=RESTART_TIMEOUT, what="the orphans reported after the discard")
    # (destroying the new deployment's own DHT took nothing else)
    assert held(deployment) == {name: {dht: records for dht, records in counts.items()
                                       if dht != "fresh"} for name, counts in after.items()}
