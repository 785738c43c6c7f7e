"""Fixtures for the integration tests.

``deployment`` starts a real supervisor and three real services (separate
processes, 127.0.0.1 only) in a fresh data dir; ``cluster`` is a client
connected to it.  Teardown always stops every process the test started,
including ones it restarted, whether the test passed or not; when a test
fails, the tail of each process's log is printed with the failure.

``shared_deployment`` is one such deployment for a whole test module, for
tests that stop no process and change nothing outside DHTs of their own:
``shared_cluster`` is a client of it that destroys, after the test, every
DHT the test created, so each test finds the deployment as the module's
first one did.  (Under pytest-xdist each worker has its own.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import domus
from domus.errors import DomusError
from domus.ops.deploy import LocalDeployment, free_port_block
from domus.wire import secret

from .clients import LoopThread, SyncAioCluster
from .support import (
    CLIENT_TIMEOUT,
    DOWN_AFTER,
    HEARTBEAT,
    PUSH_TIMEOUT,
    service_addresses,
    service_stats,
    wait_until,
)

START_TIMEOUT = 30.0     # generous: other work shares this 2-core machine
START_ATTEMPTS = 3       # a port block may be taken between the check and the bind
LOG_TAIL = 40            # lines of each process log shown when a test fails
SERVICES = 3


class TrackedDeployment(LocalDeployment):
    """A LocalDeployment that remembers every process it ever spawned, so
    that teardown can stop even those a test restarted or replaced."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.spawned: list[subprocess.Popen] = []

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        process = super()._spawn(name, argv)
        self.spawned.append(process)
        return process

    def spawn_service(self, name: str, address: str, *, log_as: str | None = None,
                      heartbeat: float | None = None,
                      extra: tuple[str, ...] = ()) -> subprocess.Popen:
        """Start one more service process (not tracked in ``services``) named
        ``name`` on ``address`` (``extra``: more of its arguments); it logs
        to ``<log_as>.log``."""
        return self._spawn(log_as or name, [
            "service", "--name", name, "--supervisor", self.supervisor_address,
            "--listen", address, "--data-dir", os.path.join(self.data_dir, log_as or name),
            "--heartbeat", str(heartbeat or self.heartbeat), *extra])

    def service_index(self, name: str) -> int:
        return [self.service_name(i) for i in range(self.service_count)].index(name)

    def stop_everything(self) -> None:
        # A test may leave a process SIGSTOPped; SIGTERM would wait forever.
        for process in self.spawned:
            if process.poll() is None:
                try:
                    os.kill(process.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        try:
            self.stop()
        finally:
            for process in self.spawned:
                if process.poll() is None:
                    process.kill()
                    process.wait(10)

    def log_tails(self, lines: int = LOG_TAIL) -> str:
        parts = []
        for path in sorted(Path(self.data_dir, "logs").glob("*.log")):
            text = path.read_text(encoding="utf-8", errors="replace").splitlines()
            parts.append(f"----- {path.name} (last {lines} lines) -----")
            parts.extend(text[-lines:])
        return "\n".join(parts)


def start_deployment(data_dir: Path, services: int = SERVICES,
                     supervisor_args: tuple[str, ...] = ("--balance", "manual"),
                     service_args: tuple[str, ...] = (), insecure: bool = False,
                     metrics: bool = False) -> TrackedDeployment:
    """Start a deployment on a free block of ports, trying another block if
    something grabbed this one before our processes bound it.  Its balancer
    is manual unless asked otherwise: a test's buckets stay where it put
    them.  With ``metrics``, each process serves /metrics on a port of the
    block too (``metrics_address``).  Its secret goes into
    $DOMUS_SECRET_FILE, as a job of it would have it (domus.connect, the
    domus command, raw requests and subprocesses find it there), until the
    test ends (_secret_of_the_test)."""
    for attempt in range(1, START_ATTEMPTS + 1):
        port = free_port_block((services + 1) * (2 if metrics else 1))
        deployment = TrackedDeployment(
            services, port=port, heartbeat=HEARTBEAT, data_dir=str(data_dir / f"run{attempt}"),
            supervisor_args=["--down-after", str(DOWN_AFTER), "--push-timeout", str(PUSH_TIMEOUT),
                             *supervisor_args],
            service_args=list(service_args), insecure=insecure,
            metrics_port=port + services + 1 if metrics else None)
        try:
            deployment.start(timeout=START_TIMEOUT)
            if deployment.secret_file is not None:
                os.environ[secret.ENVIRONMENT] = deployment.secret_file
            return deployment
        except DomusError:
            deployment.stop_everything()
            if attempt == START_ATTEMPTS:
                print(deployment.log_tails())
                raise
        except BaseException:
            deployment.stop_everything()
            raise
    raise AssertionError("unreachable")


@pytest.fixture(autouse=True)
def _secret_of_the_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """$DOMUS_SECRET_FILE as it is now (a module's shared deployment's, or
    none) comes back after each test, whichever deployment it started."""
    current = os.environ.get(secret.ENVIRONMENT)
    if current is None:
        monkeypatch.delenv(secret.ENVIRONMENT, raising=False)
    else:
        monkeypatch.setenv(secret.ENVIRONMENT, current)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator:
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture
def deployment(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TrackedDeployment]:
    started = start_deployment(tmp_path)
    try:
        yield started
    finally:
        _stop_all(started, request)


def _stop_all(started: TrackedDeployment, request: pytest.FixtureRequest | None = None) -> None:
    """Stop every process the deployment spawned (a failed test's logs
    printed first) and check that none survived."""
    started.stop_everything()
    if request is not None:
        _print_logs_if_failed(request, started)
    leftovers = [process.pid for process in started.spawned if process.poll() is None]
    assert not leftovers, f"processes survived teardown: {leftovers}"


def _print_logs_if_failed(request: pytest.FixtureRequest, deployment: TrackedDeployment) -> None:
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        print(deployment.log_tails())


@contextlib.contextmanager
def own_secret_variable() -> Iterator[None]:
    """$DOMUS_SECRET_FILE unset for what runs inside (a deployment started
    there sets its own), and back as it was afterwards, set or not: a
    module's deployment must not leave its secret to the tests of other
    modules that run next in the same process (a unit test's client would
    then ask a fake insecure supervisor for a handshake)."""
    saved = os.environ.pop(secret.ENVIRONMENT, None)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(secret.ENVIRONMENT, None)
        else:
            os.environ[secret.ENVIRONMENT] = saved


@pytest.fixture(scope="module")
def shared_deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrackedDeployment]:
    with own_secret_variable():
        started = start_deployment(tmp_path_factory.mktemp("shared"))
        try:
            yield started
        finally:
            _stop_all(started)


@pytest.fixture(scope="module")
def shared_client(shared_deployment: TrackedDeployment) -> Iterator[domus.Cluster]:
    with domus.connect(shared_deployment.supervisor_address,
                       timeout=CLIENT_TIMEOUT) as connected:
        yield connected


@contextlib.contextmanager
def aio_cluster(address: str) -> Iterator[SyncAioCluster]:
    """The asyncio client connected to ``address`` on a loop thread of its
    own, behind the blocking client's interface; closed, with its loop,
    afterwards."""
    bridge = LoopThread()
    try:
        cluster = SyncAioCluster.connect(bridge, address, timeout=CLIENT_TIMEOUT)
        try:
            yield cluster
        finally:
            cluster.close()
    finally:
        bridge.close()


@pytest.fixture(scope="module")
def shared_aio_client(shared_deployment: TrackedDeployment) -> Iterator[SyncAioCluster]:
    """The asyncio client on the module's shared deployment, behind the
    blocking client's interface (tests/integration/clients.py)."""
    with aio_cluster(shared_deployment.supervisor_address) as cluster:
        yield cluster


@pytest.fixture
def shared_cluster(request: pytest.FixtureRequest, shared_deployment: TrackedDeployment,
                   shared_client: domus.Cluster) -> Iterator[domus.Cluster]:
    dead = [name for name, process in shared_deployment.services.items()
            if process.poll() is not None]
    assert not dead, f"an earlier test of this module stopped {dead} of the shared deployment"
    before = {dht["name"] for dht in shared_client.list_dhts()}
    try:
        yield shared_client
    finally:
        _print_logs_if_failed(request, shared_deployment)
        created = {dht["name"] for dht in shared_client.list_dhts()} - before
        for name in created:
            shared_client.destroy_dht(name)
        # Services drop a destroyed DHT soon after; the next test may reuse
        # its name, so wait until none hosts it any more.
        for service, address in service_addresses(shared_client).items():
            wait_until(lambda address=address: not created & set(service_stats(address)["dhts"]),
                       timeout=15, what=f"{service} to drop {sorted(created)}")


CLIENTS = ["blocking", "asyncio"]


@pytest.fixture(params=CLIENTS)
def any_cluster(request: pytest.FixtureRequest, shared_deployment: TrackedDeployment,
                shared_cluster: domus.Cluster) -> Iterator[Any]:
    """``shared_cluster``, then the asyncio client (domus.aio) on the same
    deployment behind the blocking client's interface (tests/integration/
    clients.py): a test written for the blocking client runs against both.
    DHTs it creates are destroyed after it, as ``shared_cluster``'s."""
    if request.param == "blocking":
        yield shared_cluster
        return
    with aio_cluster(shared_deployment.supervisor_address) as cluster:
        yield cluster


@pytest.fixture
def cluster(deployment: TrackedDeployment) -> Iterator[domus.Cluster]:
    with domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as connected:
        yield connected
