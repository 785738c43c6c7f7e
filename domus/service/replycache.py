"""The reply cache: how a retried change is applied once.

UDP requests are retried when their reply does not arrive in time.  A retry
of a change (put, delete, put_many) that was already applied must not be
applied again: between the first try and the retry another client may have
written the same key, and applying the stale retry would undo that write.

Invariant: a change request whose key is in the cache is never applied
again; its cached reply is sent instead.  And no entry leaves the cache
before ``ttl / 2`` seconds (>= MAX_DEADLINE, the longest a client retries),
whatever the request rate: when the cache is full of entries that young,
a new change is refused with BUSY (applied nowhere, cached nowhere: the
client backs off and sends it again) instead of an entry being dropped.

An entry's key is ``cache_key(request)``: the request's token (bytes 4-16:
request id and client id) and a hash of the whole request (XXH64 under a
seed this cache draws at random), so a different request sent under a
reused request id is applied as what it is, not answered with the reply of
another.  Only changes that were applied (OK, NOT_FOUND) are kept: a
request that does not parse, or is refused, changed nothing, and its retry
is judged afresh.

The cache is two generations: a key is looked up in both, a new reply goes
into the current one, and every ``ttl / 2`` seconds ``rotate`` drops the
previous generation and makes the current one previous.  An entry
therefore lives between ``ttl / 2`` and ``ttl`` seconds (plus the timer's
period, since ``expire`` is polled).  Clients stop retrying a request within
``domus.wire.protocol.MAX_DEADLINE`` (``REPLY_CACHE_TTL / 2`` = 15 s) of its
first send, and its reply is stored after that first send, so no retry can
arrive after its entry is gone; the constructor refuses a ``ttl`` that would
break this.

Two implementations keep this contract, chosen by ``new_reply_cache``:

- ``CompactReplyCache`` (the tables of ``domus._hotpath.ReplyCache``, in C),
  used whenever the C hot path is: each generation is an open-addressed
  table of 24-byte entries, the key and the reply inline (a single-key
  change's reply is its status and layout bytes, and at most one body byte:
  the rest is implied by the key), plus a small table of 32-byte entries
  whose reply has a buffer of its own (PUT_MANY's, 12 bytes).  The C path
  (``FastPath``) reads and fills it without a Python object per change;
  ``rotate`` drops a generation without touching its entries (its array is
  freed whole, or taken by the next generation).  A table
  grows by half as it fills (moving its entries a few per insert, so that
  no change waits for a whole table to move) and is 8/15 to 4/5 full, so an
  entry costs 30 to 45 bytes (30 once the generation is full: the last
  growth stops at the size that holds ``max_entries / 2``; about 34 at a
  steady rate, where a generation starts at the size the last one
  reached, in the array of the generation it drops: no page of it new to
  the process, whose first touch would cost the serving thread some 2 us a
  page).
- ``ReplyCache`` below, two plain dicts (about 155 bytes an entry), the
  pure-Python twin the C one is held to, used when the C path is not.

The current generation holds at most ``max_entries / 2`` entries (the most
changes the service takes in ``ttl / 2`` seconds: 4,000,000 by default
(``domus service --reply-cache-entries``), about 267,000 a second
sustained); past that, changes get BUSY until the next rotation (counted in
``refused``).  Worst case, both generations full of single-key replies, the
compact cache holds 8,000,000 x 30 bytes = 240 MB by default (two tables of
5,000,002 slots of 24 bytes; some 320 MB while the current one makes its
last growth, its old and new arrays both held); PUT_MANY replies cost 32
bytes of slot and a 16-byte buffer (with malloc's overhead, about 72 bytes)
each.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import xxhash

from domus.service import hotpath
from domus.wire.protocol import MAX_DEADLINE, REPLY_CACHE_TTL

DEFAULT_TTL = REPLY_CACHE_TTL
DEFAULT_MAX_ENTRIES = 8_000_000       # (domus.service.limits.REPLY_CACHE_ENTRIES)
TOKEN = slice(4, 16)


def cache_key(request: bytes, seed: int) -> bytes:
    """The key of ``request``'s reply: its token, then XXH64(request, seed)
    big-endian (the C path computes the same)."""
    return request[TOKEN] + xxhash.xxh64_intdigest(request, seed).to_bytes(8, "big")


def _check(ttl: float, max_entries: int) -> None:
    if ttl / 2 < MAX_DEADLINE:
        raise ValueError(f"a reply cache with ttl {ttl}s may forget a reply after "
                         f"{ttl / 2}s, before clients stop retrying ({MAX_DEADLINE}s); "
                         f"use a ttl of at least {2 * MAX_DEADLINE}s")
    if max_entries < 2:
        raise ValueError(f"max_entries must be at least 2, not {max_entries}")


# The C cache gets the next rotation's new generation ready this long
# before it (CompactReplyCache.prepare).
PREPARE_AHEAD = 5.0


def _random_seed() -> int:
    return int.from_bytes(os.urandom(8), "big")


class _Rotating:
    """Rotation by time, for both caches: ``rotate`` every ``ttl / 2``
    seconds, polled by ``expire`` (the cache's own ``rotate`` calls
    ``_rotated`` once it has turned its generations)."""

    def _start(self, ttl: float, max_entries: int, clock: Callable[[], float]) -> None:
        _check(ttl, max_entries)
        self.ttl = ttl
        self.max_entries = max_entries
        self._clock = clock
        self._next_rotation = clock() + ttl / 2
        self._prepared = False

    def _rotated(self) -> None:
        self._next_rotation = self._clock() + self.ttl / 2
        self._prepared = False

    def _prepare(self, elapsed: float, left: float) -> None:
        """Get ready for the rotation ``left`` seconds from now,
        ``elapsed`` seconds after the last (the C cache's tables)."""

    rotate: Callable[[], int]       # (each cache's own)

    def expire(self) -> int:
        """Rotate if ``ttl / 2`` has passed since the last rotation; called
        from a timer.  Returns how many entries were forgotten."""
        now = self._clock()
        if now < self._next_rotation:
            if not self._prepared and now >= self._next_rotation - PREPARE_AHEAD:
                self._prepared = True
                elapsed = now - (self._next_rotation - self.ttl / 2)
                if elapsed > 0:
                    self._prepare(elapsed, self._next_rotation - now)
            return 0
        return self.rotate()


class ReplyCache(_Rotating):
    """The pure-Python reply cache: two dicts (see the module's doc)."""

    def __init__(self, ttl: float = DEFAULT_TTL, max_entries: int = DEFAULT_MAX_ENTRIES,
                 clock: Callable[[], float] = time.monotonic, seed: int | None = None) -> None:
        self._start(ttl, max_entries, clock)
        # The most entries the current generation holds; past it, changes
        # are refused (BUSY) until the next rotation, in C and here alike.
        self.current_limit = max_entries // 2
        self.seed = _random_seed() if seed is None else seed
        self.generations: list[dict[bytes, bytes]] = [{}, {}]
        self.refused = 0
        self.hits = 0

    def key(self, request: bytes) -> bytes:
        return cache_key(request, self.seed)

    def get(self, key: bytes) -> bytes | None:
        current, previous = self.generations
        cached = current.get(key)
        if cached is None:
            cached = previous.get(key)
        if cached is not None:
            self.hits += 1
        return cached

    def full(self) -> bool:
        """Whether a new entry must wait for the next rotation (the change
        that would make it is refused: BUSY)."""
        return len(self.generations[0]) >= self.current_limit

    def put(self, key: bytes, reply: bytes) -> bool:
        """Keep the reply of a change; the first reply kept for a key stays.
        False if the cache is full (nothing kept: the caller must not have
        applied the change, see ``full``)."""
        current, previous = self.generations
        if key in current or key in previous:
            return True
        if len(current) >= self.current_limit:
            self.refused += 1
            return False
        current[key] = reply
        return True

    def discard(self, key: bytes) -> bool:
        """Forget the reply kept under ``key``, if any (what the C path does
        when the change a reply was kept for fails); whether there was one."""
        found = False
        for generation in self.generations:
            found = generation.pop(key, None) is not None or found
        return found

    def rotate(self) -> int:
        """Forget the previous generation and start a new current one;
        returns how many entries were forgotten."""
        generations = self.generations
        dropped = len(generations[1])
        generations[1] = generations[0]
        generations[0] = {}
        self._rotated()
        return dropped

    def __len__(self) -> int:
        current, previous = self.generations
        return len(current) + len(previous)

    def snapshot(self) -> list[dict[bytes, bytes]]:
        """[current, previous]: copies of the generations (for tests and the
        fuzzer, which compare caches)."""
        return [dict(generation) for generation in self.generations]

    def restore(self, snapshot: list[dict[bytes, bytes]]) -> None:
        """Make the generations hold exactly ``snapshot`` (as ``snapshot()``
        gives it), whatever ``current_limit`` says."""
        self.generations[:] = [dict(generation) for generation in snapshot]


if hotpath.ReplyTables is not None:
    class CompactReplyCache(_Rotating, hotpath.ReplyTables):  # type: ignore[misc, name-defined]
        """The reply cache in C (``domus._hotpath.ReplyCache``'s tables; see
        the module's doc), with the same constructor, methods and contract
        as ``ReplyCache``; the C path reads and fills it itself."""

        def __init__(self, ttl: float = DEFAULT_TTL, max_entries: int = DEFAULT_MAX_ENTRIES,
                     clock: Callable[[], float] = time.monotonic,
                     seed: int | None = None) -> None:
            self._start(ttl, max_entries, clock)      # (checks them first)
            super().__init__(max_entries // 2, _random_seed() if seed is None else seed)

        def rotate(self) -> int:
            """Forget the previous generation (its tables are freed whole) and
            start a new current one; returns how many entries were
            forgotten."""
            dropped: int = super().rotate()
            self._rotated()
            return dropped

        def _prepare(self, elapsed: float, left: float) -> None:
            self.prepare(elapsed, left)
else:
    CompactReplyCache = None


def new_reply_cache(ttl: float = DEFAULT_TTL, max_entries: int = DEFAULT_MAX_ENTRIES,
                    clock: Callable[[], float] = time.monotonic,
                    seed: int | None = None) -> Any:
    """A reply cache: the compact one in C when the C path is in use (it
    needs one to serve changes), else the pure-Python one."""
    if hotpath.FastPath is not None and CompactReplyCache is not None:
        return CompactReplyCache(ttl, max_entries, clock, seed)
    return ReplyCache(ttl, max_entries, clock, seed)
