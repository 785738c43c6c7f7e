"""The benchmarks' C programs on their own: domus-bench's key derivation
(SHA-256 and HMAC written in C) against Python's, its refusals of bad
arguments and secret files, and its open and closed loops against
domus-udp-echo, the bare UDP loop."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.programs import ProgramMissing, program
from domus.wire import secret


def binary(name: str) -> str:
    try:
        return program(name)
    except ProgramMissing as missing:
        pytest.fail(str(missing))


def bench(*arguments: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([binary("domus-bench"), *arguments], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("secret_bytes", [
    bytes(range(32)),               # what a supervisor makes
    b"\xff" * 16,                   # the shortest allowed
    bytes(range(100)),              # longer than HMAC's block: hashed first
])
def test_the_data_key_is_pythons(tmp_path: Path, secret_bytes: bytes) -> None:
    path = tmp_path / "secret"
    path.write_text(secret_bytes.hex() + "\n")
    path.chmod(0o600)
    done = bench("--derive-key", str(path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == secret.Keys.from_secret(secret_bytes, str(path)).data.hex()


@pytest.mark.parametrize("content, mode, says", [
    ("00" * 32, 0o644, "may be read by others"),
    ("not hex at all", 0o600, "is not a Domus deployment secret"),
    ("abc", 0o600, "is not a Domus deployment secret"),
    ("00" * 8, 0o600, "it needs 16 at least"),
])
def test_a_bad_secret_file_is_refused(tmp_path: Path, content: str, mode: int,
                                      says: str) -> None:
    path = tmp_path / "secret"
    path.write_text(content)
    path.chmod(mode)
    done = bench("--service", "127.0.0.1:9", "--dht-id", "1", "--secret-file", str(path))
    assert done.returncode == 2
    assert says in done.stderr and str(path) in done.stderr


def test_a_missing_secret_says_what_to_give(tmp_path: Path) -> None:
    environment = {key: value for key, value in os.environ.items()
                   if key != secret.ENVIRONMENT}
    done = subprocess.run([binary("domus-bench"), "--service", "127.0.0.1:9", "--dht-id", "1"],
                          capture_output=True, text=True, cwd=tmp_path, env=environment,
                          timeout=30)
    assert done.returncode == 2
    assert "--secret-file" in done.stderr and "--insecure" in done.stderr


@pytest.mark.parametrize("arguments, says", [
    ([], "--service HOST:PORT is required"),
    (["--service", "127.0.0.1:9"], "--dht-id is required"),
    (["--service", "127.0.0.1:9", "--dht-id", "1", "--buckets", "12"], "power of two"),
    (["--service", "127.0.0.1:9", "--dht-id", "1", "--buckets", "8",
      "--bucket-range", "4:9"], "has 8 buckets"),
    (["--service", "127.0.0.1:9", "--dht-id", "1", "--inflight", "5000"], "1 to 4096"),
    (["--service", "127.0.0.1:9", "--dht-id", "1", "--value-size", "70000"], "over TCP"),
    (["--service", "127.0.0.1:9", "--dht-id", "1", "--hash", "sha256"], "xxh3 and xxh64"),
    (["--service", "127.0.0.1:9", "--dht-id", "1", "--rate", "-3"], "more than 0"),
    (["--service", "127.0.0.1:9", "--dht-id", "x"], "not a number"),
    (["--service", "127.0.0.1:9", "--dht-id", "1", "--zipf-theta", "1"], "both excluded"),
    (["--bogus"], "unknown argument --bogus"),
])
def test_bad_arguments_are_refused(arguments: list[str], says: str) -> None:
    done = bench(*arguments, "--insecure")
    assert done.returncode == 2
    assert says in done.stderr


@pytest.fixture
def echo_server() -> Iterator[tuple[str, subprocess.Popen]]:
    """domus-udp-echo on a free port: (its address, its process)."""
    process = subprocess.Popen([binary("domus-udp-echo"), "127.0.0.1:0"],
                               stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()       # printed once bound
        assert line.startswith("listening on "), line
        yield line.split()[-1], process
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture
def echo(echo_server: tuple[str, subprocess.Popen]) -> str:
    return echo_server[0]


def test_open_loop_sends_at_the_rate_asked(echo: str) -> None:
    """In open loop the requests measured are those *intended* in the
    measured time, rate x seconds of them, however the machine keeps up."""
    done = bench("--service", echo, "--echo", "--rate", "2000", "--seconds", "0.5",
                 "--warmup", "0.1", "--timeout", "5", "--json", "--threads", "2",
                 "--distribution", "zipf")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert abs(report["requests"] - 1000) <= 2
    assert report["timeouts"] == 0 and report["bad_replies"] == 0
    latency = report["latency_us"]
    assert 0 < latency["p50"] <= latency["p90"] <= latency["p99"] <= latency["max"]


def test_a_stall_is_charged_to_every_request_it_delays(
        echo_server: tuple[str, subprocess.Popen]) -> None:
    """No coordinated omission: with the server stopped for 0.4 s, the
    requests intended meanwhile (not only the few in flight) are sent late
    and measured from their intended time."""
    import signal
    import time

    echo, server = echo_server
    pid = server.pid
    run = subprocess.Popen([binary("domus-bench"), "--service", echo, "--echo", "--rate", "1000",
                            "--inflight", "4", "--seconds", "1.5", "--warmup", "0",
                            "--timeout", "5", "--json"], stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.3)                 # the stall begins inside the measured time
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.4)                 # the stall itself
    finally:
        os.kill(pid, signal.SIGCONT)
    output, _ = run.communicate(timeout=30)
    report = json.loads(output)
    # (every request intended in the 1.5 s, the ~400 the stall delayed too;
    # a thread that starts its clock a few ms late on a loaded machine
    # intends a few fewer: a gate at 9e4923c counted 1,497)
    assert abs(report["requests"] - 1500) <= 15 and report["timeouts"] == 0
    # ~400 of 1,500 requests were delayed by up to 0.4 s: the slowest tenth
    # waited over 0.1 s (with coordinated omission only the 4 in flight would)
    assert report["latency_us"]["p90"] >= 100_000
    assert report["latency_us"]["max"] >= 300_000


def test_closed_loop_keeps_requests_in_flight(echo: str) -> None:
    done = bench("--service", echo, "--echo", "--seconds", "0.3", "--warmup", "0",
                 "--inflight", "64", "--value-size", "1000")
    assert done.returncode == 0, done.stderr
    assert "requests/s" in done.stdout and "lost (timed out) 0" in done.stdout


def test_nothing_answering_is_exit_status_1() -> None:
    done = bench("--service", "127.0.0.1:9", "--dht-id", "1", "--insecure", "--seconds",
                 "0.2", "--warmup", "0", "--timeout", "0.1", "--json")
    assert done.returncode == 1
    assert json.loads(done.stdout)["replies"] == 0


@pytest.fixture
def redis_port() -> Iterator[int]:
    import shutil

    from benchmarks.put1 import wait_for_redis
    from domus.ops.deploy import free_port_block

    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (make installs it)")
    port = free_port_block(1)
    server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        wait_for_redis(port)
        yield port
    finally:
        server.terminate()
        server.wait(10)


def test_redis_mode_writes_what_domus_bench_writes(redis_port: int) -> None:
    """--redis: the same keys and values over RESP, each connection one
    request at a time; every GET of a preloaded key finds it."""
    import redis

    done = bench("--redis", "--service", f"127.0.0.1:{redis_port}", "--keys", "300",
                 "--value-size", "30", "--preload", "--op", "get", "--inflight", "8",
                 "--seconds", "0.3", "--warmup", "0", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["preloaded"] == 300 and report["requests"] > 0
    assert set(report["statuses"]) == {"OK"} and report["bad_replies"] == 0
    client = redis.Redis(port=redis_port)
    assert client.dbsize() == 300
    assert client.get("bench:123") == (b"bench:123" * 4)[:30]
