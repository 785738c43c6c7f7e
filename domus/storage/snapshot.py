"""Saving a RAM DHT's records to disk while it is inactive, and loading them
back when it is activated again.

One service writes one snapshot file per deactivated RAM DHT, in the DHT's
own directory under its data dir (``<data dir>/dhts/<id>/ram-snapshot``).
The file is written whole to a temporary name, flushed to disk, and renamed
into place, so it is either absent or complete: a crash or a full disk while
saving leaves the DHT's records in memory and no snapshot.

Layout (all integers little-endian)::

    header   b"DOMUSRAM" u32 format u32 dht id u32 bucket count
    bucket   u32 bucket, then chunks, each u32 length u32 crc32 payload,
             ended by a chunk of length 0 (no crc, no payload)

A chunk's payload is a msgpack array of alternating keys and values (bytes),
at most CHUNK_RECORDS records, so neither saving nor loading holds a second
copy of a whole bucket.  Every chunk's CRC is checked before a single record
of it is stored; a damaged file is refused whole, naming the file and the
bucket.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterable, Iterator
from typing import BinaryIO

import msgpack

from domus.storage.base import Repository, StorageFault

SNAPSHOT_FILE = "ram-snapshot"
MAGIC = b"DOMUSRAM"
FORMAT = 1
CHUNK_RECORDS = 65536
_HEADER = struct.Struct("<8sIII")
_U32 = struct.Struct("<I")
_CHUNK = struct.Struct("<II")


def snapshot_path(home: str) -> str:
    return os.path.join(home, SNAPSHOT_FILE)


def save(home: str, dht_id: int, repos: dict[int, Repository], label: str) -> int:
    """Write every record of ``repos`` (bucket -> repository) to the
    snapshot in ``home``; returns the number of records written.  On any
    failure (a full disk, say) nothing is left behind and StorageFault names
    the file."""
    os.makedirs(home, exist_ok=True)
    path = snapshot_path(home)
    temporary = path + ".tmp"
    records = 0
    try:
        with open(temporary, "wb") as target:
            target.write(_HEADER.pack(MAGIC, FORMAT, dht_id, len(repos)))
            for bucket in sorted(repos):
                target.write(_U32.pack(bucket))
                for chunk in _chunks(repos[bucket].records()):
                    payload = msgpack.packb(chunk, use_bin_type=True)
                    target.write(_CHUNK.pack(len(payload), zlib.crc32(payload)))
                    target.write(payload)
                    records += len(chunk) // 2
                target.write(_U32.pack(0))
            target.flush()
            os.fsync(target.fileno())
        os.replace(temporary, path)
        _sync_directory(home)
    except OSError as exc:
        _remove_quietly(temporary)
        raise StorageFault(f"{label}: cannot save its records to {path}: "
                           f"{exc.strerror or exc}") from exc
    return records


def _chunks(records: Iterable[tuple[bytes, bytes]]) -> Iterator[list[bytes]]:
    chunk: list[bytes] = []
    for key, value in records:
        chunk.append(key)
        chunk.append(value)
        if len(chunk) == 2 * CHUNK_RECORDS:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def exists(home: str | None) -> bool:
    return home is not None and os.path.exists(snapshot_path(home))


def load(home: str, dht_id: int, repos: dict[int, Repository], label: str) -> int:
    """Store the records of the snapshot in ``home`` into ``repos`` (bucket
    -> empty repository); returns the number of records loaded.  A snapshot
    of another DHT, a damaged one, or one holding a bucket not in ``repos``
    is refused with StorageFault naming the file (the caller discards what
    was loaded)."""
    path = snapshot_path(home)
    try:
        with open(path, "rb") as source:
            return _read(source, path, dht_id, repos, label)
    except OSError as exc:
        raise StorageFault(f"{label}: cannot read its saved records from {path}: "
                           f"{exc.strerror or exc}") from exc


def _read(source: BinaryIO, path: str, dht_id: int, repos: dict[int, Repository],
          label: str) -> int:
    def damaged(what: str) -> StorageFault:
        return StorageFault(f"{label}: saved records in {path} are damaged ({what}); "
                            f"the DHT stays inactive and the file is kept")

    header = source.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise damaged("truncated header")
    magic, version, saved_id, bucket_count = _HEADER.unpack(header)
    if magic != MAGIC or version != FORMAT:
        raise damaged("not a Domus RAM snapshot of a format this version reads")
    if saved_id != dht_id:
        raise StorageFault(f"{label}: {path} holds the records of DHT id {saved_id}, "
                           f"not {dht_id}")
    records = 0
    for _ in range(bucket_count):
        raw = source.read(_U32.size)
        if len(raw) < _U32.size:
            raise damaged("truncated before a bucket")
        bucket = _U32.unpack(raw)[0]
        repo = repos.get(bucket)
        if repo is None:
            raise StorageFault(f"{label}: {path} holds bucket {bucket}, which this service "
                               f"no longer stores")
        while True:
            raw = source.read(_U32.size)
            if len(raw) < _U32.size:
                raise damaged(f"bucket {bucket} truncated")
            length = _U32.unpack(raw)[0]
            if length == 0:
                break
            raw = source.read(_U32.size)
            payload = source.read(length)
            if len(raw) < _U32.size or len(payload) < length:
                raise damaged(f"bucket {bucket} truncated")
            if zlib.crc32(payload) != _U32.unpack(raw)[0]:
                raise damaged(f"checksum mismatch in bucket {bucket}")
            try:
                flat = msgpack.unpackb(payload, raw=True, use_list=True)
            except (ValueError, msgpack.UnpackException) as exc:
                raise damaged(f"bucket {bucket}: {exc}") from None
            if not isinstance(flat, list) or len(flat) % 2:
                raise damaged(f"bucket {bucket}: a chunk is not a list of pairs")
            for index in range(0, len(flat), 2):
                repo.put(flat[index], flat[index + 1])
            records += len(flat) // 2
    if source.read(1):
        raise damaged("bytes after the last bucket")
    return records


def remove(home: str) -> None:
    """Delete the snapshot (once its records are back in memory)."""
    _remove_quietly(snapshot_path(home))


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _sync_directory(path: str) -> None:
    directory = os.open(path, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
