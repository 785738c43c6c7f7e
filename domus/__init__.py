"""Domus: distributed hash tables for cluster jobs.

    import domus
    with domus.connect() as cluster:          # $DOMUS_SUPERVISOR or 127.0.0.1:7700
        dht = cluster.create_dht("words")
        dht["apple"] = 3
"""

__version__ = "0.1.0"

from domus import errors  # noqa: E402
from domus.client import Cluster, Dht, connect  # noqa: E402

__all__ = ["connect", "Cluster", "Dht", "errors", "__version__"]
