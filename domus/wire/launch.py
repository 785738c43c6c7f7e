"""The launch record: how a process of the deployment is started again.

Every supervisor and service makes its own when it starts and the supervisor
keeps them in its state file (a service sends its record in ``register``):
the host it runs on, the Python and arguments that start it exactly as it is
(absolute paths, its own address, name and data dir), its working directory
and the ``DOMUS_*`` environment it ran with.  ``domus.ops.launch`` starts
processes from them.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

LOG_FILE = {"supervisor": "supervisor.log", "service": "service.log"}


def record(role: str, address: str, arguments: list[str], data_dir: str) -> dict[str, Any]:
    """The launch record of this process: ``role`` ("supervisor" or
    "service"), the address it listens on, and the ``domus`` arguments that
    start it again."""
    return {
        "role": role,
        "address": address,
        "host": socket.gethostname(),
        "python": sys.executable,
        "arguments": ["-m", "domus", *arguments],
        "cwd": os.getcwd(),
        "env": {key: value for key, value in os.environ.items() if key.startswith("DOMUS_")},
        "log": os.path.join(data_dir, LOG_FILE[role]),
    }
