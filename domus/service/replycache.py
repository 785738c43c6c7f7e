"""The reply cache: how a retried change is applied once.

UDP requests are retried when their reply does not arrive in time.  A retry
of a change (put, delete, put_many) that was already applied must not be
applied again: between the first try and the retry another client may have
written the same key, and applying the stale retry would undo that write.

Invariant: a change request whose (request id, client id) token is in the
cache is never applied again; its cached reply is sent instead.  Entries live
``ttl`` seconds.  Clients stop retrying a request well before that (their
retry deadline is at most ``ttl / 2``, see domus.transport), so no retry can
arrive after its entry expired.  The cache is also capped in entries; when the
cap is hit the oldest entries go first, and the counter ``evicted_early``
says so (it means the cap is too small for the request rate).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

DEFAULT_TTL = 30.0
DEFAULT_MAX_ENTRIES = 1_000_000


class ReplyCache:
    def __init__(self, ttl: float = DEFAULT_TTL, max_entries: int = DEFAULT_MAX_ENTRIES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._clock = clock
        self._replies: dict[bytes, bytes] = {}
        self._expiry: deque[tuple[float, bytes]] = deque()
        self.evicted_early = 0
        self.hits = 0

    def get(self, token: bytes) -> bytes | None:
        cached = self._replies.get(token)
        if cached is not None:
            self.hits += 1
        return cached

    def put(self, token: bytes, reply: bytes) -> None:
        if token in self._replies:
            return
        self._replies[token] = reply
        self._expiry.append((self._clock() + self.ttl, token))
        if len(self._replies) > self.max_entries:
            _, oldest = self._expiry.popleft()
            self._replies.pop(oldest, None)
            self.evicted_early += 1

    def expire(self) -> int:
        """Drop entries past their time; called from a timer.  Returns how
        many went."""
        now = self._clock()
        expiry = self._expiry
        replies = self._replies
        dropped = 0
        while expiry and expiry[0][0] <= now:
            _, token = expiry.popleft()
            replies.pop(token, None)
            dropped += 1
        return dropped

    def __len__(self) -> int:
        return len(self._replies)
