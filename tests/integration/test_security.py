"""Only a deployment's own processes get in (issue 15): with the wrong
secret or none, the domus command, a Python client (blocking and Twisted),
a raw TCP peer, a raw UDP sender and a would-be service can neither read nor
change anything, nor register, nor get a launch record stored; forged and
replayed datagrams are refused and counted.  (With the right secret,
everything else in the suite runs as before: the fixtures give it.)"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

import domus
from domus.errors import AuthenticationError
from domus.ops.deploy import free_port_block
from domus.wire import auth, secret
from domus.wire import protocol as wire
from domus.wire.keys import encode_key

from .support import (
    CLIENT_TIMEOUT,
    LOOPBACK,
    RawUdp,
    bucket_of_key,
    owner_of,
    service_addresses,
)

COMMAND_TIMEOUT = 60
RECORDS = {f"key-{number}": number for number in range(200)}
FRAME = struct.Struct(">I")


@pytest.fixture(scope="module")
def guarded(shared_deployment):
    """The shared deployment with a DHT of known records, and a second
    secret (another deployment's)."""
    with domus.connect(shared_deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as cluster:
        dht = cluster.create_dht("guarded", buckets=16)
        dht.update(RECORDS)
    other = os.path.join(shared_deployment.data_dir, "other-secret")
    secret.create(other)
    yield shared_deployment, other


def untouched(deployment) -> None:
    """Every record as it was, and no service but the deployment's own."""
    with deployment.connect(timeout=CLIENT_TIMEOUT) as cluster:
        dht = cluster.open_dht("guarded")
        assert dict(dht.items()) == RECORDS
        assert sorted(entry["name"] for entry in cluster.services()) == ["s1", "s2", "s3"]
    state = json.loads(Path(deployment.data_dir, "supervisor", "supervisor.json").read_text())
    assert sorted(state["services"]) == ["s1", "s2", "s3"]


def refused_connections(deployment) -> int:
    with deployment.connect(timeout=CLIENT_TIMEOUT) as cluster:
        return cluster.status()["supervisor"]["refused_connections"]


def run_domus(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "domus", *args], capture_output=True,
                          text=True, timeout=COMMAND_TIMEOUT, env=env, stdin=subprocess.DEVNULL)


def environment(tmp_path: Path, secret_file: str | None) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if key not in ("DOMUS_SECRET_FILE", "DOMUS_SUPERVISOR")}
    if secret_file is not None:
        env["DOMUS_SECRET_FILE"] = secret_file
    return env


@pytest.mark.parametrize("which", ["none", "another"])
def test_the_domus_command_without_the_secret_is_refused_and_changes_nothing(
        guarded, tmp_path, which):
    deployment, other = guarded
    env = environment(tmp_path, None if which == "none" else other)
    before = refused_connections(deployment)
    supervisor = ["--supervisor", deployment.supervisor_address]
    for command in (["dht", "list"], ["get", "guarded", "key-1"],
                    ["put", "guarded", "key-1", "evil"], ["dht", "destroy", "guarded"],
                    ["service", "remove", "s1", "--force"], ["deployment", "shutdown"]):
        result = subprocess.run([sys.executable, "-m", "domus", *command, *supervisor],
                                capture_output=True, text=True, timeout=COMMAND_TIMEOUT,
                                env=env, stdin=subprocess.DEVNULL, cwd=tmp_path)
        assert result.returncode != 0, (command, result.stdout)
        assert "Traceback" not in result.stderr, result.stderr
        if which == "none":
            assert "needs its secret" in result.stderr and "DOMUS_SECRET_FILE" in result.stderr
        else:
            assert "does not hold this deployment's secret" in result.stderr
            assert other in result.stderr                  # (which file it used)
    assert refused_connections(deployment) >= before + 6
    untouched(deployment)


def test_python_clients_without_the_secret_get_authentication_errors(guarded, tmp_path,
                                                                     monkeypatch):
    deployment, other = guarded
    monkeypatch.delenv("DOMUS_SECRET_FILE")
    monkeypatch.chdir(tmp_path)            # (no ./domus-data/supervisor/secret here)
    with pytest.raises(AuthenticationError, match="DOMUS_SECRET_FILE"):
        domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT)
    with pytest.raises(AuthenticationError, match="does not hold"):
        domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT, secret_file=other)
    script = tmp_path / "tx.py"
    script.write_text(
        "import sys\n"
        "from twisted.internet import defer, task\n"
        "from domus import txclient\n"
        "from domus.errors import AuthenticationError\n"
        "async def job(reactor):\n"
        "    for secret_file in (None, sys.argv[2]):\n"
        "        try:\n"
        "            await txclient.connect(sys.argv[1], timeout=5, reactor=reactor,\n"
        "                                   secret_file=secret_file)\n"
        "        except AuthenticationError as exc:\n"
        "            print('refused:', exc)\n"
        "        else:\n"
        "            print('let in')\n"
        "task.react(lambda reactor: defer.Deferred.fromCoroutine(job(reactor)))\n")
    finished = subprocess.run([sys.executable, str(script), deployment.supervisor_address,
                               other], capture_output=True, text=True, timeout=COMMAND_TIMEOUT,
                              env=environment(tmp_path, None), cwd=tmp_path)
    lines = finished.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("refused:") for line in lines), (
        finished.stdout, finished.stderr[-2000:])
    assert "needs its secret" in lines[0] and "does not hold" in lines[1]
    untouched(deployment)


def raw_tcp(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    assert host == LOOPBACK
    return socket.create_connection((host, int(port)), timeout=10)


def closed_without_answer(sock: socket.socket) -> bool:
    """Reads what the peer sends until it closes: True if it sent nothing
    but handshake frames (a HELLO, a REFUSE) before closing."""
    data = b""
    sock.settimeout(10)
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except ConnectionResetError:
        pass
    while data:
        (size,) = FRAME.unpack_from(data)
        frame, data = data[4:4 + size], data[4 + size:]
        if not auth.is_handshake(frame):
            return False
    return True


def test_a_raw_tcp_peer_cannot_call_the_supervisor_or_register(guarded):
    deployment, _other = guarded
    launch = {"python": "/bin/sh", "arguments": ["-c", "id > /tmp/domus-pwned"],
              "host": socket.gethostname()}
    for body in ({"op": "register", "name": "evil", "address": "127.0.0.1:9",
                  "resources": {"cores": 2, "ram": 2**30, "disk": 2**30}, "launch": launch},
                 {"op": "destroy_dht", "name": "guarded"}, {"op": "shutdown"}):
        sock = raw_tcp(deployment.supervisor_address)
        message = wire.encode_control(1, 2, body)
        sock.sendall(FRAME.pack(len(message)) + message)
        assert closed_without_answer(sock), body
        sock.close()
    # A peer that answers the HELLO with a made-up proof fares no better.
    sock = raw_tcp(deployment.supervisor_address)
    sock.settimeout(10)
    (size,) = FRAME.unpack(sock.recv(4))
    hello = sock.recv(size)
    assert hello[:3] == bytes((auth.AUTH_MAGIC, auth.AUTH_VERSION)) + auth.HELLO
    proof = auth._frame(auth.PROOF, os.urandom(auth.NONCE_BYTES + auth.PROOF_BYTES))
    sock.sendall(FRAME.pack(len(proof)) + proof)
    message = wire.encode_control(1, 2, {"op": "destroy_dht", "name": "guarded"})
    sock.sendall(FRAME.pack(len(message)) + message)
    assert closed_without_answer(sock)
    sock.close()
    assert not os.path.exists("/tmp/domus-pwned") or os.path.getmtime(
        "/tmp/domus-pwned") < time.time() - 3600
    state = Path(deployment.data_dir, "supervisor", "supervisor.json").read_text()
    assert "evil" not in state and "/bin/sh" not in state
    untouched(deployment)


def test_a_raw_tcp_peer_cannot_read_or_write_a_service(guarded):
    deployment, _other = guarded
    with domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as cluster:
        dht = cluster.open_dht("guarded")
        key = "key-7"
        address = service_addresses(cluster)[owner_of(dht, key)]
        bucket = bucket_of_key(dht, key)
        dht_id = dht.id
    for message in (wire.encode_keyed(wire.OP_GET, 1, 2, dht_id, bucket, encode_key(key)),
                    wire.encode_keyed(wire.OP_PUT, 2, 2, dht_id, bucket, encode_key(key),
                                      wire.pack("evil"))):
        sock = raw_tcp(address)
        sock.sendall(FRAME.pack(len(message)) + message)
        assert closed_without_answer(sock)
        sock.close()
    untouched(deployment)


def test_raw_datagrams_without_a_valid_mac_get_nothing_and_change_nothing(guarded):
    deployment, other = guarded
    with domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as cluster:
        dht = cluster.open_dht("guarded")
        addresses = service_addresses(cluster)
        targets = {}
        for key in RECORDS:
            targets.setdefault(owner_of(dht, key), key)
        dht_id = dht.id
    wrong = secret.Keys.from_secret(secret.load(other), other)
    for name, key in targets.items():
        bucket, encoded = bucket_of_key(dht, key), encode_key(key)
        with RawUdp(addresses[name]) as raw:
            before = raw.stats()["unauthenticated"]
            forged = [wire.encode_keyed(wire.OP_PUT, 1, raw.client_id, dht_id, bucket, encoded,
                                        wire.pack("evil")),
                      wire.encode_keyed(wire.OP_DELETE, 2, raw.client_id, dht_id, bucket,
                                        encoded),
                      wire.encode_keyed(wire.OP_GET, 3, raw.client_id, dht_id, bucket, encoded),
                      wire.request_header(wire.OP_STATS, 4, raw.client_id)]
            for message in forged:
                raw.send_unsealed(message)                               # no MAC
                raw.send_unsealed(auth.seal_request(wrong.data, message))  # another key's
            raw.sock.settimeout(0.5)
            answers = []
            try:
                while True:
                    answers.append(raw.sock.recv(65536))
            except TimeoutError:
                pass
            assert answers == [], f"{name} answered an unauthenticated datagram"
            after = raw.stats()["unauthenticated"]
        assert after - before == 2 * len(forged), name
    untouched(deployment)


def test_a_replayed_datagram_outside_the_time_window_is_refused_as_stale(guarded):
    deployment, _other = guarded
    with domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as cluster:
        dht = cluster.open_dht("guarded")
        key = "key-3"
        address = service_addresses(cluster)[owner_of(dht, key)]
        bucket, encoded, dht_id = bucket_of_key(dht, key), encode_key(key), dht.id
    with RawUdp(address) as raw:
        before = raw.stats()["stale"]
        # A put captured on the wire a minute ago (its MAC is good), sent again.
        message = wire.encode_keyed(wire.OP_DELETE, 77, raw.client_id, dht_id, bucket, encoded)
        captured = auth.seal_request(raw.key, message, seconds=int(time.time()) - 60)
        raw.send_unsealed(captured)
        raw.sock.settimeout(5)
        reply = auth.open_reply(raw.key, raw.sock.recv(65536), message[8:16], captured[-12:-8])
        assert reply is not None and reply[2] == wire.ST_STALE_REQUEST
        assert b"clock" in reply                      # (the message says why)
        assert raw.stats()["stale"] == before + 1
    untouched(deployment)


def test_a_record_tree_answers_sealed_gets_from_its_arena_and_nothing_unsealed(guarded):
    """domus-rbt buckets keep records as bytes in an arena; the C path copies
    a value from it into the reply and seals that, as it seals a dict's."""
    deployment, other = guarded
    records = {f"tree-{number}": b"v" * number for number in range(0, 1200, 7)}
    with deployment.connect(timeout=CLIENT_TIMEOUT) as cluster:
        dht = cluster.create_dht("guarded-tree", buckets=8, platform="domus-rbt")
        try:
            dht.update(records)
            assert dict(dht.items()) == records
            assert dht.get_many(list(records)) == records
            addresses = service_addresses(cluster)
            key = "tree-700"
            address = addresses[owner_of(dht, key)]
            bucket, encoded, dht_id = bucket_of_key(dht, key), encode_key(key), dht.id
            wrong = secret.Keys.from_secret(secret.load(other), other)
            with RawUdp(address) as raw:
                status, body = raw.call(wire.OP_GET,
                                        wire.KEYED.pack(dht_id, bucket, len(encoded)) + encoded)
                assert (status, wire.unpack(body)) == (wire.ST_OK, records[key])
                after = raw.stats()
                message = wire.encode_keyed(wire.OP_GET, 9, raw.client_id, dht_id, bucket,
                                            encoded)
                raw.send_unsealed(message)
                raw.send_unsealed(auth.seal_request(wrong.data, message))
                raw.sock.settimeout(0.5)
                with pytest.raises(TimeoutError):
                    raw.sock.recv(65536)
                assert raw.stats()["unauthenticated"] == after["unauthenticated"] + 2
        finally:
            cluster.destroy_dht("guarded-tree")
    untouched(deployment)


def test_a_service_with_the_wrong_secret_cannot_register(guarded, tmp_path):
    deployment, other = guarded
    port = free_port_block(1)
    env = environment(tmp_path, other)
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "domus", "service", "--name", "rogue", "--supervisor",
         deployment.supervisor_address, "--listen", f"{LOOPBACK}:{port}", "--data-dir",
         str(tmp_path / "rogue"), "--heartbeat", "0.2"],
        capture_output=True, text=True, timeout=COMMAND_TIMEOUT, env=env,
        stdin=subprocess.DEVNULL, cwd=tmp_path)
    assert result.returncode == 2, (result.stdout[-2000:], result.stderr[-2000:])
    assert "refused" in result.stdout + result.stderr
    assert time.monotonic() - started < 30
    untouched(deployment)
