"""Platform ``python-dict``: a Python dict per bucket, in RAM."""

from __future__ import annotations

from domus.storage.base import Repository


class DictRepository(dict, Repository):  # type: ignore[misc]
    """A dict that is a Repository.  ``get`` and ``contains`` are the dict's
    own C methods, so the service hot path pays no Python call for them."""

    get = dict.get
    contains = dict.__contains__

    def put(self, key: bytes, value: bytes) -> bool:
        created = key not in self
        self[key] = value
        return created

    def delete(self, key: bytes) -> bool:
        return self.pop(key, None) is not None

    def key_snapshot(self) -> list[bytes]:
        return list(self)
