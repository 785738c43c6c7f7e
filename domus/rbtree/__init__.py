"""RBTree: an ordered mutable mapping kept in a red-black tree.

``RBTree`` is the C type ``domus._rbtree.RBTree`` when the extension is built
and the environment variable ``DOMUS_PURE_PYTHON`` is not ``"1"``; otherwise
it is the pure-Python reference ``domus.rbtree.reference.RBTree``, which behaves
the same (same methods, errors and messages) and is slower.
``C_EXTENSION`` says which one this is.

Keys are of one *kind*, fixed by the first key inserted and forgotten when the
tree becomes empty:

- ``"int"``: int and its subclasses (bool too), ordered by value;
- ``"bytes"``: exact bytes, ordered bytewise;
- ``"object"``: anything else; later keys must be instances of the first
  key's type, and are ordered by ``<``.

A key of another kind raises TypeError and changes nothing, in lookups too:
``key in tree`` and ``tree.get(key)`` raise rather than answer False/None.

Complexity (n items): getting, setting, deleting, ``in``, ``floor``,
``ceiling``, ``min``, ``max``, ``popitem`` and starting ``irange`` are
O(log n); a step of an iterator is O(1) amortized; ``copy`` is O(n).
Iterators raise RuntimeError once a key was inserted or removed; replacing
the value of a key does not disturb them.  See docs/rbtree.md.
"""

from __future__ import annotations

import os

if os.environ.get("DOMUS_PURE_PYTHON") == "1":
    from domus.rbtree.reference import RBTree

    C_EXTENSION = False
else:
    try:
        from domus._rbtree import RBTree
    except ImportError:
        from domus.rbtree.reference import RBTree  # type: ignore[assignment]

        C_EXTENSION = False
    else:
        C_EXTENSION = True

__all__ = ["RBTree", "C_EXTENSION"]
