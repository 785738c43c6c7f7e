"""Platforms ``domus-bsddb-btree`` and ``domus-bsddb-hash``: Berkeley DB.

A service keeps, for each DHT on one of these platforms, one Berkeley DB
environment (``BerkeleyStore``) and in it one database per bucket it stores
(``BerkeleyRepository``), with the btree or the hash access method; the
store keeps its open databases in a ``domus.rbtree`` RBTree, bucket ->
repository.

- Medium ``disk``: the environment's home is a directory of its own under
  the service's data dir, one file per bucket (``bucket-<n>.db``), so a
  service restarted on the same data dir finds its buckets where it left
  them.  The environment is private to the service process (``DB_PRIVATE``:
  its cache lives in the process, no region files).
- Medium ``ram``: Berkeley DB in-memory databases (no file at all), in an
  environment whose cache holds them (see ``ram_cache_bytes``).

Keys and values are the protocol's opaque bytes.  btree databases keep keys
in bytewise order (Berkeley DB's default comparison), so
``domus-bsddb-btree`` walks key ranges like ``domus-rbt``; hash databases
keep no order.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from typing import Any

import psutil
from berkeleydb import db

from domus.rbtree import RBTree
from domus.storage.base import (
    Repository,
    StorageFault,
    StorageFullFault,
    Store,
    bdb_ram_cache,
)
from domus.storage.headroom import describe_bytes, filesystem_space


class _DatabaseRepository:
    """``DatabaseRepository`` without the C path: the record count alone,
    for a Python path that serves alone (nothing calls the database's
    methods from C, so nothing else is kept)."""

    def __init__(self, database: Any, *, no_overwrite: int, key_exists: type[BaseException],
                 not_found: type[BaseException], room: bytearray | None = None,
                 no_memory: type[BaseException] | None = None) -> None:
        self.record_count = 0


# The base of a repository kept in a Berkeley DB database: with the C data
# path (domus.service.hotpath, same rule), the C type that lets FastPath call
# the database's methods itself and keep the repository's ``record_count``.
DatabaseRepository: Any = _DatabaseRepository
if os.environ.get("DOMUS_PURE_PYTHON") != "1":
    try:
        from domus._hotpath import DatabaseRepository
    except ImportError:  # not built: the Python path serves alone
        DatabaseRepository = _DatabaseRepository

# The environment's cache: Berkeley DB's pages of every database in it.  A
# disk environment caches pages of its files.  RAM databases live in the
# cache itself, so a RAM environment's cache is the most one service can
# hold of the DHT: RAM_CACHE_MAX or half the machine's memory, whichever is
# smaller.  A private environment's cache is reserved, not touched, until
# pages fill it; what it costs up front is its bookkeeping (measured: 28 MiB
# of RSS for 4 GiB, 92 MiB for 12 GiB).  A RAM DHT fuller than that gets
# MemoryError from Berkeley DB, which first looks for room for four seconds
# (it cannot evict a RAM database's pages; it sleeps a second four times):
# so once a put has found the cache full, its store says so (``room``) and
# refuses puts at once, in C and in Python, until a delete gives room back.
DISK_CACHE_BYTES = 32 * 1024 * 1024
RAM_CACHE_MAX = 4 << 30
_GIGABYTE = 1 << 30
# A sync store's log files: small, so that a checkpoint lets old ones go
# even on a nearly full filesystem (Berkeley DB removes a log file only
# once a newer one is in use; its default, 10 MiB, can hold a small
# filesystem's whole free space).  A record larger than this (up to the
# 16 MiB value limit) is logged page by page, across files.
LOG_FILE_BYTES = 1 << 20
# Pages ``reclaim`` gives back per repository per call, so that a service
# at its reserve never stops serving for long.
RECLAIM_PAGES = 4096
# Free space under which a store that will not open is said to need room.
RECOVERY_ROOM = 16 << 20
# Free space under which a failing disk database is said to be out of room.
FULL_DISK = 1 << 20


def cause(exc: BaseException) -> str:
    """A Berkeley DB error's own words (its message without the errno)."""
    if len(exc.args) > 1 and isinstance(exc.args[1], str):
        return exc.args[1]        # (Berkeley DB's: errno, then its words)
    return str(exc) or type(exc).__name__


FAILED = "Berkeley DB failed"


def fault(label: str, exc: BaseException, where: str, cache_bytes: int,
          doing: str = FAILED) -> StorageFault:
    """The StorageFault of a Berkeley DB error: StorageFullFault when the
    medium is out of room (no space left on the device under ``where``, or
    a full cache), naming what is full; else a StorageFault with the cause."""
    if isinstance(exc, db.DBNoSpaceError):
        return StorageFullFault(f"{label}: {doing}: no space left on the device of {where} "
                                f"({cause(exc)}); free space on that filesystem or delete "
                                f"records")
    if isinstance(exc, (MemoryError, db.DBNoMemoryError)):
        return StorageFullFault(f"{label}: its Berkeley DB cache ({cache_bytes >> 20} MiB, "
                                f"{where}) is full ({cause(exc)}); nothing was stored; delete "
                                f"records, or store the DHT on disk")
    if doing == FAILED:
        # (No path: the same failure reads the same on every service.)
        return StorageFault(f"{label}: {doing}: {cause(exc)}")
    return StorageFault(f"{label}: {doing} ({where}): {cause(exc)}")


def ram_cache_bytes() -> int:
    """A RAM environment's cache: the service's --bdb-ram-cache
    (domus.storage.base.set_bdb_ram_cache), else RAM_CACHE_MAX or half the
    machine's memory, whichever is smaller, but not under 256 MiB."""
    configured = bdb_ram_cache()
    if configured:
        return configured
    return max(256 << 20, min(RAM_CACHE_MAX, psutil.virtual_memory().total // 2))


TEMPORARY = ".merging"
_PART_FILE = re.compile(r"bucket-(\d+)(?:-of-(\d+))?\.db")


def _part_file(bucket: int, count: int | None, base_count: int | None) -> str:
    """A part's file (or in-memory database) name: ``bucket-<n>.db`` for a
    bucket of the DHT's first count (as before resizing existed), else
    ``bucket-<n>-of-<count>.db``."""
    if count is None or count == base_count:
        return f"bucket-{bucket}.db"
    return f"bucket-{bucket}-of-{count}.db"


class BerkeleyRepository(DatabaseRepository, Repository):  # type: ignore[misc]
    """One bucket's records in one Berkeley DB database.  A Berkeley DB
    error (or its cache running out) is a StorageFault naming the bucket;
    the database is left as Berkeley DB left it.

    These methods are what the Python handler calls.  The service's C hot
    path calls the database's own get/put/exists/delete instead (see
    DatabaseRepository in cext/hotpath.c) and does exactly what they do
    here, so they must keep meaning that: a put that refuses an existing
    key, then one that replaces it; NOTFOUND from delete for an absent key;
    ``record_count`` changed by whoever created or deleted a key."""

    def __init__(self, database: db.DB, ordered: bool, name: str, label: str,
                 environment: db.DBEnv | None = None, where: str = "in memory",
                 cache_bytes: int = 0, room: bytearray | None = None) -> None:
        super().__init__(database, no_overwrite=db.DB_NOOVERWRITE,
                         key_exists=db.DBKeyExistError, not_found=db.DBNotFoundError,
                         room=room, no_memory=db.DBNoMemoryError)
        # Its store's: the first byte set while its cache is full (see
        # RAM_CACHE_MAX), shared with the C path; None for a disk store.
        self._room = room
        self._db = database
        self._env = environment      # a transactional one, or None
        self.ordered = ordered
        self.name = name
        self.label = label
        self.where = where           # its file, or "in memory"
        self.cache_bytes = cache_bytes
        # Counted once at open, then kept: DB->stat is a walk, or a guess.
        self.record_count = sum(1 for _ in self._keys())
        # Its records when ``reclaim`` last looked, or when it opened: a
        # bucket opened at the reserve (a service started again there) has
        # the pages of what is deleted from it given back, even when the
        # deletes come before the storage timer's first look at it.
        self.reclaimed_at: int = self.record_count

    def _fault(self, exc: BaseException) -> StorageFault:
        found = fault(self.label, exc, self.where, self.cache_bytes)
        if isinstance(found, StorageFullFault) or self.where == "in memory":
            return found
        # (A cache that cannot write its pages back to a full disk says
        # "Input/output error": the filesystem tells what it is.)
        try:
            free = filesystem_space(os.path.dirname(self.where))[0]
        except OSError:
            return found
        if free >= FULL_DISK:
            return found
        return StorageFullFault(f"{found}; its filesystem has {describe_bytes(free)} free "
                                f"({self.where}): free space there or delete records")

    def put(self, key: bytes, value: bytes) -> bool:
        room = self._room
        if room is not None and room[0]:
            raise StorageFullFault(
                f"{self.label}: its Berkeley DB cache ({self.cache_bytes >> 20} MiB, "
                f"{self.where}) is full: a put found no room in it (Cannot allocate memory), "
                f"and none is tried until records are deleted; nothing was stored; delete "
                f"records, or store the DHT on disk")
        try:
            try:
                self._db.put(key, value, flags=db.DB_NOOVERWRITE)
            except db.DBKeyExistError:
                self._db.put(key, value)
                return False
        except (db.DBError, MemoryError) as exc:
            if room is not None and isinstance(exc, (MemoryError, db.DBNoMemoryError)):
                room[0] = 1
            raise self._fault(exc) from exc
        self.record_count += 1
        return True

    def get(self, key: bytes) -> bytes | None:
        try:
            return self._db.get(key)
        except (db.DBError, MemoryError) as exc:
            raise self._fault(exc) from exc

    def delete(self, key: bytes) -> bool:
        try:
            self._db.delete(key)
        except db.DBNotFoundError:
            return False
        except (db.DBError, MemoryError) as exc:
            raise self._fault(exc) from exc
        self.record_count -= 1
        if self._room is not None:
            self._room[0] = 0           # (room given back: puts are tried again)
        return True

    def apply(self, changes: list[tuple[bytes, bytes | None]], durable: bool = True) -> int:
        """In a transactional (``sync``) store: one transaction, committed
        with one log flush (none if not ``durable``), all or nothing."""
        if self._env is None or not changes:
            return super().apply(changes, durable)
        try:
            txn = self._env.txn_begin()
            try:
                created, deleted = self._apply_in(txn, changes)
            except BaseException:
                txn.abort()
                raise
            txn.commit(0 if durable else db.DB_TXN_NOSYNC)
        except (db.DBError, MemoryError) as exc:
            raise self._fault(exc) from exc
        self.record_count += created - deleted
        return created

    def apply_together(self, groups: list[tuple[Repository, list[tuple[bytes, bytes | None]]]]
                       ) -> int:
        """``apply_batch`` of repositories of this store's transactional
        environment: one transaction for them all (NotImplemented for any
        other mix)."""
        if self._env is None or any(getattr(repo, "_env", None) is not self._env
                                    for repo, _changes in groups):
            return NotImplemented
        counts = []
        failing: BerkeleyRepository = self      # (the fault names its bucket)
        try:
            txn = self._env.txn_begin()
            try:
                for repo, changes in groups:
                    failing = repo                                  # type: ignore[assignment]
                    counts.append(repo._apply_in(txn, changes))    # type: ignore[attr-defined]
            except BaseException:
                txn.abort()
                raise
            failing = self
            txn.commit()
        except (db.DBError, MemoryError) as exc:
            raise failing._fault(exc) from exc
        for (repo, _changes), (created, deleted) in zip(groups, counts):
            repo.record_count += created - deleted                 # type: ignore[attr-defined]
        return sum(created for created, _deleted in counts)

    def _apply_in(self, txn: Any, changes: list[tuple[bytes, bytes | None]]) -> tuple[int, int]:
        created = deleted = 0
        for key, value in changes:
            if value is None:
                try:
                    self._db.delete(key, txn=txn)
                    deleted += 1
                except db.DBNotFoundError:
                    pass
                continue
            try:
                self._db.put(key, value, txn=txn, flags=db.DB_NOOVERWRITE)
                created += 1
            except db.DBKeyExistError:
                self._db.put(key, value, txn=txn)
        return created, deleted

    def contains(self, key: bytes) -> bool:
        try:
            return bool(self._db.exists(key))
        except (db.DBError, MemoryError) as exc:
            raise self._fault(exc) from exc

    def __len__(self) -> int:
        return self.record_count

    def _keys(self) -> Iterator[bytes]:
        return (record[0] for record in self.records())

    def key_snapshot(self) -> list[bytes]:
        return list(self._keys())

    def records(self) -> Iterator[tuple[bytes, bytes]]:
        try:
            cursor = self._db.cursor()
        except (db.DBError, MemoryError) as exc:
            raise self._fault(exc) from exc
        try:
            record = cursor.first()
            while record is not None:
                yield record
                record = cursor.next()
        except (db.DBError, MemoryError) as exc:
            raise self._fault(exc) from exc
        finally:
            cursor.close()

    def key_range(self, low: bytes | None, high: bytes | None, *,
                  inclusive: tuple[bool, bool] = (True, True), reverse: bool = False,
                  items: bool = False) -> Iterator[bytes] | Iterator[tuple[bytes, bytes]]:
        if not self.ordered:
            return super().key_range(low, high, inclusive=inclusive, reverse=reverse,
                                     items=items)
        return self._walk(low, high, inclusive, reverse, items)

    def _walk(self, low: bytes | None, high: bytes | None, inclusive: tuple[bool, bool],
              reverse: bool, items: bool) -> Iterator[bytes] | Iterator[tuple[bytes, bytes]]:
        """A cursor walk over a btree from one bound to the other."""
        start, stop = (high, low) if reverse else (low, high)
        start_inclusive, stop_inclusive = inclusive[::-1] if reverse else inclusive
        cursor = self._db.cursor()
        try:
            record = self._first(cursor, start, start_inclusive, reverse)
            while record is not None:
                key = record[0]
                if stop is not None:
                    beyond = key < stop if reverse else key > stop
                    if beyond or (key == stop and not stop_inclusive):
                        return
                yield record if items else key
                record = cursor.prev() if reverse else cursor.next()
        finally:
            cursor.close()

    @staticmethod
    def _first(cursor: db.DBCursor, start: bytes | None, inclusive: bool,
               reverse: bool) -> tuple[bytes, bytes] | None:
        if start is None:
            return cursor.last() if reverse else cursor.first()
        record = cursor.set_range(start)          # the first key >= start
        if not reverse:
            if record is not None and record[0] == start and not inclusive:
                record = cursor.next()
            return record
        if record is None:                        # every key is < start
            return cursor.last()
        if record[0] == start and inclusive:
            return record
        return cursor.prev()

    def sync(self) -> None:
        try:
            self._db.sync()
        except (db.DBError, MemoryError) as exc:
            raise self._fault(exc) from exc

    def storage_bytes(self) -> int:
        """The bytes of the database's pages: its file's size on disk, or
        what it holds of the cache in RAM.  Deleting records does not
        shrink it (Berkeley DB keeps the pages they free for reuse).  Read
        from Berkeley DB's fast statistics: the meta page, not a walk."""
        try:
            stat = self._db.stat(db.DB_FAST_STAT)
        except (db.DBError, MemoryError) as exc:
            raise self._fault(exc) from exc
        return stat["pagecnt"] * stat["pagesize"]

    def reclaim(self) -> int:
        """Give the free pages at the end of the database's file back to
        the filesystem, moving records off them first (DB->compact with
        DB_FREE_SPACE; at most RECLAIM_PAGES a call).  Returns the bytes
        given back."""
        try:
            before = self.storage_bytes()
            self._db.compact(flags=db.DB_FREE_SPACE, compact_pages=RECLAIM_PAGES)
            return max(before - self.storage_bytes(), 0)
        except (db.DBError, MemoryError) as exc:
            raise self._fault(exc) from exc

    def truncate(self) -> None:
        """Delete every record at once."""
        try:
            self._db.truncate()
        except (db.DBError, MemoryError) as exc:
            raise self._fault(exc) from exc
        self.record_count = 0
        if self._room is not None:
            self._room[0] = 0

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None  # type: ignore[assignment]


class BerkeleyStore(Store):
    """A DHT's Berkeley DB environment on one service, and its databases."""

    def __init__(self, method: str, medium: str, home: str | None, label: str = "DHT",
                 durability: str = "async", base_count: int | None = None) -> None:
        if method not in ("btree", "hash"):
            raise ValueError(f"Berkeley DB access method must be btree or hash, not {method!r}")
        if medium == "disk" and not home:
            raise ValueError("a disk store needs a home directory")
        if durability not in ("none", "async", "sync"):
            raise ValueError(f"durability must be none, async or sync, not {durability!r}")
        self.method = method
        self.medium = medium
        self.label = label
        # sync: a transactional environment; every put and delete is its own
        # transaction, and its commit returns once the log is on disk.
        self.transactional = durability == "sync" and medium == "disk"
        self.home = home if medium == "disk" else None
        self._type = db.DB_BTREE if method == "btree" else db.DB_HASH
        self._repos: RBTree = RBTree()
        self.cache_bytes = ram_cache_bytes() if medium == "ram" else DISK_CACHE_BYTES
        # A RAM cache cannot evict: its first byte is set while it is full
        # (BerkeleyRepository.put), shared by every bucket's repository.
        self.room: bytearray | None = bytearray(1) if medium == "ram" else None
        self.base_count = base_count
        self._open_flags = db.DB_CREATE | (db.DB_AUTO_COMMIT if self.transactional else 0)
        self._env = self._open_environment()
        if self.home is not None:
            # A merge cut short by a crash: its parts are whole still.
            try:
                leftovers = [name for name in os.listdir(self.home)
                             if name.endswith(TEMPORARY)]
                for leftover in leftovers:
                    self._delete(leftover)
            except (OSError, StorageFault) as exc:
                self.close()
                raise StorageFault(f"{self.label}: cannot clear what a merge cut short left "
                                   f"in {self.home}: {exc}") from exc

    def _open_environment(self) -> db.DBEnv:
        """The environment, opened (a sync store's recovered: DB_RECOVER
        replays the log, so every committed write is back before the first
        request is served).  A StorageFault naming the DHT, the path and the
        cause if it cannot be (no space left for recovery, permissions, a
        damaged log): StorageFullFault if out of room."""
        where = self.home if self.home is not None else "in memory"
        env = db.DBEnv()
        try:
            env.set_cachesize(self.cache_bytes // _GIGABYTE, self.cache_bytes % _GIGABYTE)
            if self.home is not None:
                os.makedirs(self.home, exist_ok=True)
            flags = db.DB_CREATE | db.DB_INIT_MPOOL | db.DB_PRIVATE
            if self.transactional:
                flags |= db.DB_INIT_TXN | db.DB_INIT_LOG | db.DB_INIT_LOCK | db.DB_RECOVER
                env.set_lg_max(LOG_FILE_BYTES)
                env.log_set_config(db.DB_LOG_AUTO_REMOVE, 1)
            env.open(self.home, flags)
        except (db.DBError, MemoryError, OSError) as exc:
            try:
                env.close()
            except db.DBError:
                pass            # (a handle whose open failed may refuse even this)
            if isinstance(exc, OSError):
                raise StorageFault(f"{self.label}: cannot open its Berkeley DB environment "
                                   f"({where}): {exc.strerror or exc}") from exc
            doing = ("cannot open and recover its Berkeley DB environment"
                     if self.transactional else "cannot open its Berkeley DB environment")
            found = fault(self.label, exc, where, self.cache_bytes, doing)
            free = self._free_space()
            if free is not None and free < RECOVERY_ROOM:
                # (Berkeley DB's own words then rarely say it: recovery
                # that cannot write reports a lost environment.)
                found = StorageFullFault(f"{found}; its filesystem has {describe_bytes(free)} "
                                         f"free, and opening needs room: free space there")
            raise found from exc
        return env

    def _free_space(self) -> int | None:
        """Free bytes on the filesystem of a disk store's home (None: RAM,
        or it cannot be told)."""
        if self.home is None:
            return None
        try:
            return filesystem_space(self.home)[0]
        except OSError:
            return None

    def _flags(self) -> int:
        return db.DB_AUTO_COMMIT if self.transactional else 0

    def _delete(self, name: str) -> None:
        """Delete a database file that is not open (disk only: berkeleydb
        cannot name an in-memory database to remove)."""
        if self.home is None:
            return
        try:
            self._env.dbremove(name, None, None, self._flags())
        except db.DBNoSuchFileError:
            pass
        except (db.DBError, MemoryError) as exc:
            raise StorageFault(f"{self.label}: cannot delete {name}: {exc}") from exc

    def open(self, bucket: int, count: int | None = None, *,
             temporary: bool = False) -> BerkeleyRepository:
        name = _part_file(bucket, count, self.base_count) + (TEMPORARY if temporary else "")
        if name in self._repos:
            raise ValueError(f"bucket {bucket} is already open in this store")
        database = db.DB(self._env)
        where = os.path.join(self.home, name) if self.home is not None else "in memory"
        label = f"{self.label} bucket {bucket}"
        if count is not None and count != self.base_count:
            label += f" (of {count})"
        try:
            if self.home is None:
                database.open(None, name, self._type, self._open_flags)   # in memory
            else:
                database.open(name, None, self._type, self._open_flags)
        except (db.DBError, MemoryError) as exc:
            database.close()
            raise fault(label, exc, where, self.cache_bytes,
                        "cannot open its Berkeley DB database") from exc
        try:
            repo = BerkeleyRepository(database, self.method == "btree", name, label,
                                      self._env if self.transactional else None, where,
                                      self.cache_bytes, self.room)
        except StorageFault:
            database.close()
            raise
        if temporary and len(repo):
            # (A RAM database outlives its closing: one left by an earlier
            # merge in this process is emptied.)
            for key in repo.key_snapshot():
                repo.delete(key)
        self._repos[name] = repo
        return repo

    def remove(self, bucket: int, count: int | None = None, *, temporary: bool = False) -> None:
        name = _part_file(bucket, count, self.base_count) + (TEMPORARY if temporary else "")
        repo = self._repos.pop(name, None)
        if repo is None:
            return
        if self.home is None:
            repo.truncate()            # its pages go back to the cache's free list
        repo.close()
        if self.home is not None and os.path.exists(os.path.join(self.home, repo.name)):
            self._env.dbremove(repo.name, None, None, self._flags())

    def commit(self, bucket: int, count: int) -> BerkeleyRepository:
        """The temporary part, synced, becomes the part: on disk a rename,
        which is atomic, so a crash leaves one or the other; in RAM (where
        nothing outlives the process) the temporary database is kept as the
        part."""
        name = _part_file(bucket, count, self.base_count)
        if self.home is None:
            self.remove(bucket, count)
            repo = self._repos[name] = self._repos.pop(name + TEMPORARY)
            return repo
        repo = self._repos.pop(name + TEMPORARY)
        try:
            repo.sync()
        finally:
            repo.close()
        self.remove(bucket, count)
        self._delete(name)
        try:
            self._env.dbrename(name + TEMPORARY, None, name, None, self._flags())
        except (db.DBError, MemoryError) as exc:
            raise StorageFault(f"{self.label}: cannot rename {name + TEMPORARY} to {name}: "
                               f"{exc}") from exc
        return self.open(bucket, count)

    def parts(self) -> set[tuple[int, int]]:
        if self.home is None:
            return set()
        found = set()
        for name in os.listdir(self.home):
            match = _PART_FILE.fullmatch(name)
            if match is not None:
                count = int(match[2]) if match[2] is not None else self.base_count
                if count is not None:
                    found.add((count, int(match[1])))
        return found

    def discard(self, bucket: int, count: int) -> None:
        name = _part_file(bucket, count, self.base_count)
        if name in self._repos:
            raise ValueError(f"{name} is open; remove it instead")
        if self.home is not None:
            self._delete(name)

    def flush(self) -> None:
        """Sync every bucket; one that fails does not keep the others from
        being synced.  A StorageFault names every bucket that failed."""
        failures = []
        if self.transactional:
            # Committed writes are in the log already; a checkpoint writes
            # the pages and lets old log files go.
            try:
                self._env.txn_checkpoint()
            except (db.DBError, MemoryError) as exc:
                failures.append(f"{self.label}: Berkeley DB checkpoint failed ({self.home}): "
                                f"{cause(exc)}")
        for repo in self._repos.values():
            try:
                repo.sync()
            except StorageFault as exc:
                failures.append(str(exc))
        if failures:
            raise StorageFault("; ".join(failures))

    def checkpoint(self, after: int = 0) -> None:
        """A sync store's checkpoint: the pages its log holds are written to
        their files and the log files no longer needed are removed (what
        lets deletes go on at a full disk: each is logged first)."""
        if self.transactional and self._env is not None:
            try:
                self._env.txn_checkpoint((after + 1023) // 1024)
            except (db.DBError, MemoryError) as exc:
                raise StorageFault(f"{self.label}: Berkeley DB checkpoint failed "
                                   f"({self.home}): {cause(exc)}") from exc

    def reclaim(self, start: bool = False) -> int:
        """Checkpoint (a sync store: its old log files go), then compact
        each database that lost records since the last call (or since it
        opened, if this is its first), so that the
        pages its deleted records freed go back to the filesystem (``start``:
        only note the records of each).  Only those: compacting moves
        records, which is logged, and the log is written inside the
        reserve.  Disk only.  A StorageFault names every bucket that
        failed; the others are reclaimed still."""
        if self.home is None:
            return 0
        failures = []
        try:
            self.checkpoint()
        except StorageFault as exc:
            failures.append(str(exc))
        given = 0
        for repo in self._repos.values():
            if not start and repo.record_count < repo.reclaimed_at:
                try:
                    given += repo.reclaim()
                except StorageFault as exc:
                    failures.append(str(exc))
            repo.reclaimed_at = repo.record_count
        if failures:
            raise StorageFault("; ".join(failures))
        return given

    def storage_bytes(self) -> int:
        """The bytes of every open database's pages (see
        BerkeleyRepository.storage_bytes); a StorageFault if one cannot
        tell."""
        return sum(repo.storage_bytes() for repo in self._repos.values())

    def close(self) -> None:
        """Close every database and the environment, each whatever the
        others do (a full disk may fail the flush a close makes); a
        StorageFault names what failed.  A sync store's log still holds
        every acknowledged write: recovery replays it at the next open."""
        if self._env is None:
            return
        failures = []
        for repo in self._repos.values():
            try:
                repo.close()
            except (db.DBError, MemoryError) as exc:
                failures.append(f"{repo.label}: closing failed: {cause(exc)}")
        self._repos.clear()
        env, self._env = self._env, None
        try:
            env.close()
        except (db.DBError, MemoryError) as exc:
            failures.append(f"{self.label}: closing its environment failed: {cause(exc)}")
        if failures:
            raise StorageFault("; ".join(failures))

    def destroy(self) -> None:
        self.close()
        if self.home is not None:
            shutil.rmtree(self.home, ignore_errors=True)
