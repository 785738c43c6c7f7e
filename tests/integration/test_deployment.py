"""`domus deployment shutdown` and `domus deployment restart` on a real
deployment: every process stops cleanly, and everything comes back — disk
DHTs with all their records, RAM DHTs saved by the shutdown, deactivated
DHTs still deactivated — including after a crash of every process."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import psutil
import pytest

import domus
import domus.errors

from .support import CLIENT_TIMEOUT
from .test_cli import domus_cmd, hermetic_env, ok

RESTART_TIMEOUT = 120


@pytest.fixture
def restartable(deployment) -> Iterator:
    """The deployment, and after the test: whatever `deployment restart`
    started (detached, so not the fixture's children) is stopped too."""
    yield deployment
    domus_cmd("deployment", "shutdown", "--discard-ram",
              env=hermetic_env(DOMUS_SUPERVISOR=deployment.supervisor_address))
    for process in psutil.process_iter(["cmdline"]):
        if deployment.data_dir in " ".join(process.info["cmdline"] or []):
            process.kill()


def fill(cluster) -> dict[str, dict]:
    contents = {
        "disk-btree": ({"platform": "domus-bsddb-btree", "storage": "disk"},
                       {number: [number, "b" * (number % 30)] for number in range(4000)}),
        "disk-hash-sync": ({"platform": "domus-bsddb-hash", "storage": "disk",
                            "durability": "sync"},
                           {f"h{number}": number for number in range(1500)}),
        "ram-dict": ({"platform": "python-dict"}, {f"r{number}": number for number in range(3000)}),
        "ram-napping": ({"platform": "domus-rbt"}, {number: str(number) for number in range(800)}),
    }
    for name, (attributes, records) in contents.items():
        cluster.create_dht(name, **attributes).put_many(records)
    cluster.deactivate_dht("ram-napping")
    return {name: records for name, (_attributes, records) in contents.items()}


def assert_everything_back(address: str, contents: dict[str, dict], *,
                           napping: str) -> None:
    """Every DHT has its records; "ram-napping" is in state ``napping``
    (and is activated if it is not)."""
    with domus.connect(address, timeout=CLIENT_TIMEOUT) as cluster:
        states = {dht["name"]: dht["state"] for dht in cluster.list_dhts()}
        assert states == {"disk-btree": "active", "disk-hash-sync": "active",
                          "ram-dict": "active", "ram-napping": napping}
        if napping == "inactive":
            with pytest.raises(domus.errors.DhtInactive):
                cluster.open_dht("ram-napping")[1]
            cluster.activate_dht("ram-napping")
        for name, records in contents.items():
            dht = cluster.open_dht(name)
            assert len(dht) == len(records), name
            assert dht.get_many(list(records)) == records, name


@pytest.mark.timeout(RESTART_TIMEOUT)
def test_shutdown_then_restart_brings_every_dht_back(restartable, cluster):
    deployment = restartable
    contents = fill(cluster)
    cluster.close()
    env = hermetic_env(DOMUS_SUPERVISOR=deployment.supervisor_address)

    said = ok("deployment", "shutdown", env=env)
    assert "stopped 3 services (s1, s2, s3) and the supervisor" in said
    assert "RAM DHT 'ram-dict': 3000 records saved" in said
    state_dir = os.path.join(deployment.data_dir, "supervisor")
    assert f"domus deployment restart --data-dir {state_dir}" in said
    for process in [deployment.supervisor, *deployment.services.values()]:
        assert process.wait(15) == 0                      # every process stopped cleanly

    said = ok("deployment", "restart", "--data-dir", state_dir, env=env)
    assert "no supervisor answers" in said
    for name in ("s1", "s2", "s3"):
        assert f"service {name} started" in said
    assert "DHT 'disk-btree' (disk/domus-bsddb-btree): active, 4000 records" in said
    assert "DHT 'ram-dict' (ram/python-dict): active, 3000 records" in said
    assert "DHT 'ram-napping' (ram/domus-rbt): inactive" in said
    assert_everything_back(deployment.supervisor_address, contents, napping="inactive")

    # `restart` on a running deployment shuts it down first.
    said = ok("deployment", "restart", env=env)
    assert "stopped 3 services" in said and "supervisor started" in said
    assert_everything_back(deployment.supervisor_address, contents, napping="active")


@pytest.mark.timeout(RESTART_TIMEOUT)
def test_a_deployment_killed_outright_restarts_with_its_disk_dhts(restartable, cluster):
    deployment = restartable
    dht = cluster.create_dht("survivor", platform="domus-bsddb-btree", storage="disk",
                             durability="sync")
    records = {number: number * 2 for number in range(3000)}
    dht.put_many(records)
    cluster.close()
    for process in [*deployment.services.values(), deployment.supervisor]:
        process.send_signal(signal.SIGKILL)
        process.wait(10)

    env = hermetic_env(DOMUS_SUPERVISOR=deployment.supervisor_address)
    said = ok("deployment", "restart", "--data-dir",
              os.path.join(deployment.data_dir, "supervisor"), env=env)
    assert "DHT 'survivor' (disk/domus-bsddb-btree): active, 3000 records" in said
    with domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as again:
        assert again.open_dht("survivor").get_many(list(records)) == records


def test_restart_without_a_supervisor_or_its_data_dir_says_what_it_needs(tmp_path):
    env = hermetic_env(DOMUS_SUPERVISOR="127.0.0.1:9")
    result = domus_cmd("deployment", "restart", env=env)
    assert result.returncode != 0 and "127.0.0.1:9" in result.stderr
    result = domus_cmd("deployment", "restart", "--data-dir", str(tmp_path), env=env)
    assert result.returncode != 0
    assert "holds no supervisor state" in result.stderr
    assert "Traceback" not in result.stderr
