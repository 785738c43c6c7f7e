"""The ``domus`` command, run as a user runs it: a separate process."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

import domus
from domus.errors import AuthenticationError
from domus.ops.deploy import free_port_block, port_is_free

from .support import CLIENT_TIMEOUT, LOOPBACK, wait_until

COMMAND_TIMEOUT = 60     # a hung command fails the test instead of the suite
QUICK = 10.0             # "fails within a few seconds", with room for a loaded machine


def hermetic_env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "DOMUS_SUPERVISOR"}
    env.update(extra)
    return env


def domus_cmd(*args: str, env: dict[str, str] | None = None,
              timeout: float = COMMAND_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "domus", *args], capture_output=True,
                          text=True, timeout=timeout, env=env or hermetic_env(),
                          stdin=subprocess.DEVNULL)


def ok(*args: str, env: dict[str, str] | None = None) -> str:
    result = domus_cmd(*args, env=env)
    assert result.returncode == 0, (f"`domus {' '.join(args)}` exited {result.returncode}: "
                                    f"{result.stderr}")
    return result.stdout


def fails(*args: str, env: dict[str, str] | None = None, within: float = QUICK) -> str:
    """Run a command that must fail: non-zero exit, a message on stderr,
    nothing that looks like a traceback, and no hang."""
    started = time.monotonic()
    result = domus_cmd(*args, env=env)
    elapsed = time.monotonic() - started
    assert result.returncode != 0, f"`domus {' '.join(args)}` succeeded: {result.stdout}"
    assert result.stderr.strip(), "a failure must say why on stderr"
    assert "Traceback" not in result.stderr, result.stderr
    assert elapsed < within, f"`domus {' '.join(args)}` took {elapsed:.1f}s to fail"
    return result.stderr


# ------------------------------------------------------------------ against a deployment

def test_status_lists_every_service(deployment, cluster):
    cluster.create_dht("shown", buckets=16)
    out = ok("status", "--supervisor", deployment.supervisor_address)
    assert deployment.supervisor_address in out
    lines = out.splitlines()
    for index in range(3):
        name, address = deployment.service_name(index), deployment.service_address(index)
        row = next((line for line in lines if line.split()[:1] == [name]), None)
        assert row is not None, f"no row for {name} in:\n{out}"
        assert address in row and " up " in f" {row} "
    assert any(line.split()[:1] == ["shown"] for line in lines), out


def test_status_json_parses(deployment, cluster):
    cluster.create_dht("shown", buckets=16, storage_services=["s1"])
    status = json.loads(ok("status", "--json", "--supervisor", deployment.supervisor_address))
    assert status["supervisor"]["address"] == deployment.supervisor_address
    services = {entry["name"]: entry for entry in status["services"]}
    assert set(services) == {"s1", "s2", "s3"}
    assert all(entry["state"] == "up" for entry in services.values())
    assert services["s1"]["buckets"]["shown"]["storage"] == 16
    assert [dht["name"] for dht in status["dhts"]] == ["shown"]
    # the stats the docs name, once a heartbeat has brought them
    for entry in services.values():
        assert entry["hot_path"] in ("c", "python")
    wait_until(lambda: all("storage_errors" in entry["stats"] for entry in cluster.services()),
               timeout=15, what="heartbeats with the services' stats")
    for entry in cluster.services():
        assert entry["stats"]["storage_errors"] == 0 and entry["stats"]["internal_errors"] == 0
        assert entry["stats"]["hot_path"] == entry["hot_path"]


def test_service_list(deployment):
    services = json.loads(ok("service", "list", "--json",
                             "--supervisor", deployment.supervisor_address))
    assert [entry["name"] for entry in services] == ["s1", "s2", "s3"]
    table = ok("service", "list", "--supervisor", deployment.supervisor_address)
    assert all(name in table for name in ("s1", "s2", "s3"))


def test_dht_create_list_info_destroy(deployment, cluster):
    sup = ("--supervisor", deployment.supervisor_address)
    out = ok("dht", "create", "words", "--buckets", "64", "--hash", "blake2b",
             "--routing-services", "s1", "--storage-services", "s2,s3", *sup)
    assert "words" in out and "64" in out
    ok("dht", "create", "plain", *sup)

    listed = json.loads(ok("dht", "list", "--json", *sup))
    assert sorted(entry["name"] for entry in listed) == ["plain", "words"]
    table = ok("dht", "list", *sup)
    assert "words" in table and "plain" in table

    info = json.loads(ok("dht", "info", "words", *sup))
    assert (info["name"], info["buckets"], info["hash"]) == ("words", 64, "blake2b")
    assert [entry["name"] for entry in info["routing_services"]] == ["s1"]
    assert [entry["name"] for entry in info["storage_services"]] == ["s2", "s3"]
    assert cluster.open_dht("words").id == info["id"]   # the library sees what the CLI made

    assert "words" in ok("dht", "destroy", "words", *sup)
    assert [entry["name"] for entry in json.loads(ok("dht", "list", "--json", *sup))] == ["plain"]
    ok("dht", "destroy", "plain", *sup)
    assert "no DHTs" in ok("dht", "list", *sup)


def test_put_get_del_round_trip(deployment, cluster):
    sup = ("--supervisor", deployment.supervisor_address)
    dht = cluster.create_dht("data")
    assert ok("put", "data", "greeting", "héllo wörld", *sup).strip() == "created"
    assert ok("get", "data", "greeting", *sup) == "héllo wörld\n"
    assert dht["greeting"] == "héllo wörld"
    assert ok("put", "data", "greeting", "again", *sup).strip() == "replaced"

    ok("put", "data", "doc", '{"a": [1, 2.5, null, true]}', "--json-value", *sup)
    assert dht["doc"] == {"a": [1, 2.5, None, True]}
    assert json.loads(ok("get", "data", "doc", *sup)) == {"a": [1, 2.5, None, True]}

    ok("put", "data", "42", "forty-two", "--int-key", *sup)
    assert dht[42] == "forty-two" and "42" not in dht
    # the digits without --int-key are the string "42": the answer says so
    assert "the integer 42 is: keys are strings unless --int-key is given" in fails(
        "get", "data", "42", *sup)
    dht[-7] = [b"raw", 3]
    assert json.loads(ok("get", "data", "-7", "--int-key", *sup)) == ["raw", 3]

    assert ok("del", "data", "greeting", *sup).strip() == "deleted"
    assert "greeting" not in dht
    assert "greeting" in fails("get", "data", "greeting", *sup)
    assert "greeting" in fails("del", "data", "greeting", *sup)
    assert "not an integer" in fails("get", "data", "x", "--int-key", *sup)


def test_errors_exit_non_zero_with_a_message(deployment, cluster):
    sup = ("--supervisor", deployment.supervisor_address)
    cluster.create_dht("exists")
    for command in (("get", "nosuch", "k"), ("put", "nosuch", "k", "v"), ("del", "nosuch", "k"),
                    ("dht", "info", "nosuch"), ("dht", "destroy", "nosuch")):
        assert "nosuch" in fails(*command, *sup), command
    assert "exists" in fails("dht", "create", "exists", *sup)
    assert "power of two" in fails("dht", "create", "odd", "--buckets", "3", *sup)
    assert "s9" in fails("dht", "create", "nowhere", "--storage-services", "s9", *sup)
    assert "json" in fails("put", "exists", "k", "{not json", "--json-value", *sup).lower()
    usage = domus_cmd("dht", "frobnicate", *sup)
    assert usage.returncode == 2 and "usage" in usage.stderr.lower()
    assert [entry["name"] for entry in cluster.list_dhts()] == ["exists"]


def test_an_unreachable_supervisor_fails_fast(tmp_path):
    port = free_port_block(1)
    assert port_is_free(LOOPBACK, port)
    for command in (("status",), ("dht", "list"), ("get", "d", "k")):
        stderr = fails(*command, "--supervisor", f"{LOOPBACK}:{port}")
        assert f"{LOOPBACK}:{port}" in stderr and "supervisor" in stderr


def test_a_malformed_supervisor_address_is_explained(tmp_path):
    for bad in ("nonsense", f"{LOOPBACK}:99999", f"{LOOPBACK}:port"):
        assert bad in fails("status", "--supervisor", bad)
        assert bad in fails("dht", "list", env=hermetic_env(DOMUS_SUPERVISOR=bad))


def test_a_supervisor_that_never_answers_times_out(tmp_path):
    # Something accepts connections on the port but never says a word.
    silent = socket.socket()
    silent.bind((LOOPBACK, 0))
    silent.listen(8)
    try:
        address = f"{LOOPBACK}:{silent.getsockname()[1]}"
        stderr = fails("status", "--supervisor", address, "--timeout", "1", within=QUICK)
        assert address in stderr and "did not answer" in stderr
    finally:
        silent.close()


def test_the_environment_variable_names_the_supervisor(deployment):
    good = deployment.supervisor_address
    dead = f"{LOOPBACK}:{free_port_block(1)}"
    out = ok("status", env=hermetic_env(DOMUS_SUPERVISOR=good))
    assert good in out and "s1" in out
    ok("dht", "create", "via-env", env=hermetic_env(DOMUS_SUPERVISOR=good))
    ok("put", "via-env", "k", "v", env=hermetic_env(DOMUS_SUPERVISOR=good))
    assert ok("get", "via-env", "k", env=hermetic_env(DOMUS_SUPERVISOR=good)) == "v\n"
    assert dead in fails("status", env=hermetic_env(DOMUS_SUPERVISOR=dead))
    # --supervisor wins over the variable.
    assert good in ok("status", "--supervisor", good, env=hermetic_env(DOMUS_SUPERVISOR=dead))


def test_connect_without_an_address_follows_the_environment(deployment, monkeypatch):
    monkeypatch.setenv("DOMUS_SUPERVISOR", deployment.supervisor_address)
    with domus.connect(timeout=CLIENT_TIMEOUT) as cluster:
        assert cluster.address == deployment.supervisor_address
        assert len(cluster.services()) == 3


def test_the_installed_console_script(deployment):
    script = Path(sys.executable).with_name("domus")
    if not script.exists():
        pytest.skip(f"no console script next to {sys.executable}")
    result = subprocess.run([str(script), "status", "--supervisor", deployment.supervisor_address],
                            capture_output=True, text=True, timeout=COMMAND_TIMEOUT,
                            env=hermetic_env())
    assert result.returncode == 0, result.stderr
    assert "s1" in result.stdout


# ------------------------------------------------------------------ domus up

def domus_processes(ports: list[int]) -> list[psutil.Process]:
    """Live `domus` supervisor/service processes bound to any of these ports."""
    wanted = {f"{LOOPBACK}:{port}" for port in ports}
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        try:
            cmdline = process.info["cmdline"] or []
            if process.info["status"] == psutil.STATUS_ZOMBIE:
                continue
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "domus" in cmdline and wanted & set(cmdline):
            found.append(process)
    return found


def kill_tree(process: subprocess.Popen) -> None:
    try:
        children = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    for victim in [*children]:
        try:
            victim.kill()
        except psutil.NoSuchProcess:
            pass
    if process.poll() is None:
        process.kill()
    process.wait(10)
    psutil.wait_procs(children, timeout=10)


@pytest.mark.timeout(120)
def test_up_runs_a_deployment_and_stops_cleanly_on_sigterm(tmp_path, monkeypatch):
    monkeypatch.delenv("DOMUS_SECRET_FILE", raising=False)
    port = free_port_block(6)
    ports = [port, port + 1, port + 2]
    metrics = port + 3                  # the supervisor's; the services' on the next two
    data_dir = tmp_path / "up"
    up = subprocess.Popen([sys.executable, "-m", "domus", "up", "--services", "2", "--port",
                           str(port), "--data-dir", str(data_dir), "--metrics-port",
                           str(metrics)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          stdin=subprocess.DEVNULL, env=hermetic_env())
    try:
        address = f"{LOOPBACK}:{port}"
        secret_file = data_dir / "supervisor" / "secret"

        def usable() -> bool:
            assert up.poll() is None, f"domus up exited with {up.returncode}"
            if not secret_file.exists():
                return False
            with domus.connect(address, timeout=1, secret_file=str(secret_file)) as cluster:
                return [e["state"] for e in cluster.services()] == ["up", "up"]

        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(up.stdout), daemon=True)
        reader.start()
        wait_until(usable, timeout=45, interval=0.2, what="`domus up` to be usable")
        # what a script waits for: its own word that it is up (it may say so
        # a moment after the supervisor does)
        wait_until(lambda: any("Domus is up" in line for line in lines), timeout=15,
                   what="`domus up` to say it is up")
        assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
        with pytest.raises(AuthenticationError, match="DOMUS_SECRET_FILE"):
            domus.connect(address, timeout=CLIENT_TIMEOUT)          # (no secret given)
        with domus.connect(address, timeout=CLIENT_TIMEOUT,
                           secret_file=str(secret_file)) as cluster:
            names = sorted(entry["name"] for entry in cluster.services())
            dht = cluster.create_dht("up-test")
            dht.put_many({number: str(number) for number in range(100)})
            assert len(dht) == 100
        # --metrics-port: each process's metrics, as the line it printed says
        assert any(f"s2 http://{LOOPBACK}:{metrics + 2}/metrics" in line for line in lines)
        stored = 0
        for offset, name in ((1, "s1"), (2, "s2")):
            with urllib.request.urlopen(f"http://{LOOPBACK}:{metrics + offset}/metrics",
                                        timeout=10) as page:
                families = {family.name: family for family in
                            text_string_to_metric_families(page.read().decode())}
            stored += sum(sample.value for sample in families["domus_service_records"].samples
                          if sample.labels == {"service": name, "dht": "up-test"})
        assert stored == 100
        with urllib.request.urlopen(f"http://{LOOPBACK}:{metrics}/metrics", timeout=10) as page:
            assert b'domus_supervisor_services{state="up"} 2.0' in page.read()
        children = psutil.Process(up.pid).children(recursive=True)
        assert len(children) == 3, [child.cmdline() for child in children]
        assert len(domus_processes(ports)) == 3

        up.send_signal(signal.SIGTERM)
        started = time.monotonic()
        up.wait(15)
        stopped_in = time.monotonic() - started
        reader.join(5)
        stdout, stderr = "".join(lines), up.stderr.read()
        assert up.returncode == 0, stderr
        assert stopped_in < 10, f"`domus up` took {stopped_in:.1f}s to stop"
        assert "Domus is up" in stdout and "Domus stopped." in stdout
        assert address in stdout and f"DOMUS_SUPERVISOR={address}" in stdout
        assert f"DOMUS_SECRET_FILE={secret_file}" in stdout
        # what stopping lost, and how it could have been kept
        assert "stopping loses what RAM DHTs hold: up-test (100 records)" in stderr
        assert "domus deployment shutdown" in stderr
        gone, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, f"children survived `domus up`: {alive}"
        assert domus_processes(ports) == []
        assert names == ["s1", "s2"]
        assert (data_dir / "logs").is_dir()
    finally:
        if up.poll() is None:
            kill_tree(up)
        for process in domus_processes(ports):
            process.kill()


def test_up_refuses_metrics_ports_that_overlap_its_own(tmp_path):
    stderr = fails("up", "--services", "2", "--port", "27700", "--metrics-port", "27702",
                   "--data-dir", str(tmp_path / "up"))
    assert "metrics ports 27702-27704 overlap the deployment's ports 27700-27702" in stderr
    assert not (tmp_path / "up" / "supervisor").exists()      # nothing was started
    assert "--metrics-port" in fails("up", "--metrics-port", "0")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("taken, name", [(0, "supervisor"), (2, "s2")])
def test_up_fails_cleanly_when_a_port_is_taken(tmp_path, taken, name):
    """Another deployment (or anything) on one of its ports: `domus up`
    exits non-zero naming the port and the process it was for, and never
    says it is up (a second `domus up` on the ports of a running one)."""
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    port = free_port_block(3)
    squatter.bind((LOOPBACK, port + taken))
    squatter.listen(8)
    up = subprocess.Popen([sys.executable, "-m", "domus", "up", "--services", "2", "--port",
                           str(port), "--data-dir", str(tmp_path / "up")],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          stdin=subprocess.DEVNULL, env=hermetic_env())
    try:
        stdout, stderr = up.communicate(timeout=40)
        assert up.returncode == 1, (stdout, stderr)
        assert f"port {port + taken} on {LOOPBACK} (for {name}) is in use" in stderr
        assert "Domus is up" not in stdout
        assert domus_processes([port, port + 1, port + 2]) == []
    finally:
        squatter.close()
        if up.poll() is None:
            kill_tree(up)


def test_up_refuses_ports_past_the_last(tmp_path):
    result = domus_cmd("up", "--services", "2", "--port", "65535", "--data-dir",
                       str(tmp_path / "up"))
    assert result.returncode == 1
    assert "port 65536 (for s1) is out of range" in result.stderr
    assert "Domus is up" not in result.stdout


@pytest.mark.timeout(120)
def test_up_killed_hard_leaves_no_orphans(tmp_path):
    port = free_port_block(3)
    ports = [port, port + 1, port + 2]
    up = subprocess.Popen([sys.executable, "-m", "domus", "up", "--services", "2", "--port",
                           str(port), "--data-dir", str(tmp_path / "up")],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          stdin=subprocess.DEVNULL, env=hermetic_env())
    try:
        wait_until(lambda: len(domus_processes(ports)) == 3 and up.poll() is None, timeout=45,
                   interval=0.2, what="`domus up` to start its three processes")
        children = psutil.Process(up.pid).children(recursive=True)
        up.kill()
        up.wait(10)
        _gone, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, f"orphans after kill -9 of `domus up`: {alive}"
        assert domus_processes(ports) == []
    finally:
        if up.poll() is None:
            kill_tree(up)
        for process in domus_processes(ports):
            process.kill()
