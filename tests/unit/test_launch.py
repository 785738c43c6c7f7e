"""domus.ops.launch: launch records, and starting a recorded process here or
through a launcher (real processes, a real shell)."""

import os
import socket
import sys
import time

import pytest

from domus.ops import launch
from domus.wire import launch as launch_record


def harmless(tmp_path, host=None, env=None):
    """A launch record whose "process" writes its arguments, cwd and
    environment to a file, then exits."""
    out = tmp_path / "ran"
    script = ("import os, sys; open(sys.argv[1], 'w').write(repr((sys.argv[2:], os.getcwd(), "
              "os.environ.get('DOMUS_MARK'), os.getsid(0) == os.getpid())))")
    record = launch_record.record("service", "127.0.0.1:1", [], str(tmp_path))
    record.update(arguments=["-c", script, str(out), "it's", "two words"],
                  cwd=str(tmp_path), env=env or {"DOMUS_MARK": "a b'c"})
    if host is not None:
        record["host"] = host
    return record, out


def wait_for(path, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.stat().st_size):
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.02)
    return path.read_text()


def test_a_record_says_how_to_start_this_process_again(tmp_path, monkeypatch):
    for name in [name for name in os.environ if name.startswith("DOMUS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("DOMUS_LOG_LEVEL", "debug")
    monkeypatch.setenv("UNRELATED", "x")
    record = launch_record.record("supervisor", "127.0.0.1:7700",
                           ["supervisor", "--listen", "127.0.0.1:7700"], str(tmp_path))
    assert record["host"] == socket.gethostname()
    assert record["python"] == sys.executable
    assert record["arguments"] == ["-m", "domus", "supervisor", "--listen", "127.0.0.1:7700"]
    assert record["env"] == {"DOMUS_LOG_LEVEL": "debug"}
    assert record["log"] == os.path.join(str(tmp_path), "supervisor.log")
    assert launch.is_local(record)


def test_a_local_process_starts_detached_with_its_cwd_and_environment(tmp_path):
    record, out = harmless(tmp_path)
    process = launch.start(record)
    assert process.wait(10) == 0
    # Its own session: a Ctrl-C or hang-up of the terminal does not reach it.
    assert wait_for(out) == repr((["it's", "two words"], str(tmp_path), "a b'c", True))


def test_a_remote_process_without_a_launcher_is_refused_with_the_command(tmp_path):
    record, _out = harmless(tmp_path, host="node-elsewhere")
    with pytest.raises(ValueError, match="node-elsewhere.*--launcher") as refused:
        launch.start(record)
    assert launch.command_line(record) in str(refused.value)


def test_a_launcher_runs_the_quoted_command_line_on_the_host(tmp_path):
    record, out = harmless(tmp_path, host="node-elsewhere")
    # A "launcher" that runs the command here through a shell, as ssh would
    # on the host; {host} is filled in.
    marker = tmp_path / "host"
    assert launch.start(record, f"sh -c 'echo {{host}} > {marker}; eval \"$0\"'") is None
    assert wait_for(out) == repr((["it's", "two words"], str(tmp_path), "a b'c", True))
    assert marker.read_text().strip() == "node-elsewhere"
    assert os.path.exists(record["log"])          # output went to the log
