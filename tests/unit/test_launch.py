"""domus.wire.launch (launch records: validated fields, never a command
line) and domus.ops.launch (rebuilding the command and starting it here or
through a launcher): real processes, a real shell."""

import os
import socket
import stat
import sys
import time

import pytest

from domus.ops import launch
from domus.wire import launch as launch_record

SUPERVISOR = "127.0.0.1:9"      # (nothing answers there: the service keeps retrying)


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def service_record(tmp_path, host=None, env=None, data_dir=None):
    record = launch_record.record(
        "service", f"127.0.0.1:{free_port()}", str(data_dir or tmp_path / "svc"),
        [["--heartbeat", 0.5], ["--ram", 2**30], ["--cpus", "0"], ["--disk-reserve", "5%"],
         ["--host", "node-a"]],
        name="s1", supervisor=SUPERVISOR)
    record["env"] = env if env is not None else {"DOMUS_MARK": "a b'c"}
    if host is not None:
        record["host"] = host
    return launch_record.validate(record)


def fake_domus(tmp_path):
    """A `domus` on PATH that writes its arguments, cwd, environment mark and
    whether it leads its own session to a file, then exits: what a remote
    host's `domus` would be given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    out = tmp_path / "ran"
    script = bin_dir / "domus"
    script.write_text(f"#!{sys.executable}\n"
                      "import os, sys\n"
                      f"open({str(out)!r}, 'w').write(repr((sys.argv[1:], os.getcwd(), "
                      "os.environ.get('DOMUS_MARK'), os.getsid(0) == os.getpid())))\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return bin_dir, out


def wait_for(path, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.stat().st_size):
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.02)
    return path.read_text()


def test_a_record_holds_validated_fields_and_rebuilds_the_domus_command(tmp_path, monkeypatch):
    for name in [name for name in os.environ if name.startswith("DOMUS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("DOMUS_LOG_LEVEL", "debug")
    monkeypatch.setenv("UNRELATED", "x")
    record = launch_record.record("supervisor", "127.0.0.1:7700", str(tmp_path),
                                  [["--down-after", 2.0], ["--insecure", None]])
    assert record["host"] == socket.gethostname()
    assert record["env"] == {"DOMUS_LOG_LEVEL": "debug"}
    assert "python" not in record and "arguments" not in record
    assert launch.is_local(record)
    assert launch.command(record) == [
        sys.executable, "-m", "domus", "supervisor", "--listen", "127.0.0.1:7700",
        "--data-dir", str(tmp_path), "--down-after", "2.0", "--insecure"]
    # Elsewhere: that host's `domus`, never a Python path from the record.
    assert launch.command(record, local=False)[:2] == ["domus", "supervisor"]


@pytest.mark.parametrize("change, problem", [
    ({"python": "/bin/sh", "arguments": ["-c", "id > /tmp/x"]}, "command line"),
    ({"format": 1}, "command line"),
    ({"role": "shell"}, "role"),
    ({"host": "-oProxyCommand=touch /tmp/x"}, "host"),
    ({"host": "node1;id"}, "host"),
    ({"address": "127.0.0.1:7701 -c"}, "address"),
    ({"data_dir": "relative/dir"}, "data dir"),
    ({"data_dir": "/home/../etc"}, "data dir"),
    ({"data_dir": "/tmp/x\nid"}, "data dir"),
    ({"name": "s1 --cpus 0"}, "service name"),
    ({"name": "../../x"}, "service name"),
    ({"supervisor": "$(id):7700"}, "host"),
    ({"env": {"LD_PRELOAD": "/tmp/evil.so"}}, "LD_PRELOAD"),
    ({"env": {"DOMUS_X=1 PATH": "x"}}, "refused"),
    ({"env": {"DOMUS_X": "a\nb"}}, "value"),
    ({"options": [["-c", "import os"]]}, "refused"),
    ({"options": [["--heartbeat", "1; id"]]}, "not a number"),
    ({"options": [["--ram", float("nan")]]}, "whole number"),
    ({"options": [["--cores", float("inf")]]}, "out of range"),
    ({"options": [["--cores", -1]]}, "out of range"),
    ({"options": [["--secret-file", "key"]]}, "absolute"),
    ({"options": [["--cpus", "0;id"]]}, "CPU list"),
    ({"options": [["--disk-reserve", "1G; id"]]}, "neither a size"),
    ({"options": [["--host", "-oProxyCommand=id"]]}, "host"),
    ({"options": [["--heartbeat", 1], ["--heartbeat", 2]]}, "once each"),
])
def test_a_record_that_is_not_valid_is_refused_naming_the_problem(tmp_path, change, problem):
    record = {**service_record(tmp_path), **change}
    with pytest.raises(ValueError, match=problem):
        launch_record.validate(record)
    with pytest.raises(ValueError):
        launch.start(record)                  # (start checks again)


def test_a_local_process_starts_detached_as_a_domus_service_with_its_environment(tmp_path):
    record = service_record(tmp_path)
    said = []
    process = launch.start(record, report=said.append)
    try:
        # (the kernel shows an empty command line until the exec is done)
        deadline = time.monotonic() + 10
        while not (raw := open(f"/proc/{process.pid}/cmdline", "rb").read()):
            assert time.monotonic() < deadline, "the process never showed a command line"
            time.sleep(0.01)
        cmdline = raw.decode().rstrip("\0").split("\0")
        assert cmdline == launch.command(record)
        assert cmdline[:4] == [sys.executable, "-m", "domus", "service"]
        environ = open(f"/proc/{process.pid}/environ", "rb").read().split(b"\0")
        assert b"DOMUS_MARK=a b'c" in environ
        # Its own session: a Ctrl-C or hang-up of the terminal does not reach it.
        assert os.getsid(process.pid) == process.pid
        assert said and said[0].startswith("running: ") and "domus service" in said[0]
    finally:
        process.kill()
        process.wait(10)
    assert os.path.exists(launch_record.log_file(record))


def test_a_remote_process_without_a_launcher_is_refused_with_the_command(tmp_path):
    record = service_record(tmp_path, host="node-elsewhere")
    with pytest.raises(ValueError, match="node-elsewhere.*--launcher") as refused:
        launch.start(record)
    assert launch.command_line(record) in str(refused.value)


def test_a_launcher_runs_the_quoted_command_line_on_the_host(tmp_path, monkeypatch):
    bin_dir, out = fake_domus(tmp_path)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    data_dir = tmp_path / "it's two words; id"
    record = service_record(tmp_path, host="node-elsewhere", data_dir=data_dir)
    # A "launcher" that runs the command here through a shell, as ssh would
    # on the host; {host} is filled in.
    marker = tmp_path / "host"
    said = []
    assert launch.start(record, f"sh -c 'echo {{host}} > {marker}; eval \"$0\"'",
                        report=said.append) is None
    arguments, cwd, mark, own_session = eval(wait_for(out))
    assert arguments == launch_record.arguments(record)
    assert arguments[arguments.index("--data-dir") + 1] == str(data_dir)
    assert (cwd, mark, own_session) == (str(data_dir), "a b'c", True)
    assert marker.read_text().strip() == "node-elsewhere"
    assert len(said) == 1 and said[0].startswith("running: sh -c ")
    assert "nohup setsid domus service" in said[0]


def test_a_host_is_one_quoted_word_of_the_launcher_or_refused():
    assert launch.launcher_argv("ssh {host}", "node-7.cluster") == ["ssh", "node-7.cluster"]
    assert launch.launcher_argv("ssh {host}", "fe80::1") == ["ssh", "fe80::1"]
    for host in ("-oProxyCommand=touch /tmp/x", "a b", "node;id", "$(id)", "", "x" * 300):
        with pytest.raises(ValueError, match="host"):
            launch.launcher_argv("ssh {host}", host)


def test_environment_keys_and_values_are_quoted_in_the_remote_command(tmp_path):
    record = service_record(tmp_path, env={"DOMUS_A": "$(id) `id` ;id"})
    line = launch.command_line(record)
    assert "DOMUS_A='$(id) `id` ;id'" in line


def test_a_services_bounds_are_in_its_record_and_its_restart_keeps_them(tmp_path):
    from domus.ops.cli import build_parser
    from domus.service.limits import Limits, from_options, limit_options

    bounds = Limits(shed_after=0.2, reply_cache_entries=1_000, max_connections=64,
                    input_budget=1 << 20, udp_reply_factor=0)
    assert limit_options(Limits()) == []                # (defaults are not written down)
    record = launch_record.validate(launch_record.record(
        "service", f"127.0.0.1:{free_port()}", str(tmp_path / "svc"),
        [["--heartbeat", 0.5], *limit_options(bounds)], name="s1", supervisor=SUPERVISOR))
    command = launch.command(record)
    assert command[:4] == [sys.executable, "-m", "domus", "service"]
    assert from_options(build_parser().parse_args(command[3:])) == bounds
    with pytest.raises(ValueError, match="--reply-cache-entries"):
        launch_record.validate(dict(record, options=[["--reply-cache-entries", 1]]))
    # Whatever `domus service` takes, its record takes too (a service must
    # not fail to start on its own launch record).
    largest = from_options(build_parser().parse_args(
        ["service", "--listen", "127.0.0.1:7701", "--data-dir", str(tmp_path),
         "--max-connections", "1000000", "--max-connections-per-host", "1000000",
         "--input-budget", str(2 ** 62), "--max-scans", "100000000",
         "--max-scan-keys", str(2 ** 40), "--udp-reply-factor", "65507",
         "--shed-after", "3600", "--reply-cache-entries", str(2 ** 32)]))
    launch_record.validate(dict(record, options=limit_options(largest)))
