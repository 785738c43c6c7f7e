"""The service's data path: the C one (domus._hotpath) or the pure-Python one.

``FastPath`` is the C type when it is built and not switched off, else None;
a service then serves every request with the Python handler alone, which is
what the C path must be indistinguishable from (see cext/hotpath.c and
tests/unit/test_hotpath.py).

Berkeley DB repositories derive from ``domus._hotpath.DatabaseRepository``
when this path is C, so that FastPath calls their database's methods itself
(see domus.storage.bsddb, which makes the same choice by the same rule).

Set ``DOMUS_PURE_PYTHON=1`` in the environment to force the Python path (for
measurements, or to rule the C code out when hunting a bug).
"""

from __future__ import annotations

import os
from typing import Any

from domus.storage.pydict import DictRepository

PURE_PYTHON = os.environ.get("DOMUS_PURE_PYTHON") == "1"

FastPath: Any = None
ReplyTables: Any = None  # the C reply cache's tables (domus.service.replycache)
SAMPLE_EVERY = 16        # (the C path's own, when it is built)
if not PURE_PYTHON:
    try:
        from domus._hotpath import SAMPLE_EVERY, FastPath  # noqa: F401 (re-exported)
        from domus._hotpath import ReplyCache as ReplyTables
    except ImportError:  # not built: the Python path serves alone
        FastPath = ReplyTables = None


def record_tree_type() -> type | None:
    """The C RecordTree type whose instances (domus-rbt buckets) the C path
    drives, if it is built."""
    try:
        from domus._recordtree import RecordTree
    except ImportError:
        return None
    return RecordTree  # type: ignore[no-any-return]


def make_fast_path(dhts: dict[int, tuple[dict[int, Any], int]],
                   reply_cache: Any, key: bytes | None = None) -> Any:
    """A C FastPath over ``dhts`` (active DHT id -> (bucket -> repository,
    numbering << 8 | layout tag)) and ``reply_cache``, checking datagrams'
    MACs with ``key`` (None: an insecure deployment); None when the Python
    path must serve alone: the C path is not built or switched off, or
    ``reply_cache`` is not the C one (domus.service.replycache.
    CompactReplyCache, which C reads and fills itself), as when a caller
    gives a handler the pure-Python ReplyCache."""
    if FastPath is None or not isinstance(reply_cache, ReplyTables):
        return None
    return FastPath(dhts, reply_cache, record_tree_type(), dict_type=DictRepository, key=key)
