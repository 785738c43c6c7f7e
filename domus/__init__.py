"""Domus: distributed hash tables for cluster jobs.

    import domus
    with domus.connect() as cluster:          # $DOMUS_SUPERVISOR or 127.0.0.1:7700
        dht = cluster.create_dht("words")
        dht["apple"] = 3

docs/architecture.md maps the packages: ``domus.client`` (the job's side),
``domus.wire`` (what both sides share), ``domus.service`` and
``domus.storage`` (the service's side), ``domus.placement`` and
``domus.routing`` (where buckets live), ``domus.supervisor``, ``domus.ops``
(the ``domus`` command).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from domus import errors
from domus._version import __version__

if TYPE_CHECKING:
    from domus.client import Cluster, Dht, connect

__all__ = ["connect", "Cluster", "Dht", "errors", "__version__"]
_CLIENT_NAMES = frozenset({"connect", "Cluster", "Dht"})


def __getattr__(name: str) -> Any:
    # The client is loaded on first use, so that a service or supervisor
    # process (``python -m domus service``) never loads the client side.
    if name in _CLIENT_NAMES:
        from domus import client

        return getattr(client, name)
    raise AttributeError(f"module 'domus' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _CLIENT_NAMES)
