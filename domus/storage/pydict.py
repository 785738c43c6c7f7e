"""Platform ``python-dict``: a Python dict per bucket, in RAM."""

from __future__ import annotations

from domus.storage.base import MappingRepository


class DictRepository(dict, MappingRepository):  # type: ignore[misc]
    """A dict that is a Repository.  ``get`` and ``contains`` are the dict's
    own C methods, so the service hot path pays no Python call for them."""

    get = dict.get
    contains = dict.__contains__
