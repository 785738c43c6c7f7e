"""domus.service.replycache: the cache that makes a retried change apply once."""

import pytest

from domus.client import transport
from domus.client.evented import EventedChannel
from domus.service.replycache import DEFAULT_TTL, ReplyCache, cache_key

TTL = DEFAULT_TTL
HALF = TTL / 2


class FakeClock:
    def __init__(self, now=1000.0):
        self.now = now

    def __call__(self):
        return self.now


def token(number, client=1):
    return number.to_bytes(4, "big") + client.to_bytes(8, "big")


def test_a_stored_reply_is_returned_for_its_token():
    cache = ReplyCache(clock=FakeClock())
    cache.put(token(1), b"reply-1")
    assert cache.get(token(1)) == b"reply-1"
    assert len(cache) == 1


def test_an_unknown_token_gets_none():
    cache = ReplyCache(clock=FakeClock())
    cache.put(token(1), b"reply-1")
    assert cache.get(token(2)) is None
    assert cache.get(token(1, client=2)) is None   # same request id, other client


def test_hits_count_only_found_tokens_in_either_generation():
    cache = ReplyCache(clock=FakeClock())
    cache.put(token(1), b"r")
    cache.rotate()
    cache.put(token(2), b"r")
    cache.get(token(1))
    cache.get(token(2))
    cache.get(token(3))
    assert cache.hits == 2


def test_the_first_reply_for_a_token_is_kept_even_across_a_rotation():
    # A retry is answered with what the first try answered, whatever a later
    # put for the same token carries.
    cache = ReplyCache(clock=FakeClock())
    cache.put(token(1), b"first")
    cache.put(token(1), b"second")
    assert cache.get(token(1)) == b"first"
    cache.rotate()
    cache.put(token(1), b"third")
    assert cache.get(token(1)) == b"first"
    assert len(cache) == 1


def test_an_empty_reply_is_a_cached_reply():
    cache = ReplyCache(clock=FakeClock())
    cache.put(token(1), b"")
    assert cache.get(token(1)) == b""
    cache.rotate()
    assert cache.get(token(1)) == b""


def test_a_reply_outlives_the_longest_client_retry():
    # docs/protocol.md: clients stop retrying after at most 15 s, and an
    # entry lives at least ttl / 2.
    assert transport.MAX_DEADLINE <= DEFAULT_TTL / 2
    # (the Twisted and asyncio clients' channels: however long they are told to wait)
    patient = EventedChannel("s1", "127.0.0.1:7701", requests=None, deadline=1e9)
    assert patient.deadline <= DEFAULT_TTL / 2
    assert ReplyCache().ttl == DEFAULT_TTL


def test_a_ttl_too_short_for_the_clients_retries_is_refused():
    with pytest.raises(ValueError, match="before clients stop retrying"):
        ReplyCache(ttl=2 * transport.MAX_DEADLINE - 1)
    ReplyCache(ttl=2 * transport.MAX_DEADLINE)      # the least that is safe


def test_rotation_keeps_the_generations_list_and_moves_current_to_previous():
    # The C hot path holds the list itself: it must be changed in place.
    cache = ReplyCache(clock=FakeClock())
    generations = cache.generations
    cache.put(token(1), b"r1")
    current = generations[0]
    assert cache.rotate() == 0
    assert cache.generations is generations
    assert generations[1] is current
    assert generations[0] == {}
    cache.put(token(2), b"r2")
    assert generations[0] == {token(2): b"r2"}
    assert cache.rotate() == 1                       # token 1 forgotten
    assert generations == [{}, {token(2): b"r2"}]


def test_entries_live_between_half_the_ttl_and_the_ttl():
    clock = FakeClock()
    cache = ReplyCache(clock=clock)                  # first rotation due at +15 s
    cache.put(token(1), b"early")                    # lives the longest: ~30 s
    clock.now += HALF - 0.001
    cache.put(token(2), b"late")                     # lives the shortest: 15 s
    assert cache.expire() == 0
    clock.now += 0.001                               # +15 s: rotation
    assert cache.expire() == 0
    assert cache.get(token(1)) == b"early"
    assert cache.get(token(2)) == b"late"
    clock.now += HALF - 0.001                        # token 2 is 15 s old: still kept
    assert cache.expire() == 0
    assert cache.get(token(2)) == b"late"
    clock.now += 0.001                               # +30 s: second rotation
    assert cache.expire() == 2
    assert cache.get(token(1)) is None
    assert cache.get(token(2)) is None
    assert len(cache) == 0


def test_expire_with_nothing_due_is_a_no_op():
    clock = FakeClock()
    cache = ReplyCache(clock=clock)
    cache.put(token(1), b"r")
    for _ in range(14):
        clock.now += 1
        assert cache.expire() == 0
    assert cache.generations == [{token(1): b"r"}, {}]


def test_a_late_timer_does_not_shorten_the_next_rotation_interval():
    clock = FakeClock()
    cache = ReplyCache(clock=clock)
    clock.now += HALF + 5                             # the timer ran 5 s late
    cache.expire()                                    # rotation at +20 s
    cache.put(token(1), b"r")
    clock.now += HALF - 1                             # +34 s: 14 s after it
    assert cache.expire() == 0
    assert cache.get(token(1)) == b"r"
    clock.now += 1
    assert cache.expire() == 0                        # rotation at +35 s
    clock.now += HALF
    assert cache.expire() == 1                        # gone 30 s after it came


def test_an_expired_token_can_be_stored_again():
    clock = FakeClock()
    cache = ReplyCache(clock=clock)
    cache.put(token(1), b"old")
    cache.rotate()
    cache.rotate()
    assert cache.get(token(1)) is None
    cache.put(token(1), b"new")
    assert cache.get(token(1)) == b"new"


def test_a_full_cache_refuses_new_entries_and_drops_none_before_its_time():
    # Issue 15: past 500k entries in 15 s, entries used to go early, and a
    # late retry was applied twice.  Now a full current generation refuses
    # (the handler answers BUSY) and every entry lives at least ttl / 2.
    clock = FakeClock()
    cache = ReplyCache(max_entries=6, clock=clock)   # the current generation holds 3
    for number in range(3):
        assert cache.put(token(number), b"a")
    assert cache.full()
    assert not cache.put(token(3), b"b")
    assert cache.refused == 1
    assert cache.get(token(3)) is None
    assert cache.put(token(0), b"again")               # there already: fine, kept
    clock.now += HALF - 0.001
    assert cache.expire() == 0 and cache.full()        # no rotation before its time
    assert [cache.get(token(n)) for n in range(3)] == [b"a"] * 3
    clock.now += 0.001
    assert cache.expire() == 0                         # rotated: nothing was old enough
    assert not cache.full() and cache.put(token(3), b"b")
    clock.now += HALF
    assert cache.expire() == 3                         # tokens 0..2, after ttl / 2 at least
    assert cache.get(token(3)) == b"b"


def test_whatever_the_rate_an_entry_outlives_the_retry_deadline():
    clock = FakeClock()
    cache = ReplyCache(max_entries=100, clock=clock)
    stored_at = {}
    for step in range(4000):                           # 400 puts a second, far past the cap
        clock.now += 0.0025 * 10
        cache.expire()
        if cache.put(token(step), b"r") and token(step) not in stored_at:
            stored_at[token(step)] = clock.now
        for kept, at in stored_at.items():
            if clock.now - at <= transport.MAX_DEADLINE:
                assert cache.get(kept) == b"r"
    assert cache.refused > 0


def test_the_key_ties_a_reply_to_the_whole_request():
    seed = 99
    request = bytes(range(40))
    other = request[:-1] + b"\xff"                     # same token, other body
    assert cache_key(request, seed)[:12] == request[4:16]
    assert cache_key(request, seed) != cache_key(other, seed)
    assert cache_key(request, seed) != cache_key(request, seed + 1)
    assert len(cache_key(request, seed)) == 20
    cache = ReplyCache(clock=FakeClock(), seed=seed)
    assert cache.key(request) == cache_key(request, seed)
    assert ReplyCache().seed != ReplyCache().seed       # drawn at random
