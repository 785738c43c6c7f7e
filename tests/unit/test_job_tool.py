"""python -m domus.ops.job, the job scripts' helper: addresses, free ports
and refusing to touch another job's deployment."""

import socket
import subprocess
import sys

import psutil
import pytest

from domus.ops import deploy, job


def test_ports_start_where_the_job_id_says_and_step_over_taken_ones():
    first = job.free_ports(3, seed=4242, host="127.0.0.1")
    assert job.free_ports(3, seed=4242, host="127.0.0.1") == first
    assert job.free_ports(3, seed=4243, host="127.0.0.1") != first
    taken = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    taken.bind(("127.0.0.1", first + 1))
    try:
        moved = job.free_ports(3, seed=4242, host="127.0.0.1")
    finally:
        taken.close()
    assert moved != first and first + 1 not in range(moved, moved + 3)


def test_jobs_started_side_by_side_search_for_their_ports_apart():
    """Each job's supervisor and each job's services search from a place of
    their own: a CI run had job 1's services start where job 2's supervisor
    did (seeds JOBID + 1 and JOBID), both found port 20194 free, and job 1's
    service could not listen.  Sixty jobs submitted together, each with
    services of up to 16 instances, start their searches further apart than
    the ports each takes, and the command line asks by role."""
    starts = sorted(job.search_start(seed, role, 16) for seed in range(1000, 1060)
                    for role in job.ROLES)
    assert all(later - earlier >= 16 for earlier, later in zip(starts, starts[1:])), starts
    picked = subprocess.run([sys.executable, "-m", "domus.ops.job", "ports", "4", "--seed",
                             "77", "--for", "services", "--host", "127.0.0.1"],
                            capture_output=True, text=True, check=True)
    assert int(picked.stdout) == job.free_ports(4, seed=77, host="127.0.0.1", role="services")
    assert int(picked.stdout) != job.free_ports(4, seed=78, host="127.0.0.1")


def test_the_kernels_ephemeral_ports_are_read_from_its_setting(tmp_path, monkeypatch):
    setting = tmp_path / "ip_local_port_range"
    setting.write_text("15000\t16999\n")
    monkeypatch.setattr(deploy, "EPHEMERAL_RANGE_FILE", str(setting))
    assert deploy.ephemeral_ports() == range(15000, 17000)
    setting.write_text("garbage")
    assert deploy.ephemeral_ports() == range(32768, 61000)     # (Linux's default)
    monkeypatch.setattr(deploy, "EPHEMERAL_RANGE_FILE", str(tmp_path / "none"))
    assert deploy.ephemeral_ports() == range(32768, 61000)


def test_no_port_is_chosen_where_a_clients_socket_may_take_it(tmp_path, monkeypatch):
    """A port among the kernel's ephemeral ones, free when chosen, can be
    given to any client's socket before the service binds it: jobs and
    local deployments choose theirs elsewhere, unless nowhere else is left."""
    setting = tmp_path / "ip_local_port_range"
    monkeypatch.setattr(deploy, "EPHEMERAL_RANGE_FILE", str(setting))
    setting.write_text(f"{job.FIRST_PORT + 100} 65000\n")
    for seed in range(0, 4000, 37):
        base = job.free_ports(4, seed=seed, host="127.0.0.1")
        assert job.FIRST_PORT <= base and base + 4 <= job.FIRST_PORT + 100, (seed, base)
    setting.write_text(f"1024 {deploy.LOCAL_FIRST_PORT + 500}\n")
    for _ in range(50):
        base = deploy.free_port_block(3)
        assert deploy.LOCAL_FIRST_PORT + 500 < base < deploy.LOCAL_LAST_PORT - 2, base
    setting.write_text("1024 65535\n")          # (every port is ephemeral: any will do)
    base = job.free_ports(2, seed=7, host="127.0.0.1")
    assert job.FIRST_PORT <= base < job.LAST_PORT


def test_address_by_interface_and_by_network():
    assert job.address(interface="lo") == "127.0.0.1"
    assert job.address(network="127.0.0.0/8") == "127.0.0.1"
    mine = {entry.address for entries in psutil.net_if_addrs().values() for entry in entries}
    absent = next(f"198.51.{n}.0/24" for n in range(100, 200)
                  if not any(a.startswith(f"198.51.{n}.") for a in mine))
    with pytest.raises(SystemExit, match=f"no address of this node is in {absent}"):
        job.address(network=absent)
    with pytest.raises(SystemExit, match="interface 'nonesuch0' has no IPv4 address"):
        job.address(interface="nonesuch0")


def test_wait_and_shutdown_with_no_supervisor_fail_clearly(monkeypatch, tmp_path):
    port = job.free_ports(1, seed=1, host="127.0.0.1")
    env = {"DOMUS_SUPERVISOR": f"127.0.0.1:{port}", "DOMUS_SECRET_FILE": str(tmp_path / "s"),
           "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-m", "domus", "secret", "new", env["DOMUS_SECRET_FILE"]],
                   check=True, capture_output=True)
    waited = subprocess.run([sys.executable, "-m", "domus.ops.job", "wait", "--job-id", "9",
                             "--services", "1", "--timeout", "1"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert waited.returncode == 4 and "timed out after 1s" in waited.stderr
    stopped = subprocess.run([sys.executable, "-m", "domus.ops.job", "shutdown", "--job-id",
                              "9"], env=env, capture_output=True, text=True, timeout=60)
    assert stopped.returncode == 3 and "nothing to shut down" in stopped.stderr


def test_another_jobs_supervisor_is_left_alone(tmp_path, monkeypatch):
    from domus.ops.deploy import LocalDeployment, free_port_block
    from domus.wire import secret

    # (its secret made first, as the job scripts do: the supervisor takes it)
    secret.create(str(tmp_path / "domus-job-111" / "supervisor" / "secret"))
    with LocalDeployment(0, port=free_port_block(1),
                         data_dir=str(tmp_path / "domus-job-111")) as other:
        env = {"DOMUS_SUPERVISOR": other.supervisor_address,
               "DOMUS_SECRET_FILE": other.secret_file, "PATH": "/usr/bin:/bin"}
        # even holding its secret, job 222 does not stop job 111's deployment
        stopped = subprocess.run([sys.executable, "-m", "domus.ops.job", "shutdown",
                                  "--job-id", "222"], env=env, capture_output=True, text=True,
                                 timeout=60)
        assert stopped.returncode != 0 and "is not job 222's" in stopped.stderr
        with other.connect() as cluster:
            assert cluster.ping()
        waited = subprocess.run([sys.executable, "-m", "domus.ops.job", "wait", "--job-id",
                                 "111", "--services", "0", "--timeout", "30"], env=env,
                                capture_output=True, text=True, timeout=60)
        assert waited.returncode == 0, waited.stderr
