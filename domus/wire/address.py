"""Addresses are "host:port" strings everywhere a user sees them."""

from __future__ import annotations

import os

DEFAULT_SUPERVISOR = "127.0.0.1:7700"


def parse(address: str, default_port: int | None = None) -> tuple[str, int]:
    """Split "host:port" (or "[v6]:port"); a clear ValueError otherwise."""
    text = address.strip()
    host, sep, port = text.rpartition(":")
    if not sep:
        if default_port is None:
            raise ValueError(f"address {address!r} needs a port, as HOST:PORT")
        host, port = text, str(default_port)
    host = host.strip("[]") or "127.0.0.1"
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"address {address!r}: port {port!r} is not a number") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"address {address!r}: port {number} is out of range")
    return host, number


def supervisor_address(explicit: str | None = None) -> str:
    """The supervisor to talk to: the argument, then $DOMUS_SUPERVISOR, then
    127.0.0.1:7700."""
    return explicit or os.environ.get("DOMUS_SUPERVISOR") or DEFAULT_SUPERVISOR
