"""Checks on what one process of a deployment is told by another: names,
ids, host names and addresses, paths and resource figures.

Whatever comes off the wire and reaches a file path, a command line or the
balancer's arithmetic goes through one of these first, on both sides (the
supervisor checks what services and clients send it; a service checks what
the supervisor sends it), so that a buggy peer, or one on an ``--insecure``
deployment, cannot make a process write outside its data dir, run a command
of its choosing, or take every bucket with an absurd figure.  Each check
returns the value (normalised where it says so) or raises ValueError with a
message that names the problem.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from typing import Any

from domus.wire import address as addresses

# DHT ids travel as unsigned 32-bit integers (docs/protocol.md) and name a
# directory under a service's data dir: an int, never a string or a bool.
MAX_DHT_ID = 0xFFFFFFFF
# Service names: what `domus service --name` takes, or the listen address by
# default (IPv6 in brackets).  They are shown in tables and logs, never used
# as file names, but kept to printable ASCII all the same.
SERVICE_NAME = re.compile(r"^[A-Za-z0-9\[][A-Za-z0-9_.:\[\]-]{0,127}$")
# A host name (RFC 1123 labels) or an IP literal: what a launcher's {host}
# becomes, so nothing that a shell or ssh could take as an option or a word.
HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
MAX_HOST = 253
# Identities of a deployment and of a DHT (see docs/operations.md,
# "Orphaned DHTs"): lowercase hex made by os.urandom.
IDENTITY = re.compile(r"^[0-9a-f]{16,64}$")
# Environment variables a launch record may carry.
ENV_KEY = re.compile(r"^DOMUS_[A-Z0-9_]{1,64}$")
MAX_ENV_VALUE = 4096
MAX_PATH = 4096
# Resource figures a service may declare: finite, positive, and no more than
# a machine can have (a figure past these is a bug or a lie, and would draw
# every bucket of every new DHT to the service that claims it).
MAX_RESOURCES = {"cores": 1 << 16,            # CPUs
                 "ram": 1 << 50,              # bytes: 1 PiB
                 "disk": 1 << 60}             # bytes: 1 EiB
# Load figures in heartbeats: finite, not negative, bounded (rates, percents
# of many cores, bytes).
MAX_LOAD = 1e18


def dht_id(value: Any) -> int:
    """A DHT id: an int in 1..2^32-1."""
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_DHT_ID:
        raise ValueError(f"DHT id {value!r} is not valid: DHT ids are integers from 1 to "
                         f"{MAX_DHT_ID}")
    return value


def service_name(name: Any) -> str:
    if not isinstance(name, str) or not SERVICE_NAME.fullmatch(name):
        raise ValueError(f"service name {name!r} is not valid: use 1 to 128 letters, digits, "
                         f"'_', '.', ':', '-' (or a HOST:PORT), starting with a letter, digit "
                         f"or '['")
    return name


def host(name: Any) -> str:
    """A host name (dot-separated RFC 1123 labels) or an IP address."""
    if isinstance(name, str) and name:
        try:
            return str(ipaddress.ip_address(name))
        except ValueError:
            pass
        labels = name.rstrip(".").split(".")
        if len(name) <= MAX_HOST and all(HOST_LABEL.fullmatch(label) for label in labels):
            return name
    raise ValueError(f"host {name!r} is not a valid host name or IP address")


def address(text: Any) -> str:
    """HOST:PORT with a valid host (a name or an IP, IPv6 in brackets) and a
    port in 0..65535 (0: any free port); returned as given."""
    if not isinstance(text, str) or len(text) > MAX_HOST + 8:
        raise ValueError(f"address {text!r} is not a HOST:PORT")
    name, port = addresses.parse(text)
    host(name)
    if text != text.strip():
        raise ValueError(f"address {text!r} has spaces around it")
    return text


def identity(value: Any, what: str) -> str:
    if not isinstance(value, str) or not IDENTITY.fullmatch(value):
        raise ValueError(f"{what} {value!r} is not valid: expected 16 to 64 lowercase hex "
                         f"digits")
    return value


def absolute_path(value: Any, what: str) -> str:
    """An absolute path, without NUL, newlines or '..' components, returned
    normalised."""
    if (not isinstance(value, str) or not value.startswith("/") or len(value) > MAX_PATH
            or any(char in value for char in "\0\n\r")
            or ".." in value.split("/")):
        raise ValueError(f"{what} {value!r} is not valid: expected an absolute path, without "
                         f"'..', NUL or newlines")
    return os.path.normpath(value)


def figure(value: Any, what: str, *, low: float = 0.0, high: float, positive: bool) -> float:
    """A finite number in [low, high] (above ``low`` if ``positive``)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{what} {value!r} is not a number")
    number = float(value)
    if not math.isfinite(number) or number < low or (positive and number <= low) \
            or number > high:
        bound = f"above {low:g}" if positive else f"at least {low:g}"
        raise ValueError(f"{what} {value!r} is out of range: it must be finite, {bound} and "
                         f"at most {high:g}")
    return value


def resources(given: Any) -> dict[str, Any]:
    """A service's declared resources: ``cores``, ``ram`` (bytes) and
    ``disk`` (bytes), each finite, positive (the free disk may be 0: a
    service restarted on a full disk) and at most what a machine can have
    (MAX_RESOURCES), and ``hostname`` (a host name) if given.  Returns
    those fields (one left out counts as none of it); any other field is
    refused."""
    if not isinstance(given, dict):
        raise ValueError(f"resources must be a map of cores, ram and disk, not {given!r}")
    unknown = [field for field in given if field not in (*MAX_RESOURCES, "hostname")]
    if unknown:
        raise ValueError(f"resources have unknown fields {unknown!r} (known: cores, ram, "
                         f"disk, hostname)")
    checked: dict[str, Any] = {}
    for field, high in MAX_RESOURCES.items():
        if field in given:
            checked[field] = figure(given[field], f"resources' {field}", high=high,
                                    positive=field != "disk")
    if given.get("hostname") is not None:
        checked["hostname"] = host(given["hostname"])
    return checked


def load(given: Any) -> dict[str, float]:
    """A heartbeat's load figures: each finite, not negative and at most
    MAX_LOAD, or a flag (True/False, e.g. ``disk_full``); names are short
    identifiers."""
    if not isinstance(given, dict) or len(given) > 64:
        raise ValueError("a heartbeat's load must be a map of at most 64 figures")
    for name, value in given.items():
        if not isinstance(name, str) or not re.fullmatch(r"[a-z_]{1,32}", name):
            raise ValueError(f"load figure name {name!r} is not valid")
        if isinstance(value, bool):
            continue
        figure(value, f"load figure {name!r}", high=MAX_LOAD, positive=False)
    return given


def environment(given: Any) -> dict[str, str]:
    """Environment variables of a launch record: ``DOMUS_*`` keys (upper
    case, digits and '_'), string values without NUL or newlines."""
    if not isinstance(given, dict) or len(given) > 64:
        raise ValueError("a launch record's env must be a map of at most 64 DOMUS_* variables")
    for key, value in given.items():
        if not isinstance(key, str) or not ENV_KEY.fullmatch(key):
            raise ValueError(f"environment variable {key!r} is refused: only DOMUS_* names "
                             f"(upper case letters, digits, '_') are kept")
        if (not isinstance(value, str) or len(value) > MAX_ENV_VALUE
                or any(char in value for char in "\0\n\r")):
            raise ValueError(f"environment variable {key}: its value {value!r} is not valid")
    return dict(given)
