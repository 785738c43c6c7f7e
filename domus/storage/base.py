"""The interface every storage platform implements.

A service keeps one ``Repository`` per bucket it stores.  Keys and values are
the opaque bytes of the protocol: a repository never decodes them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator


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
