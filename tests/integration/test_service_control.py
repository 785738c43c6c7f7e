"""A real service, driven by a hand-built supervisor (a socket in this test,
on an insecure deployment): DHT ids and descriptors that would reach a path
are refused before any file is touched; a drop or discard must name the
DHT's deployment and stamp; a DHT the supervisor stops listing is kept and
reported, and only a discard naming it deletes it (issue 15)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from domus.ops.deploy import free_port_block
from domus.wire import protocol as wire
from domus.wire.keys import encode_key

from .support import LOOPBACK, RawControl, RawUdp, wait_until

DEPLOYMENT = "d" * 32
STAMP = "5" * 32
BUCKETS = 4


def descriptor(service, address, dht_id=5, **changes):
    base = {"id": dht_id, "name": f"dht{dht_id}", "buckets": BUCKETS, "hash": "xxh3",
            "storage": "ram", "platform": "python-dict", "routing": "chord", "lookup": "D",
            "state": "active", "version": 1, "deployment": DEPLOYMENT, "stamp": STAMP,
            "routing_services": [{"name": service, "address": address, "count": BUCKETS}],
            "storage_services": [{"name": service, "address": address, "count": BUCKETS}]}
    return {**base, **changes}


@pytest.fixture
def driven(tmp_path):
    """A service process whose supervisor is this test: yields (link, the
    service's name and address, its data dir, a victim directory outside
    it holding a precious file)."""
    listener = socket.create_server((LOOPBACK, 0))
    listener.settimeout(30)
    supervisor = f"{LOOPBACK}:{listener.getsockname()[1]}"
    address = f"{LOOPBACK}:{free_port_block(1)}"
    data_dir = tmp_path / "svc"
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    env = {key: value for key, value in os.environ.items() if key != "DOMUS_SECRET_FILE"}
    with open(tmp_path / "service.log", "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "domus", "service", "--name", "s1", "--supervisor",
             supervisor, "--listen", address, "--data-dir", str(data_dir), "--heartbeat",
             "0.2"], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL)
    link = None
    try:
        sock, _peer = listener.accept()
        link = RawControl(sock, accepting=True)
        register = link.next_request("register")
        assert register["name"] == "s1" and register["holdings"] == []
        # The register answer already carries a descriptor and a drop that
        # would reach the victim: both refused (and logged), and the
        # service registers all the same: its heartbeats begin.
        link.send_frame(wire.reply(wire.ST_OK, link.last_request_id, wire.pack({
            "dhts": [descriptor("s1", address, dht_id=str(victim))],
            "drop": [{"id": str(victim), "deployment": DEPLOYMENT, "stamp": STAMP}],
            "supervisor_version": "test", "deployment": DEPLOYMENT})))
        link.answer = lambda op, body: {"ok": True}
        link.next_request("heartbeat")
        yield link, "s1", address, data_dir, victim, tmp_path / "service.log"
    finally:
        if link is not None:
            link.close()
        process.kill()
        process.wait(10)
        listener.close()


def test_ids_and_descriptors_that_would_reach_a_path_are_refused(driven):
    link, name, address, data_dir, victim, log_path = driven
    bad_ids = [str(victim), "../../victim", "/home/alice", -1, 0, 2**40, True, None, 1.5,
               [5], {"id": 5}]
    for dht_id in bad_ids:
        ok, body = link.call("assign", dht=descriptor(name, address, dht_id=dht_id))
        assert not ok and "DHT id" in body["message"], (dht_id, body)
        ok, body = link.call("drop", id=dht_id, deployment=DEPLOYMENT, stamp=STAMP)
        assert not ok and "not valid" in body["message"], (dht_id, body)
        ok, body = link.call("discard", id=dht_id, deployment=DEPLOYMENT, stamp=STAMP)
        assert not ok, (dht_id, body)
    for change, problem in [({"name": "../x"}, "name"), ({"name": "a\nb"}, "name"),
                            ({"buckets": 3}, "power of two"), ({"buckets": 1 << 30}, "power"),
                            ({"storage": "/tmp"}, "storage"), ({"platform": "../x"}, "platform"),
                            ({"stamp": "../../x"}, "stamp"), ({"deployment": 7}, "deployment"),
                            ({"storage_services": [{"name": "a/b", "address": address,
                                                    "count": BUCKETS}]}, "service name"),
                            ({"routing_services": "all"}, "list")]:
        ok, body = link.call("assign", dht=descriptor(name, address, **change))
        assert not ok and problem in body["message"], (change, body)
    for dhts in ("all", 5, None):
        ok, body = link.call("sync", dhts=dhts)
        assert not ok, (dhts, body)
    ok, body = link.call("sync", dhts=[descriptor(name, address, dht_id="/home/alice")])
    assert ok                             # (refused and logged, the rest is synced)
    for op in ("track_bucket", "freeze_bucket", "export_bucket", "discard_bucket"):
        for dht_id, bucket in ((str(victim), 0), (5, 0)):
            ok, body = link.call(op, id=dht_id, bucket=bucket)
            assert not ok, (op, dht_id, body)
    assert (victim / "precious").read_text() == "keep me"
    assert not (data_dir / "dhts").exists() or os.listdir(data_dir / "dhts") == []
    assert "Traceback" not in log_path.read_text()


def test_a_drop_or_discard_must_name_the_dht_and_absence_deletes_nothing(driven):
    link, name, address, data_dir, _victim, _log = driven
    ok, body = link.call("assign", dht=descriptor(name, address))
    assert ok, body
    assert (data_dir / "dhts" / "5" / "identity.json").exists()
    with RawUdp(address, keys=None) as raw:
        for number in range(20):
            key = encode_key(f"k{number}")
            request = wire.encode_keyed(wire.OP_PUT, 0, 0, 5, _bucket(key), key,
                                        wire.pack(number))
            status, _ = raw.call(wire.OP_PUT, request[wire.REQUEST_HEADER_SIZE:])
            assert status == wire.ST_OK

    # Moves on a bucket out of range are refused.
    for bucket in (-1, BUCKETS, 10**12, True, "0"):
        ok, body = link.call("track_bucket", id=5, bucket=bucket)
        assert not ok, (bucket, body)
    # A new DHT under the same id (another stamp) is not opened over it.
    ok, body = link.call("assign", dht=descriptor(name, address, stamp="6" * 32))
    assert not ok and "another DHT with id 5" in body["message"], body
    # Drops that do not name it exactly are refused.
    for named in ({"id": 5}, {"id": 5, "deployment": DEPLOYMENT, "stamp": "6" * 32},
                  {"id": 5, "deployment": "e" * 32, "stamp": STAMP}):
        ok, body = link.call("drop", **named)
        assert not ok and "refuses to drop" in body["message"], (named, body)
    assert _records(address) == 20
    # The supervisor no longer lists it: kept, and reported as unclaimed.
    assert link.call("sync", dhts=[])[0]
    link.requests.clear()
    beat = wait_until(lambda: _orphans(link), timeout=10, what="a heartbeat with orphans")
    assert [(o["id"], o["stamp"], o["records"]) for o in beat] == [(5, STAMP, 20)]
    assert _records(address) == 20
    # A discard that does not name it is refused; one that does deletes it.
    ok, body = link.call("discard", id=5, deployment=DEPLOYMENT, stamp="6" * 32)
    assert not ok and _records(address) == 20
    ok, body = link.call("discard", id=5, deployment=DEPLOYMENT, stamp=STAMP)
    assert ok and body == {"discarded": 5}, body
    assert not (data_dir / "dhts" / "5").exists()
    link.requests.clear()
    wait_until(lambda: _heartbeat(link) is not None and _orphans(link) == [], timeout=10,
               what="a heartbeat without orphans")


def _bucket(key: bytes) -> int:
    from domus.wire.keys import bucket_of
    return bucket_of(key, "xxh3", BUCKETS)


def _records(address: str) -> int:
    with RawUdp(address, keys=None) as raw:
        return raw.stats()["dhts"]["dht5"]["records"]


def _heartbeat(link):
    for _id, body in reversed(link.requests):
        if body["op"] == "heartbeat":
            return body
    link.sock.settimeout(1)
    try:
        frame = link.read_frame()
        if frame[0] != wire.REPLY_MAGIC:
            link._request(frame)
    except TimeoutError:
        pass
    finally:
        link.sock.settimeout(10)
    return None


def _orphans(link):
    beat = _heartbeat(link)
    if beat is None:
        return None
    return beat["stats"].get("orphans")


def test_a_transient_register_error_is_retried_and_a_refusal_stops_the_service(tmp_path):
    listener = socket.create_server((LOOPBACK, 0))
    listener.settimeout(30)
    supervisor = f"{LOOPBACK}:{listener.getsockname()[1]}"
    address = f"{LOOPBACK}:{free_port_block(1)}"
    env = {key: value for key, value in os.environ.items() if key != "DOMUS_SECRET_FILE"}
    with open(tmp_path / "service.log", "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "domus", "service", "--name", "s1", "--supervisor",
             supervisor, "--listen", address, "--data-dir", str(tmp_path / "svc")],
            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL)
    try:
        link = RawControl(listener.accept()[0], accepting=True)
        # A full disk, then an internal error: the service tries again, on
        # the same link, later each time.
        for message in ("the supervisor could not save its state: [Errno 28] No space "
                        "left on device", "internal error in 'register'"):
            link.next_request("register")
            link.send_frame(wire.reply(wire.ST_CONTROL_ERROR, link.last_request_id, wire.pack(
                {"error": "SupervisorError", "message": message})))
        link.next_request("register")
        assert process.poll() is None
        # A refusal for a reason: it stops, saying why.
        link.send_frame(wire.reply(wire.ST_CONTROL_ERROR, link.last_request_id, wire.pack(
            {"error": "RegistrationRefused", "message": "service name 's1' is taken"})))
        assert process.wait(30) == 2
        said = (tmp_path / "service.log").read_text()
        assert said.count("retrying in") == 2 and "is taken" in said
        link.close()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        listener.close()
