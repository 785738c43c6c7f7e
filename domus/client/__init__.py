"""The client side: what a cluster job runs to use Domus.

``blocking`` is the synchronous client (``domus.connect``), ``tx`` the
Twisted one (``domus.txclient``); both find the storing service with
``lookup`` (strategies over the routing graph), encode requests and decode
replies with ``codec`` (C when built), cut batches with ``batch`` and send
them through ``transport`` (UDP with retries, TCP for large messages and the
control plane).  Nothing here imports the service side: both sides share
only ``domus.wire`` and the basics (errors, placement, routing, rbtree).
"""

from domus.client.blocking import Cluster, Dht, connect

__all__ = ["connect", "Cluster", "Dht"]
