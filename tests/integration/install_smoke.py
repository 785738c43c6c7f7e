"""What a user checks first after installing Domus: run by the Python of an
installed Domus (never the source tree), from a directory of its own.

    python install_smoke.py DATA_DIR [--extra-service PYTHON]

Starts a supervisor and two services of this install (real processes on
127.0.0.1), creates a DHT on every storage platform and medium this install
can run, puts and gets through each, and runs ``domus status``.  A Berkeley
DB DHT on an install without it must be refused, naming ``domus[bdb]``.
With ``--extra-service PYTHON`` a third service, run by another install's
Python, joins the deployment: a DHT on a platform that install lacks must
not be stored on it.  Prints one JSON line last: what it found.  Exits 0
only if everything held.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import domus
from domus.errors import PlatformUnavailable
from domus.ops.deploy import LocalDeployment, free_port_block
from domus.service.hotpath import FastPath
from domus.storage import available_platforms
from domus.wire.attributes import PLATFORM_MEDIA

RECORDS = 300


def check_dht(cluster: domus.Cluster, platform: str, medium: str) -> dict[str, int]:
    name = f"{platform}-{medium}"
    dht = cluster.create_dht(name, platform=platform, storage=medium, buckets=16)
    expected = {number: f"value {number}" for number in range(RECORDS)}
    dht.put_many(expected)
    dht["key"] = {"a": [1, 2.5, None]}
    assert dht.get_many(range(RECORDS)) == expected, name
    assert dht["key"] == {"a": [1, 2.5, None]}, name
    assert len(dht) == RECORDS + 1, name
    del dht["key"]
    assert "key" not in dht, name
    return dht.records_by_service()


def join(cluster: domus.Cluster, deployment: LocalDeployment, python: str) -> subprocess.Popen:
    port = free_port_block(1)
    log = open(os.path.join(deployment.data_dir, "extra.log"), "a")  # noqa: SIM115
    process = subprocess.Popen(
        [python, "-m", "domus", "service", "--name", "extra", "--supervisor",
         deployment.supervisor_address, "--listen", f"127.0.0.1:{port}", "--data-dir",
         os.path.join(deployment.data_dir, "extra"), "--heartbeat", "0.2",
         "--secret-file", deployment.secret_file],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not any(entry["name"] == "extra" and entry["state"] == "up"
                  for entry in cluster.services()):
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the extra service did not join (exit {process.poll()}); "
                             f"see {log.name}")
        time.sleep(0.1)
    return process


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("data_dir")
    parser.add_argument("--extra-service", metavar="PYTHON")
    args = parser.parse_args()
    found: dict = {"domus": domus.__file__, "version": domus.__version__,
                   "hot_path": "c" if FastPath is not None else "python",
                   "platforms": list(available_platforms()), "stored": {}}
    command = os.path.join(os.path.dirname(sys.executable), "domus")
    version = subprocess.run([command, "--version"], capture_output=True, text=True,
                             check=True).stdout.strip()
    found["version_line"] = version
    with LocalDeployment(2, port=free_port_block(3), data_dir=args.data_dir,
                         heartbeat=0.2) as deployment:
        extra = None
        with deployment.connect(timeout=10) as cluster:
            if args.extra_service:
                extra = join(cluster, deployment, args.extra_service)
            try:
                for platform in available_platforms():
                    for medium in sorted(PLATFORM_MEDIA[platform]):
                        found["stored"][f"{platform}-{medium}"] = check_dht(cluster, platform,
                                                                             medium)
                if "domus-bsddb-btree" not in available_platforms():
                    try:
                        cluster.create_dht("needs-bdb", platform="domus-bsddb-btree",
                                           storage="disk")
                    except PlatformUnavailable as refused:
                        found["refused"] = str(refused)
                    else:
                        raise SystemExit("a Berkeley DB DHT was created on an install "
                                         "without Berkeley DB")
                found["services"] = {entry["name"]: {"platforms": entry["platforms"],
                                                     "hot_path": entry["hot_path"]}
                                     for entry in cluster.services()}
                found["status"] = subprocess.run(
                    [command, "status", "--supervisor", deployment.supervisor_address],
                    capture_output=True, text=True, check=True,
                    env={**os.environ, **deployment.environment()}).stdout
            finally:
                if extra is not None:
                    extra.terminate()
                    extra.wait(30)
    print(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
