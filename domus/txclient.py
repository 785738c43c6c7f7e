"""The Twisted client, under its public name: ``from domus import txclient``.

It lives in ``domus.client.tx``; this module re-exports its public names.
"""

from domus.client.tx import DatagramRequests, TxChannel, TxCluster, TxDht, connect

__all__ = ["connect", "TxCluster", "TxDht", "TxChannel", "DatagramRequests"]
