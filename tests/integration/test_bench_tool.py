"""domus-bench against a real deployment: what it writes is there, as any
client reads it.

The deployment is a secure one (three services, a secret): domus-bench
seals every request with the data key it derives from the secret file and
checks every reply's MAC, and for a DHT stored on three services it is run
once per service with that service's bucket range.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from benchmarks.programs import ProgramMissing, bench_targets, program
from domus.wire import secret
from domus.wire.keys import bucket_of, encode_key

from .conftest import _stop_all, start_deployment

KEYS = 600
VALUE_SIZE = 40


def expected_value(key: str, size: int = VALUE_SIZE) -> bytes:
    """The value domus-bench puts under ``key``: its text repeated."""
    text = key.encode()
    return (text * (size // len(text) + 1))[:size]


def key_space(prefix: str, target: list[str], descriptor: dict[str, Any]) -> list[str]:
    """The keys domus-bench uses with these arguments: the first KEYS keys
    "<prefix><n>" of the buckets in its range."""
    first, end = 0, descriptor["buckets"]
    if "--bucket-range" in target:
        first, end = map(int, target[target.index("--bucket-range") + 1].split(":"))
    keys: list[str] = []
    number = 0
    while len(keys) < KEYS:
        key = f"{prefix}{number}"
        if first <= bucket_of(encode_key(key), descriptor["hash"], descriptor["buckets"]) < end:
            keys.append(key)
        number += 1
    return keys


def run_bench(arguments: list[str], timeout: float = 60) -> tuple[int, dict[str, Any], str]:
    try:
        binary = program("domus-bench")
    except ProgramMissing as missing:
        pytest.fail(str(missing))
    done = subprocess.run([binary, *arguments, "--json"], capture_output=True, text=True,
                          timeout=timeout)
    report = json.loads(done.stdout) if done.stdout.strip() else {}
    return done.returncode, report, done.stderr


def test_what_domus_bench_writes_is_there(shared_cluster: Any) -> None:
    dht = shared_cluster.create_dht("bench", buckets=16)
    descriptor = shared_cluster.supervisor.call("open_dht", name="bench")
    targets = bench_targets(descriptor)
    assert len(targets) == 3, "the DHT should be stored on the three services"
    keys: list[str] = []
    for index, target in enumerate(targets):
        keys += key_space(f"s{index}:", target, descriptor)
        status, report, errors = run_bench([
            *target, "--keys", str(KEYS), "--key-prefix", f"s{index}:",
            "--value-size", str(VALUE_SIZE), "--preload", "--op", "mixed",
            "--get-ratio", "0.5", "--threads", "2", "--inflight", "16",
            "--seconds", "0.4", "--warmup", "0.1", "--timeout", "2"])
        assert status == 0, errors
        assert report["secure"] is True
        assert report["preloaded"] == KEYS
        assert report["requests"] > 0
        assert report["bad_mac"] == 0 and report["bad_replies"] == 0
        assert report["wrong_values"] == 0
        # every key was preloaded, so every GET found its value
        assert set(report["statuses"]) == {"OK"}, report["statuses"]
        latency = report["latency_us"]
        assert 0 < latency["p50"] <= latency["p99"] <= latency["p99.9"] <= latency["max"]
    found = dht.get_many(keys)
    assert len(found) == len(keys)
    wrong = [key for key in keys if found[key] != expected_value(key)]
    assert not wrong, f"{len(wrong)} keys with another value, e.g. {wrong[:3]}"
    assert len(dht) == len(keys)


def test_requests_without_the_secret_are_not_taken(shared_cluster: Any, tmp_path: Any) -> None:
    dht = shared_cluster.create_dht("unsealed", buckets=1)
    descriptor = shared_cluster.supervisor.call("open_dht", name="unsealed")
    (target,) = bench_targets(descriptor)
    other = tmp_path / "other-secret"
    secret.create(str(other))
    for credentials in (["--insecure"], ["--secret-file", str(other)]):
        status, report, errors = run_bench([*target, *credentials, "--keys", "10",
                                            "--seconds", "0.3", "--warmup", "0",
                                            "--timeout", "0.2"])
        assert status == 1, (credentials, report, errors)
        assert report["replies"] == 0 and report["timeouts"] > 0
    assert len(dht) == 0


def test_busy_answers_are_counted_apart_not_as_requests_served(tmp_path: Any) -> None:
    # A service whose reply cache takes 100 changes per 15 s: past them, every
    # put is answered BUSY; domus-bench counts those apart, not as served.
    deployment = start_deployment(tmp_path, services=1,
                                  service_args=("--reply-cache-entries", "200"))
    try:
        with deployment.connect() as cluster:
            cluster.create_dht("refusing", buckets=1)
            descriptor = cluster.supervisor.call("open_dht", name="refusing")
        (target,) = bench_targets(descriptor)
        status, report, errors = run_bench([
            *target, "--secret-file", deployment.secret_file, "--keys", "1000",
            "--op", "put", "--inflight", "8", "--seconds", "0.5", "--warmup", "0",
            "--timeout", "2"])
        assert status == 0, errors
        assert report["statuses"].get("OK", 0) <= 100, report["statuses"]
        assert report["busy"] > 0 and report["statuses"]["BUSY"] >= report["busy"]
        assert report["requests"] <= 100
        assert report["throughput"] <= 100 / 0.5
    finally:
        _stop_all(deployment)
