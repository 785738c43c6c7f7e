"""Tasks of a job that start together and all create (or open) one DHT:
every one of them gets it, none fails (blocking clients in threads, each
on its own connection; Twisted calls sent while the creation is in
flight), and the DHT is made once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import domus
from domus.errors import DhtExists

from .support import CLIENT_TIMEOUT

TASKS = 120
JOB = Path(__file__).with_name("together_job.py")
ROOT = JOB.parents[2]


def test_120_tasks_creating_one_dht_with_exist_ok_all_get_it(shared_cluster, shared_deployment):
    address = shared_deployment.supervisor_address
    start = threading.Barrier(TASKS)
    ids: dict[int, int] = {}
    errors: dict[int, BaseException] = {}

    def task(index: int) -> None:
        try:
            with domus.connect(address, timeout=CLIENT_TIMEOUT) as cluster:
                start.wait(timeout=60)
                dht = cluster.create_dht("together", buckets=64, storage="ram",
                                         exist_ok=True)
                dht[f"task-{index}"] = index
                ids[index] = dht.id
        except BaseException as exc:  # noqa: BLE001  (reported below)
            errors[index] = exc

    threads = [threading.Thread(target=task, args=(index,)) for index in range(TASKS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, f"{len(errors)} of {TASKS} tasks failed: {list(errors.items())[:3]}"
    assert len(ids) == TASKS and len(set(ids.values())) == 1
    assert [d["name"] for d in shared_cluster.list_dhts()].count("together") == 1
    dht = shared_cluster.open_dht("together")
    assert len(dht) == TASKS
    assert dht.get_many([f"task-{index}" for index in range(TASKS)]) == {
        f"task-{index}": index for index in range(TASKS)}


def test_exist_ok_with_other_attributes_is_refused_naming_them(shared_cluster):
    dht = shared_cluster.create_dht("kept", buckets=16)
    dht["a"] = 1
    with pytest.raises(DhtExists) as refused:
        shared_cluster.create_dht("kept", buckets=32, platform="domus-rbt", exist_ok=True)
    assert "buckets: has 16, asked for 32" in str(refused.value)
    assert "platform: has 'python-dict', asked for 'domus-rbt'" in str(refused.value)
    assert shared_cluster.create_dht("kept", buckets=16, exist_ok=True)["a"] == 1
    with pytest.raises(DhtExists, match="already exists"):
        shared_cluster.create_dht("kept", buckets=16)


def test_opens_and_creations_sent_during_a_creation_wait_for_it(shared_cluster,
                                                                shared_deployment):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    finished = subprocess.run([sys.executable, str(JOB), shared_deployment.supervisor_address,
                               "racing", str(TASKS)], capture_output=True, text=True,
                              timeout=120, cwd=ROOT, env=env)
    assert finished.returncode == 0, finished.stderr[-3000:]
    summary = json.loads(finished.stdout.strip().splitlines()[-1])
    created = shared_cluster.open_dht("racing")
    assert summary["ids"] == [created.id] * TASKS, summary["ids"]
    assert summary["stored"] == TASKS and len(created) == TASKS


def test_the_domus_command_creates_with_exist_ok(shared_cluster, shared_deployment):
    env = dict(os.environ, DOMUS_SUPERVISOR=shared_deployment.supervisor_address)
    command = [sys.executable, "-m", "domus", "dht", "create", "by-cli", "--buckets", "8",
               "--exist-ok"]
    first = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
    again = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
    other = subprocess.run(command[:-2] + ["16", "--exist-ok"], capture_output=True,
                           text=True, env=env, timeout=60)
    assert first.returncode == 0 and first.stdout.startswith("created DHT 'by-cli'")
    assert again.returncode == 0 and "existed already" in again.stdout
    assert other.returncode == 1 and "buckets: has 8, asked for 16" in other.stderr
