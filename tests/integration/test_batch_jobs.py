"""The job scripts under real workload managers: clients/slurm/ against a
single-node Slurm (munged, slurmctld and slurmd started here, as root, by
PID), clients/pbs/ in a fabricated PBS environment (PBS_NODEFILE,
PBS_JOBID, a pbsdsh stand-in that runs one command per listed node, no
job environment passed on).  Each checks the job's output, its exit
status, and that no process, port, data dir or secret is left behind."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from domus.ops.deploy import free_port_block, port_is_free

from .support import wait_until

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent        # (the venv's bin: its domus and python)
SBATCH = ROOT / "clients" / "slurm" / "domus-job.sbatch"
PBS = ROOT / "clients" / "pbs" / "domus-job.pbs"
FAKE_PBS = Path(__file__).with_name("fake_pbs")
NODE = socket.gethostname()

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="starts slurmctld, slurmd and "
                               "munged itself, which needs root")


def _need(*tools: str) -> None:
    missing = [tool for tool in tools if shutil.which(tool) is None
               and not Path("/usr/sbin", tool).exists()]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: `make` installs them (slurm-wlm, munge)")


def leftovers(job: str) -> list[str]:
    """Processes whose command line names the job's data dir or secret."""
    marker = f"domus-job-{job}"
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if marker in cmdline or f"/jobs/{job}/" in cmdline:
            found.append(f"{process.pid}: {cmdline}")
    return found


def ports_of(output: str) -> list[int]:
    return [int(port) for port in re.findall(r"127\.0\.0\.1:(\d+)", output)]


def assert_clean(job: str, output: str, home: Path, scratch: Path) -> None:
    assert not leftovers(job)
    ports = ports_of(output)
    assert ports, output
    assert all(port_is_free("127.0.0.1", port) for port in ports), ports
    assert not list(scratch.glob(f"domus-job-{job}*"))      # (mktemp's domus-job-JOB.XXXXXXXX)
    assert not (home / ".domus" / "jobs" / job).exists()


# ------------------------------------------------------------------- Slurm
class Slurm:
    """munged, slurmctld and slurmd for one node (this one), in ``base``."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.processes: list[subprocess.Popen] = []
        self.conf = base / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    def start(self) -> Slurm:
        base = self.base
        for name in ("state", "spool", "munge"):
            (base / name).mkdir(mode=0o700)
        (base / "munge").chmod(0o711)
        key = base / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        socket_path = base / "munge" / "munge.sock"
        self._spawn(["munged", "-F", "--force", f"--socket={socket_path}", f"--key-file={key}",
                     f"--log-file={base / 'munged.log'}",
                     f"--pid-file={base / 'munge' / 'munged.pid'}",
                     f"--seed-file={base / 'munge' / 'seed'}"])
        wait_until(socket_path.exists, timeout=20, what="munged's socket")
        ports = free_port_block(2)
        self.conf.write_text(f"""\
ClusterName=domustest
SlurmctldHost={NODE}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ports}
SlurmdPort={ports + 1}
AuthType=auth/munge
AuthInfo=socket={socket_path}
CredType=cred/munge
StateSaveLocation={base / 'state'}
SlurmdSpoolDir={base / 'spool'}
SlurmctldPidFile={base / 'slurmctld.pid'}
SlurmdPidFile={base / 'slurmd.pid'}
SlurmctldLogFile={base / 'slurmctld.log'}
SlurmdLogFile={base / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
KillWait=10
MinJobAge=600
InactiveLimit=0
NodeName={NODE} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        self._spawn(["slurmctld", "-D", "-i"])
        self._spawn(["slurmd", "-D", "-N", NODE])
        wait_until(lambda: "idle" in self.run("sinfo", "-h", "-o", "%t").stdout, timeout=60,
                   what="the Slurm node to be idle")
        return self

    def _spawn(self, argv: list[str]) -> None:
        log = open(self.base / f"{argv[0]}.out", "ab")  # noqa: SIM115
        self.processes.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                               env=self.env, cwd=self.base))
        log.close()

    def run(self, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60,
                              env=env or self.env, cwd=ROOT)

    def submit(self, *argv: str, env: dict[str, str]) -> str:
        done = self.run("sbatch", "--parsable", *argv, env=env)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().split(";")[0]

    def job(self, job: str) -> dict[str, str]:
        line = self.run("scontrol", "show", "job", job, "-o").stdout
        return dict(field.split("=", 1) for field in line.split() if "=" in field)

    def finished(self, job: str) -> dict[str, str] | None:
        info = self.job(job)
        return info if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED",
                                                "TIMEOUT", "NODE_FAIL") else None

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in reversed(self.processes):
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    if os.geteuid() != 0:
        pytest.skip("starts slurmctld, slurmd and munged itself, which needs root")
    _need("munged", "slurmctld", "slurmd", "sbatch")
    base = tmp_path_factory.mktemp("slurm")
    base.chmod(0o755)
    cluster = Slurm(base)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def job_env(slurm: Slurm, home: Path, scratch: Path) -> dict[str, str]:
    """What a user's shell would have: the venv on PATH (the script finds
    its python through `domus`), HOME, and the interface to use."""
    env = {key: value for key, value in slurm.env.items()
           if not key.startswith(("DOMUS_", "SLURM_")) or key == "SLURM_CONF"}
    return dict(env, PATH=f"{VENV_BIN}:{env['PATH']}", HOME=str(home),
                DOMUS_INTERFACE="lo", TMPDIR=str(scratch))


@root_only
def test_slurm_jobs_run_side_by_side_fail_honestly_and_leave_nothing(slurm, tmp_path):
    home, scratch, logs = tmp_path / "home", tmp_path / "scratch", tmp_path / "logs"
    for directory in (home, scratch, logs):
        directory.mkdir()
    env = job_env(slurm, home, scratch)
    out = str(logs / "job-%j.out")
    mine = ("bash", "-c", '"$DOMUS_PYTHON" clients/example_job.py --items 3000 --dht mine && '
            '"$DOMUS_PYTHON" clients/example_job.py --items 3000 --dht mine --collect')
    # all at once: the example (2 tasks on 1 node, the layout that once put
    # two services on the node), two small jobs sharing the node, a failing
    # one, and one cancelled while it works
    example = slurm.submit("-N1", "--ntasks-per-node=2", "-o", out, str(SBATCH), env=env)
    twins = [slurm.submit("-N1", "--ntasks=1", "-o", out, str(SBATCH), *mine, env=env)
             for _ in range(2)]
    failing = slurm.submit("-N1", "--ntasks=1", "-o", out, str(SBATCH), "bash", "-c", "exit 7",
                           env=env)
    cancelled = slurm.submit("-N1", "--ntasks=1", "-o", out, str(SBATCH), "sleep", "300",
                             env=env)
    output = lambda job: (logs / f"job-{job}.out").read_text() \
        if (logs / f"job-{job}.out").exists() else ""  # noqa: E731
    wait_until(lambda: "1 services up" in output(cancelled), timeout=120,
               what="the job to be cancelled to be working")
    assert slurm.run("scancel", cancelled).returncode == 0
    jobs = [example, *twins, failing, cancelled]
    states = {job: wait_until(lambda job=job: slurm.finished(job), timeout=180,
                              what=f"job {job} to end") for job in jobs}
    texts = {job: output(job) for job in jobs}

    assert states[example]["ExitCode"] == "0:0", texts[example]
    assert "100,000 results, 0 missing" in texts[example]
    assert texts[example].count("services up: ") == 2      # (the supervisor, then 1 service)
    assert "1 services up" in texts[example]               # one service, two tasks
    assert "Address already in use" not in texts[example]
    supervisors = set()
    for job in twins:
        assert states[job]["ExitCode"] == "0:0", texts[job]
        assert "3,000 results, 0 missing" in texts[job]
        supervisors.add(re.search(r"supervisor at (\S+);", texts[job]).group(1))
    assert len(supervisors) == 2                           # each its own deployment
    assert states[failing]["ExitCode"] == "7:0", texts[failing]
    assert "exit status 7" in texts[failing]
    assert states[cancelled]["JobState"] == "CANCELLED"
    for job in jobs:
        assert "stopped 1 services and the supervisor" in texts[job] or job == cancelled
        wait_until(lambda job=job: not leftovers(job), timeout=30,
                   what=f"job {job}'s processes to end")
        if job == cancelled and "signalled: shutting down" not in texts[job]:
            # (now and then slurmstepd ends a cancelled batch shell before
            # its trap runs: Slurm's SIGTERM still stopped every process,
            # the services flushing as they stop, but its data dir stays
            # for the node's scratch clean-up)
            assert not ports_of(texts[job]) or all(
                port_is_free("127.0.0.1", port) for port in ports_of(texts[job]))
            continue
        assert_clean(job, texts[job], home, scratch)


@root_only
def test_slurm_job_without_domus_says_what_it_needs(slurm, tmp_path):
    (tmp_path / "home").mkdir()
    env = dict(job_env(slurm, tmp_path / "home", tmp_path), PATH="/usr/bin:/bin",
               DOMUS_PYTHON="/usr/bin/python3")
    job = slurm.submit("-N1", "--ntasks=1", "-o", str(tmp_path / "out"), str(SBATCH), env=env)
    state = wait_until(lambda: slurm.finished(job), timeout=60, what="the job to end")
    text = (tmp_path / "out").read_text()
    assert state["ExitCode"] == "2:0"
    assert "no Python with domus here (/usr/bin/python3): set DOMUS_PYTHON" in text


# ------------------------------------------------------------------- PBS
def run_pbs(tmp_path: Path, work: str | None = None, slots: int = 2,
            job: str = "4242.head.example") -> subprocess.Popen:
    nodefile = tmp_path / "nodefile"
    nodefile.write_text(f"{NODE}\n" * slots)
    (tmp_path / "home").mkdir(exist_ok=True)
    (tmp_path / "scratch").mkdir(exist_ok=True)
    # qsub without -V: only PBS's own variables, and the submitter's PATH in
    # PBS_O_PATH (the venv on it); -v DOMUS_INTERFACE=lo
    env = {"HOME": str(tmp_path / "home"), "PATH": f"{FAKE_PBS}:/usr/bin:/bin",
           "PBS_O_PATH": f"{VENV_BIN}:/usr/bin:/bin", "PBS_JOBID": job,
           "PBS_NODEFILE": str(nodefile), "PBS_O_WORKDIR": str(ROOT),
           "TMPDIR": str(tmp_path / "scratch"), "DOMUS_INTERFACE": "lo"}
    if work:
        env["DOMUS_WORK"] = work
    return subprocess.Popen(["bash", str(PBS)], cwd="/", env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_pbs_job_spreads_tasks_shuts_down_its_services_and_leaves_nothing(tmp_path):
    job = run_pbs(tmp_path)
    output, _ = job.communicate(timeout=240)
    assert job.returncode == 0, output
    assert "100,000 results, 0 missing" in output
    assert "task 0: stored 50,000" in output and "task 1: stored 50,000" in output
    assert "stopped 1 services and the supervisor of job 4242" in output
    assert_clean("4242", output, tmp_path / "home", tmp_path / "scratch")


def test_pbs_job_exit_status_is_a_failing_task_s_and_qdel_cleans_up(tmp_path):
    failing = run_pbs(tmp_path / "failing", work="bash -c 'exit $((DOMUS_TASK_ID * 5))'",
                      job="77.head") if (tmp_path / "failing").mkdir() is None else None
    output, _ = failing.communicate(timeout=240)
    assert failing.returncode == 5, output             # task 1's, though task 0 succeeded
    assert_clean("77", output, tmp_path / "failing" / "home",
                 tmp_path / "failing" / "scratch")
    (tmp_path / "deleted").mkdir()
    deleted = run_pbs(tmp_path / "deleted", work="sleep 300", job="78.head")
    seen = ""
    deadline = time.monotonic() + 120
    while "1 services up: " not in seen:
        line = deleted.stdout.readline()
        assert line and time.monotonic() < deadline, seen
        seen += line
    deleted.send_signal(signal.SIGTERM)                 # what qdel does to the job script
    rest, _ = deleted.communicate(timeout=120)
    assert deleted.returncode == 143, seen + rest
    assert "signalled: shutting down" in rest
    assert "stopped 1 services and the supervisor of job 78" in rest
    assert_clean("78", seen + rest, tmp_path / "deleted" / "home",
                 tmp_path / "deleted" / "scratch")
