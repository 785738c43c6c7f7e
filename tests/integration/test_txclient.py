"""domus.client.tx against a real deployment (a supervisor and three services
as processes).  The Twisted side runs in a subprocess (txclient_job.py): a
reactor cannot be restarted inside pytest."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from domus.ops.deploy import LocalDeployment, free_port_block

JOB = Path(__file__).with_name("txclient_job.py")
ROOT = JOB.parents[2]


def _load_job() -> Any:
    spec = importlib.util.spec_from_file_location("txclient_job", JOB)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


job = _load_job()


@pytest.fixture(scope="module")
def tx_deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    data_dir = tmp_path_factory.mktemp("txclient")
    with LocalDeployment(3, port=free_port_block(4), data_dir=str(data_dir),
                         supervisor_args=["--balance", "manual"]) as deployment, \
            pytest.MonkeyPatch.context() as patch:
        # (the job, a subprocess, finds the secret as any job would)
        patch.setenv("DOMUS_SECRET_FILE", deployment.secret_file)
        yield deployment


def run_job(*args: str) -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    finished = subprocess.run([sys.executable, str(JOB), *args], capture_output=True,
                              text=True, timeout=180, cwd=ROOT, env=env)
    lines = finished.stdout.strip().splitlines()
    summary = json.loads(lines[-1]) if lines else {}
    return finished, summary


def test_twisted_client_against_a_real_deployment(tx_deployment: LocalDeployment) -> None:
    # What the sync client writes, the Twisted job reads back (and checks).
    with tx_deployment.connect() as cluster:
        cluster.create_dht("from_sync", buckets=16).put_many(job.interop_items("sync"))

    finished, summary = run_job(tx_deployment.supervisor_address)

    assert finished.returncode == 0, (summary.get("failures"), finished.stderr[-3000:])
    assert summary["ok"] and summary["failures"] == []
    assert summary["passed"] >= 38
    assert summary["stats"]["lookups"]["D"]["lookups"] >= 2 * job.CONCURRENT_PUTS

    # What the Twisted job wrote, the sync client reads back identically.
    expected = job.interop_items("tx")
    with tx_deployment.connect() as cluster:
        from_tx = cluster.open_dht("from_tx")
        assert from_tx.get_many(list(expected)) == expected
        assert {key: from_tx[key] for key in expected} == expected
        assert len(from_tx) == len(expected)
        assert dict(from_tx.items()) == expected
        assert len(cluster.open_dht("tx_model")) == summary["records"]


def test_a_dead_service_fails_only_its_own_buckets(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    with LocalDeployment(3, port=free_port_block(4), data_dir=str(tmp_path)) as deployment:
        monkeypatch.setenv("DOMUS_SECRET_FILE", deployment.secret_file)
        with deployment.connect() as cluster:
            cluster.create_dht("tx_dead", buckets=16)
        deployment.kill_service("s3")

        finished, summary = run_job(deployment.supervisor_address, "dead", "s3")

    assert finished.returncode == 0, (summary.get("failures"), finished.stderr[-3000:])
    assert summary["ok"] and summary["unavailable"] > 0
