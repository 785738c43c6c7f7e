"""What the control plane takes from a peer that gets in (issue 15): on an
``--insecure`` deployment (a trusted network, where anyone may connect) the
attacks tried from outside are refused or neutralised all the same, over
the raw control protocol and through the client and the domus command:
launch records that are command lines, hosts that are ssh options, odd
environment keys; registrations that would take over a live service's name
or address; absurd resource figures; names and ids that would reach a path;
control bodies that would expand in memory; DHTs too large to create."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

import domus
from domus.errors import InvalidAttribute
from domus.ops.deploy import free_port_block
from domus.wire import launch as launch_record

from .conftest import _stop_all, own_secret_variable, start_deployment
from .support import CLIENT_TIMEOUT, LOOPBACK, RawControl, service_addresses, wait_until

RECORDS = {f"key-{number}": number for number in range(300)}
COMMAND_TIMEOUT = 60


@pytest.fixture(autouse=True)
def _no_secret(monkeypatch):
    """This module's deployment has no secret: no process of the test may
    name another deployment's ($DOMUS_SECRET_FILE of an earlier module)."""
    monkeypatch.delenv("DOMUS_SECRET_FILE", raising=False)


@pytest.fixture(scope="module")
def open_deployment(tmp_path_factory):
    """An insecure deployment (anyone may connect) with a DHT of known
    records."""
    with own_secret_variable():
        deployment = start_deployment(tmp_path_factory.mktemp("insecure"),
                                      supervisor_args=("--balance", "manual", "--insecure"))
        try:
            with deployment.connect(timeout=CLIENT_TIMEOUT) as cluster:
                cluster.create_dht("kept", buckets=16).update(RECORDS)
            yield deployment
        finally:
            _stop_all(deployment)


def state_of(deployment) -> dict:
    return json.loads(Path(deployment.data_dir, "supervisor", "supervisor.json").read_text())


def unharmed(deployment) -> None:
    """Every record as it was; the deployment's own services up at their own
    addresses with the pids they started with; nobody else registered."""
    with deployment.connect(timeout=CLIENT_TIMEOUT) as cluster:
        assert dict(cluster.open_dht("kept").items()) == RECORDS
        services = {entry["name"]: entry for entry in cluster.services()}
    assert sorted(services) == ["s1", "s2", "s3"]
    for index, name in enumerate(["s1", "s2", "s3"]):
        assert services[name]["state"] == "up", name
        assert services[name]["address"] == deployment.service_address(index)
        assert services[name]["pid"] == deployment.services[name].pid
    assert sorted(state_of(deployment)["services"]) == ["s1", "s2", "s3"]


def register_body(name, address, **changes):
    body = {"name": name, "address": address, "pid": 4242, "version": domus.__version__,
            "resources": {"cores": 2, "ram": 2**30, "disk": 2**34}}
    return {**body, **changes}


def valid_launch(name, address, data_dir="/tmp/rogue"):
    return launch_record.record("service", address, data_dir, [["--heartbeat", 1.0]],
                                name=name, supervisor="127.0.0.1:7700")


def refused(answer, *words):
    ok, body = answer
    assert not ok, f"accepted: {body}"
    assert body["error"] == "RegistrationRefused" or words, body
    for word in words:
        assert word in body["message"], body["message"]
    return body["message"]


def fresh_address():
    return f"{LOOPBACK}:{free_port_block(1)}"


@pytest.mark.parametrize("launch, problem", [
    ({"python": "/bin/sh", "arguments": ["-c", "id > /tmp/domus-pwned"],
      "host": socket.gethostname()}, "command line"),
    ("host", "host"),
    ("env", "LD_PRELOAD"),
    ("option", "refused"),
    ("other service", "not that of this service"),
], ids=["sh -c", "ProxyCommand host", "env key", "option", "another's record"])
def test_a_launch_record_that_is_a_command_line_or_not_valid_is_refused(
        open_deployment, launch, problem):
    address = fresh_address()
    if launch == "host":
        launch = {**valid_launch("evil", address), "host": "-oProxyCommand=touch /tmp/pwned"}
    elif launch == "env":
        launch = {**valid_launch("evil", address), "env": {"LD_PRELOAD": "/tmp/evil.so"}}
    elif launch == "option":
        launch = {**valid_launch("evil", address), "options": [["-c", "import os"]]}
    elif launch == "other service":
        launch = valid_launch("s1", open_deployment.service_address(0))
    link = RawControl.connect(open_deployment.supervisor_address)
    try:
        message = refused(link.call("register", **register_body("evil", address,
                                                                launch=launch)))
        assert problem in message
    finally:
        link.close()
    saved = json.dumps(state_of(open_deployment))
    assert "evil" not in saved and "/bin/sh" not in saved and "ProxyCommand" not in saved
    unharmed(open_deployment)


def test_a_valid_launch_record_is_kept_as_its_fields_only(open_deployment):
    address = fresh_address()
    record = {**valid_launch("visitor", address), "comment": "$(id)"}
    link = RawControl.connect(open_deployment.supervisor_address)
    try:
        ok, answer = link.call("register", **register_body("visitor", address, launch=record))
        assert ok, answer
        kept = state_of(open_deployment)["services"]["visitor"]["launch"]
        assert kept == launch_record.validate(record) and "comment" not in kept
        # A second register on the same connection, now as live s1: refused.
        message = refused(link.call("register", **register_body(
            "s1", open_deployment.service_address(0))), "registered service 'visitor'")
        assert "once" in message
    finally:
        link.close()
    with open_deployment.connect(timeout=CLIENT_TIMEOUT) as cluster:
        wait_until(lambda: {e["name"]: e["state"] for e in cluster.services()}["visitor"]
                   == "down", timeout=30, what="the visitor down")
        cluster.remove_service("visitor")
    unharmed(open_deployment)


def test_a_live_services_name_or_address_is_never_taken_over(open_deployment):
    s1 = open_deployment.service_address(0)
    attempts = [
        ("s1", s1, "taken by a live service"),                    # its own name and address
        ("s1", fresh_address(), "taken by a live service"),       # its name, elsewhere
        ("impostor", s1, "is that of live service 's1'"),         # its address, another name
    ]
    for name, address, problem in attempts:
        link = RawControl.connect(open_deployment.supervisor_address)
        try:
            refused(link.call("register", **register_body(name, address)), problem)
        finally:
            link.close()
    unharmed(open_deployment)
    # ... and the real s1 still serves its buckets (its link was never closed).
    with open_deployment.connect(timeout=CLIENT_TIMEOUT) as cluster:
        stats = cluster.services()
        assert any(entry["name"] == "s1" and entry["buckets"].get("kept") for entry in stats)


@pytest.mark.parametrize("resources, problem", [
    ({"cores": 2, "ram": -1, "disk": 2**30}, "ram"),
    ({"cores": 2, "ram": math.nan, "disk": 2**30}, "ram"),
    ({"cores": 2, "ram": "nan", "disk": 2**30}, "not a number"),
    ({"cores": math.inf, "ram": 2**30, "disk": 2**30}, "cores"),
    ({"cores": 2, "ram": 1e300, "disk": 2**30}, "at most"),
    ({"cores": 0, "ram": 2**30, "disk": 2**30}, "cores"),
    ({"cores": 2, "ram": 2**30, "disk": 2**30, "hostname": "a b"}, "host"),
    ("lots", "map"),
], ids=["negative", "nan", "nan string", "inf cores", "1e300 ram", "no cores", "hostname",
        "not a map"])
def test_resource_figures_must_be_finite_positive_and_bounded(open_deployment, resources,
                                                              problem):
    link = RawControl.connect(open_deployment.supervisor_address)
    try:
        refused(link.call("register", **register_body("greedy", fresh_address(),
                                                      resources=resources)), problem)
    finally:
        link.close()
    assert "greedy" not in state_of(open_deployment)["services"]
    with open_deployment.connect(timeout=CLIENT_TIMEOUT) as cluster:
        dht = cluster.create_dht("after-greedy", buckets=8)   # (creates still work)
        dht["k"] = "v"
        assert dht["k"] == "v"
        cluster.destroy_dht("after-greedy")


def test_a_heartbeat_with_absurd_figures_is_refused(open_deployment):
    address = fresh_address()
    link = RawControl.connect(open_deployment.supervisor_address)
    try:
        assert link.call("register", **register_body("beating", address))[0]
        for load in ({"cpu": math.nan}, {"cpu": -5.0}, {"rss": 1e300}, {"a b": 1.0}):
            ok, body = link.call("heartbeat", name="beating", load=load, stats={})
            assert not ok and "refused" in body["message"], (load, body)
        ok, body = link.call("heartbeat", name="beating", load={"cpu": 1.0},
                             stats={"dhts": {"x": {"records": math.inf}}})
        assert not ok
        assert link.call("heartbeat", name="beating", load={"cpu": 1.0}, stats={})[0]
    finally:
        link.close()
    with open_deployment.connect(timeout=CLIENT_TIMEOUT) as cluster:
        wait_until(lambda: {e["name"]: e["state"] for e in cluster.services()}["beating"]
                   == "down", timeout=30, what="the peer down")
        cluster.remove_service("beating")


BAD_NAMES = ["../x", "/home/alice", "a/b", "a\0b", "a\nb", "x" * 129, "ｘ", "kept\u200b",
             "-rf", ".", ""]


def test_bad_dht_names_are_refused_by_the_client_the_command_and_the_supervisor(
        open_deployment):
    with open_deployment.connect(timeout=CLIENT_TIMEOUT) as cluster:
        for name in BAD_NAMES:
            with pytest.raises(InvalidAttribute, match="not valid"):
                cluster.create_dht(name)
    link = RawControl.connect(open_deployment.supervisor_address)
    try:
        for name in BAD_NAMES + [["list"], {"a": 1}, 7]:
            ok, body = link.call("create_dht", name=name, attributes={})
            assert not ok and body["error"] == "InvalidAttribute", (name, body)
    finally:
        link.close()
    env = dict(os.environ, **open_deployment.environment())
    for name in ("../x", "/home/alice", "a\nb"):
        result = subprocess.run([sys.executable, "-m", "domus", "dht", "create", name],
                                capture_output=True, text=True, env=env,
                                timeout=COMMAND_TIMEOUT, stdin=subprocess.DEVNULL)
        assert result.returncode != 0 and "not valid" in result.stderr, result
    with open_deployment.connect(timeout=CLIENT_TIMEOUT) as cluster:
        assert [dht["name"] for dht in cluster.list_dhts()] == ["kept"]
    for index in range(3):
        home = Path(open_deployment.data_dir, f"s{index + 1}", "dhts")
        assert all(entry.isdigit() for entry in os.listdir(home))


def test_bad_service_names_are_refused_by_register_and_the_command(open_deployment, tmp_path):
    link = RawControl.connect(open_deployment.supervisor_address)
    try:
        for name in BAD_NAMES + [7, None]:
            refused(link.call("register", **register_body(name, fresh_address())),
                    "not valid" if isinstance(name, str) else "")
        for address in ("-oProxyCommand=x:22", "a b:1", "x:99999", "$(id):1", 5):
            refused(link.call("register", **register_body("addressed", address)))
    finally:
        link.close()
    env = dict(os.environ, **open_deployment.environment())
    for name in ("../x", "a\nb", "/home/alice"):
        result = subprocess.run(
            [sys.executable, "-m", "domus", "service", "--name", name, "--listen",
             fresh_address(), "--data-dir", str(tmp_path / "svc")], capture_output=True,
            text=True, env=env, timeout=COMMAND_TIMEOUT, stdin=subprocess.DEVNULL)
        assert result.returncode != 0 and "not valid" in result.stderr, result
    unharmed(open_deployment)


def test_a_control_body_that_would_expand_is_refused_before_it_costs_memory(open_deployment):
    supervisor = psutil.Process(open_deployment.supervisor.pid)
    before = supervisor.memory_info().rss
    link = RawControl.connect(open_deployment.supervisor_address)
    try:
        # 2 MiB of empty arrays: some 130 MiB once decoded, were it decoded.
        nested = (b"\x82\xa2op\xa4ping\xa1x\xdd" + (2 << 20).to_bytes(4, "big")
                  + b"\x90" * (2 << 20))
        ok, body = link.send_raw(nested)
        assert not ok and "arrays and maps" in body["message"], body
        # Over the supervisor's 4 MiB body limit: refused by size alone.
        ok, body = link.send_raw(b"\x81\xa2op\xa4ping" + b"\x00" * (5 << 20))
        assert not ok and "limit" in body["message"], body
        assert link.call("ping")[0]            # the connection is still good
    finally:
        link.close()
    grown = supervisor.memory_info().rss - before
    assert grown < 64 << 20, f"the supervisor grew by {grown >> 20} MiB"
    unharmed(open_deployment)


def test_a_dht_larger_than_its_services_can_take_is_refused_with_the_limit(open_deployment):
    with open_deployment.connect(timeout=CLIENT_TIMEOUT) as cluster:
        with pytest.raises(InvalidAttribute, match=r"at most 131072 buckets") as too_big:
            cluster.create_dht("huge", buckets=1 << 24)
        assert "65536" in str(too_big.value)
        with pytest.raises(InvalidAttribute, match=r"at most 2048 buckets"):
            cluster.create_dht("huge-bdb", buckets=1 << 16, storage="disk",
                               platform="domus-bsddb-btree")
        assert [dht["name"] for dht in cluster.list_dhts()] == ["kept"]
        addresses = service_addresses(cluster)
    assert len(addresses) == 3
