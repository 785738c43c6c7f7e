"""Lookup: from a key's bucket to the service that stores it.

Only the direct method (D) exists so far: the bucket -> service map is
rebuilt from the descriptor's per-service counts (domus.assignment) as a
``BucketMap`` (ranges in a red-black tree: one entry per service, whatever
the bucket count).  For up to ``DENSE_TABLE_LIMIT`` buckets the client also
unfolds it into a list indexed by bucket, so a lookup is one list index;
beyond that (up to 2**24 buckets, which would be a 128 MiB list per DHT) a
lookup is a floor search in the map, O(log services).
``DirectLookup`` is the part of a DHT handle that both the synchronous and
the Twisted clients share; they differ only in how they send requests.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from domus import batch, codec, layout
from domus.bucketmap import BucketMap
from domus.errors import ProtocolError
from domus.keys import bucket_shift

Channel = TypeVar("Channel")

# Bucket counts up to this get a dense bucket -> channel list (512 KiB at
# most); larger ones are looked up in the BucketMap itself.
DENSE_TABLE_LIMIT = 1 << 16


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
        channels = {entry["name"]: self.cluster.channel(entry["name"], entry["address"])
                    for entry in storage}
        self._storage_channels: list[Channel] = list(channels.values())
        counts = [entry["count"] for entry in storage]
        if sum(counts) != self.bucket_count:
            raise ProtocolError(
                f"DHT {self.name!r}: the supervisor's descriptor gives its storage services "
                f"{sum(counts)} buckets in all, not {self.bucket_count}")
        # bucket -> channel: the placement rebuilt from the counts, then the
        # buckets moved since (domus.layout).
        self.layout: BucketMap[Channel] = BucketMap(self.bucket_count)
        for first, end, name in layout.owners(descriptor, "storage").ranges():
            self.layout.assign(first, end, channels[name])
        self._owners: Any = (self.layout.dense() if self.bucket_count <= DENSE_TABLE_LIMIT
                             else self.layout)

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
