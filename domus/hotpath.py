"""The service's data path: the C one (domus._hotpath) or the pure-Python one.

``FastPath`` is the C type when it is built and not switched off, else None;
a service then serves every request with the Python handler alone, which is
what the C path must be indistinguishable from (see cext/hotpath.c and
tests/unit/test_hotpath.py).

``DatabaseRepository`` is the base of repositories kept in a database object
with Berkeley DB's calling conventions (domus.storage.bsddb): with the C
path, the C type that lets FastPath call the database's methods itself and
keep the repository's ``record_count``; without it, a Python class that
keeps only the count.

Set ``DOMUS_PURE_PYTHON=1`` in the environment to force the Python path (for
measurements, or to rule the C code out when hunting a bug).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from domus.service.replycache import ReplyCache

PURE_PYTHON = os.environ.get("DOMUS_PURE_PYTHON") == "1"


class _DatabaseRepository:
    """``DatabaseRepository`` without the C path: the record count alone,
    for a Python path that serves alone (nothing calls the database's
    methods from C, so nothing else is kept)."""

    def __init__(self, database: Any, *, no_overwrite: int, key_exists: type[BaseException],
                 not_found: type[BaseException]) -> None:
        self.record_count = 0


FastPath: Any = None
DatabaseRepository: Any = _DatabaseRepository
if not PURE_PYTHON:
    try:
        from domus._hotpath import DatabaseRepository, FastPath
    except ImportError:  # not built: the Python path serves alone
        FastPath = None
        DatabaseRepository = _DatabaseRepository


def rbtree_type() -> type | None:
    """The C RBTree type whose instances the C path drives, if it is built."""
    try:
        from domus._rbtree import RBTree
    except ImportError:
        return None
    return RBTree


def make_fast_path(dhts: dict[int, dict[int, Any]], reply_cache: ReplyCache) -> Any:
    """A C FastPath over ``dhts`` (active DHT id -> bucket -> repository) and
    ``reply_cache``; None when the Python path must serve alone."""
    if FastPath is None:
        return None
    from domus.storage.pydict import DictRepository

    return FastPath(dhts, reply_cache.generations, rbtree_type(),
                    current_limit=reply_cache.current_limit, dict_type=DictRepository)
