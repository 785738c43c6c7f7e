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
from typing import TYPE_CHECKING, Any

from domus.storage.pydict import DictRepository

if TYPE_CHECKING:
    from domus.service.replycache import ReplyCache

PURE_PYTHON = os.environ.get("DOMUS_PURE_PYTHON") == "1"

FastPath: Any = None
SAMPLE_EVERY = 16        # (the C path's own, when it is built)
if not PURE_PYTHON:
    try:
        from domus._hotpath import SAMPLE_EVERY, FastPath  # noqa: F401 (re-exported)
    except ImportError:  # not built: the Python path serves alone
        FastPath = None


def record_tree_type() -> type | None:
    """The C RecordTree type whose instances (domus-rbt buckets) the C path
    drives, if it is built."""
    try:
        from domus._recordtree import RecordTree
    except ImportError:
        return None
    return RecordTree  # type: ignore[no-any-return]


def make_fast_path(dhts: dict[int, tuple[dict[int, Any], int]],
                   reply_cache: ReplyCache, key: bytes | None = None) -> Any:
    """A C FastPath over ``dhts`` (active DHT id -> (bucket -> repository,
    numbering << 8 | layout tag)) and ``reply_cache``, checking datagrams'
    MACs with ``key`` (None: an insecure deployment); None when the Python
    path must serve alone."""
    if FastPath is None:
        return None
    return FastPath(dhts, reply_cache.generations, record_tree_type(),
                    current_limit=reply_cache.current_limit, dict_type=DictRepository,
                    key=key, cache_seed=reply_cache.seed)
