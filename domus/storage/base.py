"""The interface every storage platform implements.

A service keeps one ``Repository`` per bucket it stores.  Keys and values are
the opaque bytes of the protocol: a repository never decodes them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class Repository(ABC):
    """The records of one bucket of one DHT."""

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

    def close(self) -> None:
        """Release what the repository holds (nothing, for RAM platforms)."""
