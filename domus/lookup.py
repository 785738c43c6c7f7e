"""Lookup: from a key's bucket to the service that stores it.

Only the direct method (D) exists so far: the bucket -> service map is
rebuilt from the descriptor's per-service counts (domus.assignment), so a
lookup is one list index and the request goes straight to its service.
``DirectLookup`` is the part of a DHT handle that both the synchronous and
the Twisted clients share; they differ only in how they send requests.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from domus import assignment, batch, codec
from domus.keys import bucket_shift

Channel = TypeVar("Channel")


class DirectLookup(Generic[Channel]):
    """A DHT's layout as a client sees it.  ``cluster.channel(name,
    address)`` must return the (shared) channel to a service."""

    cluster: Any

    def __init__(self, cluster: Any, descriptor: dict[str, Any]) -> None:
        self.cluster = cluster
        self._stats = {"lookups": 0, "hits": 0, "misses": 0, "refreshes": 0}
        self._load(descriptor)

    def _load(self, descriptor: dict[str, Any]) -> None:
        self.descriptor = descriptor
        self.name: str = descriptor["name"]
        self.id: int = descriptor["id"]
        self.bucket_count: int = descriptor["buckets"]
        self._hasher = codec.hasher(descriptor["hash"])  # the hash, as domus.codec takes it
        self._shift = bucket_shift(self.bucket_count)
        storage = descriptor["storage_services"]
        channels = [self.cluster.channel(entry["name"], entry["address"]) for entry in storage]
        self._storage_channels: list[Channel] = channels
        owners = assignment.placement([entry["count"] for entry in storage])
        # The direct lookup: bucket -> channel, rebuilt from the counts alone.
        self._owners: list[Channel] = [channels[index] for index in owners]

    def __repr__(self) -> str:
        return (f"<domus.{type(self).__name__} {self.name!r} id={self.id} "
                f"buckets={self.bucket_count} services={len(self._storage_channels)}>")

    def _bucket(self, encoded_key: bytes) -> int:
        return codec.bucket_of(self._hasher, self._shift, encoded_key)

    def _put_many_requests(self, keys: list[bytes],
                           values: list[bytes]) -> list[tuple[Channel, bytes]]:
        """PUT_MANY messages for encoded keys and packed values."""
        return batch.put_requests(keys, values, self._hasher, self._shift, self._owners,
                                  self.id, self.cluster.ids)

    def _get_many_requests(self, state: batch.GetMany,
                           ) -> tuple[list[tuple[Channel, bytes]], list[list[int]]]:
        """GET_MANY messages for the keys ``state`` still waits for."""
        return state.requests(self._hasher, self._shift, self._owners, self.id,
                              self.cluster.ids)

    def stats(self) -> dict[str, Any]:
        """This client's lookup counters for the DHT, and its transport's
        retries and timeouts (local counters, no request is sent)."""
        lookups = self._stats["lookups"]
        return {
            "dht": self.name,
            "strategy": "D",
            "lookups": {"D": {"lookups": lookups, "hits": self._stats["hits"],
                              "misses": self._stats["misses"], "fallbacks": 0}},
            "hops": {"mean": 1.0 if lookups else 0.0, "max": 1 if lookups else 0},
            "refreshes": self._stats["refreshes"],
            "retries": sum(channel.retries for channel in self._storage_channels),
            "timeouts": sum(channel.timeouts for channel in self._storage_channels),
        }
