"""The launch record: how a process of the deployment is started again.

Every supervisor and service makes its own when it starts and the supervisor
keeps them in its state file (a service sends its record in ``register``).
A record holds *validated fields only*, never a command line: the role, the
host it runs on, its listen address and data dir, for a service its name and
supervisor, the options it was started with (each from a fixed list, each
value checked: a number, a choice, an absolute path, a CPU list), and the
``DOMUS_*`` environment it ran with.  ``domus.ops.launch`` rebuilds the
command from these (``arguments``), with an executable of its own choosing,
so a record cannot make ``domus deployment restart`` run anything but a
Domus supervisor or service.  ``validate`` is what the supervisor applies to
a record it is sent, and what restart applies to a record it reads.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable
from typing import Any

from domus.wire import checks

FORMAT = 2
LOG_FILE = {"supervisor": "supervisor.log", "service": "service.log"}
ROLES = tuple(LOG_FILE)
CPU_LIST = re.compile(r"^[0-9]{1,5}(-[0-9]{1,5})?(,[0-9]{1,5}(-[0-9]{1,5})?){0,255}$")


def _seconds(value: Any, flag: str) -> float:
    return checks.figure(value, flag, high=1e12, positive=True)


def _wait(value: Any, flag: str) -> float:
    return checks.figure(value, flag, high=1e12, positive=False)


def _count(value: Any, flag: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1 << 20:
        raise ValueError(f"{flag} {value!r} is not a count")
    return value


def _fraction(value: Any, flag: str) -> float:
    return checks.figure(value, flag, high=1.0, positive=False)


def _percent(value: Any, flag: str) -> float:
    return checks.figure(value, flag, high=1e4, positive=False)


def _choice(*allowed: str) -> Callable[[Any, str], str]:
    def check(value: Any, flag: str) -> str:
        if value not in allowed:
            raise ValueError(f"{flag} {value!r} is not one of {list(allowed)}")
        return value
    return check


def _path(value: Any, flag: str) -> str:
    return checks.absolute_path(value, flag)


def _cpus(value: Any, flag: str) -> str:
    if not isinstance(value, str) or not CPU_LIST.fullmatch(value):
        raise ValueError(f"{flag} {value!r} is not a CPU list such as 0,1 or 4-7")
    return value


def _resource(field: str) -> Callable[[Any, str], float]:
    def check(value: Any, flag: str) -> float:
        if field != "cores" and not isinstance(value, int):
            raise ValueError(f"{flag} {value!r} is not a whole number of bytes")
        return checks.figure(value, flag, high=checks.MAX_RESOURCES[field], positive=True)
    return check


DISK_RESERVE = re.compile(r"^[0-9]{1,15}(\.[0-9]{1,6})?( ?%|[kmgtKMGT]?(i?[bB])?)$")


def _disk_reserve(value: Any, flag: str) -> str:
    if not isinstance(value, str) or not DISK_RESERVE.fullmatch(value):
        raise ValueError(f"{flag} {value!r} is neither a size (512m, 1048576) nor a percentage "
                         f"(5%)")
    return value


def _whole(low: int, high: int) -> Callable[[Any, str], int]:
    def check(value: Any, flag: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{flag} {value!r} is not a whole number from {low} to {high}")
        return value
    return check


def _host(value: Any, flag: str) -> str:
    return checks.host(value)


def _address(value: Any, flag: str) -> str:
    return checks.address(value)


# The options a record may carry, per role: flag -> check of its value
# (None: a flag that takes no value).
OPTIONS: dict[str, dict[str, Callable[[Any, str], Any] | None]] = {
    "supervisor": {
        "--down-after": _seconds, "--push-timeout": _seconds,
        "--balance": _choice("auto", "manual"), "--balance-settle": _wait,
        "--balance-max-moves": _count, "--balance-cooldown": _wait,
        "--balance-cpu-busy": _percent, "--balance-smoothing": _fraction,
        "--insecure": None, "--secret-file": _path, "--metrics": _address,
    },
    "service": {
        "--heartbeat": _seconds, "--cores": _resource("cores"), "--ram": _resource("ram"),
        "--disk": _resource("disk"), "--cpus": _cpus, "--secret-file": _path,
        "--metrics": _address, "--disk-reserve": _disk_reserve, "--host": _host,
        # its bounds (domus.service.limits), where they are not the defaults,
        # in the ranges `domus service` takes them in (domus.ops.cli)
        "--max-connections": _whole(1, 1_000_000),
        "--max-connections-per-host": _whole(1, 1_000_000),
        "--idle-timeout": _seconds, "--write-timeout": _seconds,
        "--input-budget": _whole(1, 1 << 62), "--max-scans": _whole(1, 100_000_000),
        "--max-scan-keys": _whole(1, 1 << 40), "--udp-reply-factor": _whole(0, 65_507),
        "--shed-after": _wait, "--reply-cache-entries": _whole(2, 1 << 32),
        "--spin": _wait, "--bdb-ram-cache": _whole(0, 1 << 62),
    },
}


def record(role: str, address: str, data_dir: str, options: list[list[Any]], *,
           name: str | None = None, supervisor: str | None = None) -> dict[str, Any]:
    """The launch record of this process: ``role`` ("supervisor" or
    "service"), the address it listens on, its data dir, and the options
    (``[flag, value]`` pairs, value None for a bare flag) it was started
    with; a service's also its name and its supervisor's address."""
    made: dict[str, Any] = {
        "format": FORMAT, "role": role, "address": address, "host": socket.gethostname(),
        "data_dir": os.path.abspath(data_dir), "options": [list(pair) for pair in options],
        "env": {key: value for key, value in os.environ.items()
                if key.startswith("DOMUS_") and checks.ENV_KEY.fullmatch(key)},
    }
    if role == "service":
        made.update(name=name, supervisor=supervisor)
    return validate(made)


def validate(given: Any) -> dict[str, Any]:
    """The record ``given``, checked field by field and rebuilt from the
    checked values only (anything else it carries is left out); ValueError
    naming the first problem.  A record of an older Domus (a command line:
    ``python`` and ``arguments``) is refused."""
    if not isinstance(given, dict):
        raise ValueError(f"a launch record must be a map, not {type(given).__name__}")
    if "python" in given or "arguments" in given or given.get("format") != FORMAT:
        raise ValueError("the launch record is a command line (or of an unknown format); "
                         "restart runs only records of validated fields (format "
                         f"{FORMAT}), which the process sends again when it next starts")
    role = given.get("role")
    if role not in ROLES:
        raise ValueError(f"launch record role {role!r} is not one of {list(ROLES)}")
    checked: dict[str, Any] = {
        "format": FORMAT, "role": role, "address": checks.address(given.get("address")),
        "host": checks.host(given.get("host")),
        "data_dir": checks.absolute_path(given.get("data_dir"), "data dir"),
        "env": checks.environment(given.get("env", {})),
    }
    if role == "service":
        checked["name"] = checks.service_name(given.get("name"))
        checked["supervisor"] = checks.address(given.get("supervisor"))
    options = given.get("options", [])
    if not isinstance(options, list) or len(options) > 32:
        raise ValueError("a launch record's options must be a list of at most 32 [flag, "
                         "value] pairs")
    allowed = OPTIONS[role]
    seen = set()
    pairs = []
    for pair in options:
        if not (isinstance(pair, list | tuple) and len(pair) == 2):
            raise ValueError(f"launch record option {pair!r} is not a [flag, value] pair")
        flag, value = pair
        if flag not in allowed or flag in seen:
            raise ValueError(f"launch record option {flag!r} is refused: a {role} record may "
                             f"carry {sorted(allowed)} once each")
        seen.add(flag)
        check = allowed[flag]
        if check is None:
            if value is not None:
                raise ValueError(f"launch record option {flag} takes no value")
        else:
            value = check(value, flag)
        pairs.append([flag, value])
    checked["options"] = pairs
    return checked


def arguments(checked: dict[str, Any]) -> list[str]:
    """The ``domus`` arguments that start the process of a validated record
    again (after the executable, and ``-m domus`` for a Python)."""
    role = checked["role"]
    argv = [role]
    if role == "service":
        argv += ["--name", checked["name"], "--supervisor", checked["supervisor"]]
    argv += ["--listen", checked["address"], "--data-dir", checked["data_dir"]]
    for flag, value in checked["options"]:
        argv.append(flag)
        if value is not None:
            argv.append(value if isinstance(value, str) else repr(value))
    return argv


def log_file(checked: dict[str, Any]) -> str:
    """Where the process's output goes (appended): its data dir's log."""
    return os.path.join(checked["data_dir"], LOG_FILE[checked["role"]])
