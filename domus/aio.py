"""The asyncio client, under its public name: ``import domus.aio``.

    async with domus.aio.connect("127.0.0.1:7700") as cluster:
        dht = await cluster.open_dht("words")
        await dht.put("apple", 3)

It lives in ``domus.client.aio``; this module re-exports its public names.
"""

from domus.client.aio import AioChannel, AioCluster, AioDht, DatagramRequests, connect

__all__ = ["connect", "AioCluster", "AioDht", "AioChannel", "DatagramRequests"]
