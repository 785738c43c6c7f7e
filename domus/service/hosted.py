"""What a service holds of one DHT: the AS part (routing buckets and their
storage references) and the SS part (one repository per stored bucket)."""

from __future__ import annotations

import os
from typing import Any

from twisted.logger import Logger

from domus import assignment
from domus.bucketmap import BucketMap
from domus.storage import PLATFORMS, FailedRepository, Repository, StorageFault, Store

log = Logger(namespace="domus.service")


def dht_home(data_dir: str, dht_id: int) -> str:
    """Where a service keeps a DHT's files (DHT ids are never reused)."""
    return os.path.join(data_dir, "dhts", str(dht_id))


class HostedDht:
    def __init__(self, descriptor: dict[str, Any], service_name: str,
                 data_dir: str | None = None) -> None:
        self.id: int = descriptor["id"]
        self.name: str = descriptor["name"]
        self.service_name = service_name
        self.platform: str = descriptor["platform"]
        self.medium: str = descriptor.get("storage", "ram")
        platform = PLATFORMS[self.platform]
        if self.medium not in platform.media:
            raise ValueError(f"DHT {self.name!r}: platform {self.platform} cannot store on "
                             f"{self.medium}")
        if self.medium == "disk" and data_dir is None:
            raise ValueError(f"DHT {self.name!r} stores on disk, and this service has no "
                             f"data dir")
        self._platform_ordered = platform.ordered
        self.store: Store = platform.open_store(
            self.medium, dht_home(data_dir, self.id) if data_dir is not None else None,
            f"DHT {self.name!r}", descriptor.get("durability") or "async")
        self.repos: dict[int, Repository] = {}
        # AS: the buckets routed here, and for each the name of the service
        # storing it (a floor map over ranges; see domus.bucketmap).
        self.routing_buckets = range(0)
        self.storage_refs: BucketMap[str] = BucketMap(max(descriptor["buckets"], 1))
        self.descriptor: dict[str, Any] = {}
        self.apply(descriptor)

    def apply(self, descriptor: dict[str, Any]) -> None:
        """Take a (new) descriptor from the supervisor: create repositories
        for buckets now stored here, drop the ones no longer stored here."""
        self.descriptor = descriptor
        self.active = descriptor.get("state", "active") == "active"
        stored = set(_buckets_for(descriptor["storage_services"], self.service_name))
        for bucket in sorted(stored - self.repos.keys()):
            try:
                self.repos[bucket] = self.store.open(bucket)
            except StorageFault as exc:
                # This bucket answers STORAGE_ERROR; the others serve on.
                log.error("service {service}: {problem}", service=self.service_name,
                          problem=str(exc))
                self.repos[bucket] = FailedRepository(str(exc))
        for bucket in sorted(self.repos.keys() - stored):
            dropped = self.repos.pop(bucket)
            log.warn("service {service}: DHT {dht!r} bucket {bucket} is no longer "
                     "stored here; dropping its {records} records",
                     service=self.service_name, dht=self.name, bucket=bucket,
                     records=len(dropped))
            if isinstance(dropped, FailedRepository):
                continue
            self.store.remove(bucket)
        storage = descriptor["storage_services"]
        layout = BucketMap.from_counts([entry["count"] for entry in storage],
                                       [entry["name"] for entry in storage],
                                       descriptor["buckets"])
        self.routing_buckets = _buckets_for(descriptor["routing_services"], self.service_name)
        refs: BucketMap[str] = BucketMap(descriptor["buckets"])
        for first, end, name in layout.ranges(self.routing_buckets.start,
                                              self.routing_buckets.stop):
            refs.assign(first, end, name)
        self.storage_refs = refs

    def storage_service(self, bucket: int) -> str:
        """AS: the service storing a bucket routed here; KeyError if the
        bucket is not routed here."""
        return self.storage_refs.owner(bucket)

    def ordered(self) -> bool:
        """Whether every repository here keeps its records in key order, so
        that key ranges can be walked (the platform decides)."""
        return self._platform_ordered and all(repo.ordered for repo in self.repos.values())

    def records(self) -> int:
        return sum(len(repo) for repo in self.repos.values())

    def flush(self) -> None:
        """Write buffered records to the medium (disk platforms)."""
        self.store.flush()

    def close(self) -> None:
        """Close every repository, keeping what the medium holds (a service
        that stops)."""
        self.repos.clear()
        self.store.close()

    def destroy(self) -> None:
        """Close every repository and delete its data (the DHT is no longer
        hosted here)."""
        self.repos.clear()
        self.store.destroy()


def _buckets_for(entries: list[dict[str, Any]], service_name: str) -> range:
    counts = [entry["count"] for entry in entries]
    for index, entry in enumerate(entries):
        if entry["name"] == service_name:
            return assignment.buckets_of(counts, index)
    return range(0)
