"""The reply cache: how a retried change is applied once.

UDP requests are retried when their reply does not arrive in time.  A retry
of a change (put, delete, put_many) that was already applied must not be
applied again: between the first try and the retry another client may have
written the same key, and applying the stale retry would undo that write.

Invariant: a change request whose (request id, client id) token is in the
cache is never applied again; its cached reply is sent instead.

The cache is two generations of plain dicts, ``generations = [current,
previous]``, so that the C hot path (domus._hotpath) can read and fill it
without calling Python: a token is looked up in both, a new reply goes into
``current``.  Every ``ttl / 2`` seconds ``rotate`` drops ``previous``, makes
``current`` the previous generation and starts an empty one, changing the
list in place (the C side holds the list itself).  An entry therefore lives
between ``ttl / 2`` and ``ttl`` seconds (plus the timer's period, since
``expire`` is polled).  Clients stop retrying a request within
``domus.wire.protocol.MAX_DEADLINE`` (``REPLY_CACHE_TTL / 2`` = 15 s) of its first
send, and its reply is stored after that first send, so no retry can arrive
after its entry is gone; the constructor refuses a ``ttl`` that would break
this.  The margin is small by design when a retry is sent just before the
deadline *and* its reply was stored just before a rotation; it is the time
the first try took to reach the service plus the time left until the next
rotation.

The cache is also capped: when the current generation grows past
``max_entries / 2`` it rotates early, and the entries of the previous
generation it drops are added to ``evicted_early`` (a non-zero count means
the cap is too small for the request rate: such entries may have lived less
than ``ttl / 2``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from domus.wire.protocol import MAX_DEADLINE, REPLY_CACHE_TTL

DEFAULT_TTL = REPLY_CACHE_TTL
DEFAULT_MAX_ENTRIES = 1_000_000


class ReplyCache:
    def __init__(self, ttl: float = DEFAULT_TTL, max_entries: int = DEFAULT_MAX_ENTRIES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl / 2 < MAX_DEADLINE:
            raise ValueError(f"a reply cache with ttl {ttl}s may forget a reply after "
                             f"{ttl / 2}s, before clients stop retrying ({MAX_DEADLINE}s); "
                             f"use a ttl of at least {2 * MAX_DEADLINE}s")
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, not {max_entries}")
        self.ttl = ttl
        self.max_entries = max_entries
        # The most entries the current generation holds before an early
        # rotation; the C hot path declines a change that would pass it.
        self.current_limit = max_entries // 2
        self._clock = clock
        self.generations: list[dict[bytes, bytes]] = [{}, {}]
        self._next_rotation = clock() + ttl / 2
        self.evicted_early = 0
        self.hits = 0

    def get(self, token: bytes) -> bytes | None:
        current, previous = self.generations
        cached = current.get(token)
        if cached is None:
            cached = previous.get(token)
        if cached is not None:
            self.hits += 1
        return cached

    def put(self, token: bytes, reply: bytes) -> None:
        """Keep the reply of a change; the first reply kept for a token stays."""
        current, previous = self.generations
        if token in current or token in previous:
            return
        current[token] = reply
        if len(current) > self.current_limit:
            self.evicted_early += self.rotate()

    def rotate(self) -> int:
        """Forget the previous generation and start a new current one;
        returns how many entries were forgotten."""
        generations = self.generations
        dropped = len(generations[1])
        generations[1] = generations[0]
        generations[0] = {}
        self._next_rotation = self._clock() + self.ttl / 2
        return dropped

    def expire(self) -> int:
        """Rotate if ``ttl / 2`` has passed since the last rotation; called
        from a timer.  Returns how many entries were forgotten."""
        if self._clock() < self._next_rotation:
            return 0
        return self.rotate()

    def __len__(self) -> int:
        current, previous = self.generations
        return len(current) + len(previous)
