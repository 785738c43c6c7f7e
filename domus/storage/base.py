"""The interface every storage platform implements.

A service keeps one ``Repository`` per bucket it stores.  Keys and values are
the opaque bytes of the protocol: a repository never decodes them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator


class StorageFault(Exception):
    """The medium under a repository failed (a Berkeley DB error, a full
    disk, a file that cannot be opened).  The message names the DHT and the
    bucket; the service answers STORAGE_ERROR and keeps serving the rest."""


class StorageFullFault(StorageFault):
    """The medium is out of room: no space left on the device, or a RAM
    Berkeley DB cache that is full.  Nothing was stored; the service answers
    STORAGE_FULL (the client raises domus.errors.StorageFull)."""


class Repository(ABC):
    """The records of one bucket of one DHT."""

    # True if the platform keeps records in the order of their key bytes and
    # can walk a key range (``key_range``); RANGE requests need it.
    ordered = False

    @abstractmethod
    def put(self, key: bytes, value: bytes) -> bool:
        """Store ``value`` under ``key``; True if the key was new."""

    @abstractmethod
    def get(self, key: bytes) -> bytes | None:
        """The value under ``key``, or None."""

    @abstractmethod
    def delete(self, key: bytes) -> bool:
        """Remove ``key``; True if it was there."""

    @abstractmethod
    def contains(self, key: bytes) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def key_snapshot(self) -> list[bytes]:
        """Every key at this moment, for a scan that may outlive changes."""

    @abstractmethod
    def records(self) -> Iterator[tuple[bytes, bytes]]:
        """Every (key, value) pair, for saving the bucket; the iterator must
        not outlive a change to the repository."""

    def apply(self, changes: list[tuple[bytes, bytes | None]], durable: bool = True) -> int:
        """Apply (key, value) puts and (key, None) deletes in order; returns
        the keys created.  Platforms with transactions apply them as one
        (all or none, one log flush; ``durable=False``: not even that, for
        copies that are made durable as a whole later)."""
        created = 0
        for key, value in changes:
            if value is None:
                self.delete(key)
            else:
                created += self.put(key, value)
        return created

    def key_range(self, low: bytes | None, high: bytes | None, *,
                  inclusive: tuple[bool, bool] = (True, True), reverse: bool = False,
                  items: bool = False) -> Iterator[bytes] | Iterator[tuple[bytes, bytes]]:
        """Keys (or (key, value) pairs) from ``low`` to ``high`` (None:
        unbounded) in bytewise key order, descending if ``reverse``;
        ``inclusive`` says whether each bound belongs to the range.  Only
        ordered platforms have it; the iterator must not outlive a change to
        the repository."""
        raise NotImplementedError(f"{type(self).__name__} keeps no key order; "
                                  f"it has no key ranges")

    def close(self) -> None:
        """Release what the repository holds (nothing, for RAM platforms)."""


class TrackedRepository(Repository):
    """A bucket's repository while its storage moves away (a live move,
    domus.service.hosted): it serves as before, and notes every key a
    change touched so that the copy on the target can catch up.  The C hot
    path does not drive it, so every change to the bucket passes here."""

    def __init__(self, inner: Repository) -> None:
        self.inner = inner
        self.ordered = inner.ordered
        self.changed: set[bytes] = set()

    def put(self, key: bytes, value: bytes) -> bool:
        created = self.inner.put(key, value)
        self.changed.add(key)
        return created

    def get(self, key: bytes) -> bytes | None:
        return self.inner.get(key)

    def delete(self, key: bytes) -> bool:
        deleted = self.inner.delete(key)
        if deleted:
            self.changed.add(key)
        return deleted

    def contains(self, key: bytes) -> bool:
        return self.inner.contains(key)

    def apply(self, changes: list[tuple[bytes, bytes | None]], durable: bool = True) -> int:
        created = self.inner.apply(changes, durable)
        self.changed.update(key for key, _value in changes)
        return created

    def __len__(self) -> int:
        return len(self.inner)

    def key_snapshot(self) -> list[bytes]:
        return self.inner.key_snapshot()

    def records(self) -> Iterator[tuple[bytes, bytes]]:
        return self.inner.records()

    def key_range(self, low: bytes | None, high: bytes | None, *,
                  inclusive: tuple[bool, bool] = (True, True), reverse: bool = False,
                  items: bool = False) -> Iterator[bytes] | Iterator[tuple[bytes, bytes]]:
        return self.inner.key_range(low, high, inclusive=inclusive, reverse=reverse,
                                    items=items)

    def close(self) -> None:
        self.inner.close()

    def take_changes(self) -> list[bytes | None]:
        """The keys changed since the last call, each with its value now
        (None: deleted), as a flat [key, value, ...] list."""
        changed, self.changed = self.changed, set()
        flat: list[bytes | None] = []
        for key in sorted(changed):
            flat += (key, self.inner.get(key))
        return flat


# The Berkeley DB cache of each RAM DHT kept in Berkeley DB, in bytes (0:
# the default, domus.storage.bsddb.ram_cache_bytes): one service a process,
# which sets it from its limits (--bdb-ram-cache).
_bdb_ram_cache = 0


def set_bdb_ram_cache(size: int) -> None:
    """Set the cache of the RAM Berkeley DB stores opened from now on
    (0: the default)."""
    global _bdb_ram_cache
    _bdb_ram_cache = int(size)


def bdb_ram_cache() -> int:
    """What set_bdb_ram_cache set (0: the default)."""
    return _bdb_ram_cache


def apply_batch(groups: list[tuple[Repository, list[tuple[bytes, bytes | None]]]]) -> int:
    """Apply each repository's changes (puts, and deletes as value None),
    all or nothing: one transaction where the repositories share one
    (``apply_together``, Berkeley DB on a ``sync`` store), else repository
    by repository with what they held noted first and put back if one
    fails.  Returns the keys created; the StorageFault of the one that
    failed is raised once the others are undone."""
    if not groups:
        return 0
    together = getattr(groups[0][0], "apply_together", None)
    if together is not None and len(groups) > 1:
        created = together(groups)
        if created is not NotImplemented:
            return created
    created = 0
    done: list[tuple[Repository, list[tuple[bytes, bytes | None]]]] = []
    try:
        for repo, changes in groups:
            before = [(key, repo.get(key)) for key, _value in changes]
            # (Noted before it is applied: the one that fails may have
            # applied some of its changes, which are undone too.)
            done.append((repo, before[::-1]))
            created += repo.apply(changes)
    except StorageFault:
        for repo, before in reversed(done):
            for change in before:       # one by one: an undo that fails skips no other
                try:
                    repo.apply([change])
                except StorageFault:
                    pass        # (it keeps what it has; the fault is reported)
        raise
    return created


class MappingRepository(Repository):
    """A Repository that is also a mutable mapping of bytes to bytes (a dict
    or an RBTree subclass): the writes in mapping terms.  ``get`` and
    ``contains`` are left to the concrete class, which binds the mapping's
    own C methods."""

    def put(self, key: bytes, value: bytes) -> bool:
        created = key not in self  # type: ignore[operator]
        self[key] = value  # type: ignore[index]
        return created

    def delete(self, key: bytes) -> bool:
        return self.pop(key, None) is not None  # type: ignore[attr-defined]

    def key_snapshot(self) -> list[bytes]:
        return list(self)  # type: ignore[call-overload]

    def records(self) -> Iterator[tuple[bytes, bytes]]:
        return iter(self.items())  # type: ignore[attr-defined]


class Store(ABC):
    """The repositories of one DHT on one service: opens a bucket's
    repository, removes one (with its data), flushes and closes them all.

    A repository is a *part*: bucket ``bucket`` of the DHT's hash range cut
    into ``count`` buckets (None: the count the DHT was created with).  A
    DHT that is resized (domus.service.hosted, "Resizing") keeps parts of
    two counts for a while: a part of a coarser count holds the records of
    several buckets of the finer one.  A *temporary* part (a merge under
    way) is never taken for the part itself until ``commit``, so a crash
    while it is filled leaves the parts it is made from as they were."""

    @abstractmethod
    def open(self, bucket: int, count: int | None = None, *,
             temporary: bool = False) -> Repository:
        """The repository of the part, with whatever the medium kept of it."""

    @abstractmethod
    def remove(self, bucket: int, count: int | None = None, *,
               temporary: bool = False) -> None:
        """Close the part's repository and delete its data."""

    def commit(self, bucket: int, count: int) -> Repository:
        """Make the open temporary part the part itself (its data durable
        first), replacing whatever the medium held under that part; returns
        the part's repository (the temporary one's handle is done with)."""
        raise NotImplementedError(f"{type(self).__name__} has no temporary parts")

    def parts(self) -> set[tuple[int, int]]:
        """The (count, bucket) parts the medium holds, open or not (nothing,
        for RAM platforms); temporary parts are not listed."""
        return set()

    def discard(self, bucket: int, count: int) -> None:
        """Delete a part the medium holds that is not open (left over by a
        resize that was cut short)."""

    def flush(self) -> None:
        """Write what is buffered to the medium (nothing, for RAM platforms)."""

    def storage_bytes(self) -> int | None:
        """The bytes the store's repositories occupy, as the platform counts
        them; None when the platform cannot tell (Python objects in RAM)."""
        return None

    def checkpoint(self, after: int = 0) -> None:
        """Write what the medium's log holds into its files and let the log
        files no longer needed go (nothing, for platforms without a log);
        ``after``: only once the log has grown by that many bytes since the
        last checkpoint (cheap to ask when it has not)."""

    def reclaim(self, start: bool = False) -> int:
        """Give the space that records deleted since the last call freed
        inside the medium's files back to the filesystem (a service at its
        disk reserve calls this; ``start``: only note how many records each
        repository holds, the first time).  Returns the bytes given back
        (nothing, for RAM platforms)."""
        return 0

    @abstractmethod
    def close(self) -> None:
        """Close every repository, keeping what the medium holds."""

    def destroy(self) -> None:
        """Close every repository and delete everything the store holds."""
        self.close()


class FailedRepository(Repository):
    """What a bucket whose repository could not be opened is served by:
    every request on it is a StorageFault saying why; the service's other
    buckets are not affected."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def _fail(self) -> StorageFault:
        return StorageFault(self.reason)

    def put(self, key: bytes, value: bytes) -> bool:
        raise self._fail()

    def get(self, key: bytes) -> bytes | None:
        raise self._fail()

    def delete(self, key: bytes) -> bool:
        raise self._fail()

    def contains(self, key: bytes) -> bool:
        raise self._fail()

    def __len__(self) -> int:
        return 0

    def key_snapshot(self) -> list[bytes]:
        raise self._fail()

    def records(self) -> Iterator[tuple[bytes, bytes]]:
        raise self._fail()


class UnavailableStore(Store):
    """The store of a DHT whose platform this service cannot run (its
    library is not installed).  The service still routes the DHT's buckets;
    it is never given one to store (the supervisor places storage only on
    services that report the platform), and a bucket opened here anyway
    fails every request with ``reason``."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def open(self, bucket: int, count: int | None = None, *,
             temporary: bool = False) -> Repository:
        raise StorageFault(self.reason)

    def remove(self, bucket: int, count: int | None = None, *,
               temporary: bool = False) -> None:
        pass

    def close(self) -> None:
        pass


class RamStore(Store):
    """Repositories that are Python objects in the service's memory: a
    factory's instances, one per part."""

    def __init__(self, factory: Callable[[], Repository]) -> None:
        self._factory = factory
        self._repos: dict[tuple[int | None, int, bool], Repository] = {}

    def open(self, bucket: int, count: int | None = None, *,
             temporary: bool = False) -> Repository:
        part = (count, bucket, temporary)
        if part in self._repos:
            raise ValueError(f"bucket {bucket} is already open in this store")
        repo = self._repos[part] = self._new_repository(bucket, count)
        return repo

    def _new_repository(self, bucket: int, count: int | None) -> Repository:
        """A new, empty repository for a part (the factory's)."""
        return self._factory()

    def remove(self, bucket: int, count: int | None = None, *,
               temporary: bool = False) -> None:
        repo = self._repos.pop((count, bucket, temporary), None)
        if repo is not None:
            repo.close()

    def commit(self, bucket: int, count: int) -> Repository:
        self.remove(bucket, count)
        repo = self._repos[(count, bucket, False)] = self._repos.pop((count, bucket, True))
        return repo

    def close(self) -> None:
        for repo in self._repos.values():
            repo.close()
        self._repos.clear()
