"""domus.service.replycache: the cache that makes a retried change apply once.

Every test runs on both implementations: the pure-Python ``ReplyCache`` and
the compact C one (``CompactReplyCache``, domus._hotpath's tables), which
must not be told apart by anything their callers use.
"""

import os
import random

import pytest

from domus.client import transport
from domus.client.evented import EventedChannel
from domus.service import replycache
from domus.service.replycache import DEFAULT_TTL, cache_key
from domus.wire import protocol as wire

TTL = DEFAULT_TTL
HALF = TTL / 2


@pytest.fixture(params=["python", "c"])
def ReplyCache(request):
    if request.param == "python":
        return replycache.ReplyCache
    if replycache.CompactReplyCache is None:
        pytest.skip("domus._hotpath is not built (or DOMUS_PURE_PYTHON=1): no C reply cache")
    return replycache.CompactReplyCache


class FakeClock:
    def __init__(self, now=1000.0):
        self.now = now

    def __call__(self):
        return self.now


def token(number, client=1):
    """A cache key as ReplyCache.key makes them: the token (request id,
    client id), then 8 bytes of hash."""
    return (number.to_bytes(4, "big") + client.to_bytes(8, "big")
            + (number * 0x9E3779B97F4A7C15 % 2**64).to_bytes(8, "big"))


def test_a_stored_reply_is_returned_for_its_token(ReplyCache):
    cache = ReplyCache(clock=FakeClock())
    cache.put(token(1), b"reply-1")
    assert cache.get(token(1)) == b"reply-1"
    assert len(cache) == 1


def test_an_unknown_token_gets_none(ReplyCache):
    cache = ReplyCache(clock=FakeClock())
    cache.put(token(1), b"reply-1")
    assert cache.get(token(2)) is None
    assert cache.get(token(1, client=2)) is None   # same request id, other client


def test_hits_count_only_found_tokens_in_either_generation(ReplyCache):
    cache = ReplyCache(clock=FakeClock())
    cache.put(token(1), b"r")
    cache.rotate()
    cache.put(token(2), b"r")
    cache.get(token(1))
    cache.get(token(2))
    cache.get(token(3))
    assert cache.hits == 2


def test_the_first_reply_for_a_token_is_kept_even_across_a_rotation(ReplyCache):
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


def test_an_empty_reply_is_a_cached_reply(ReplyCache):
    cache = ReplyCache(clock=FakeClock())
    cache.put(token(1), b"")
    assert cache.get(token(1)) == b""
    cache.rotate()
    assert cache.get(token(1)) == b""


def test_a_reply_outlives_the_longest_client_retry(ReplyCache):
    # docs/protocol.md: clients stop retrying after at most 15 s, and an
    # entry lives at least ttl / 2.
    assert transport.MAX_DEADLINE <= DEFAULT_TTL / 2
    # (the Twisted and asyncio clients' channels: however long they are told to wait)
    patient = EventedChannel("s1", "127.0.0.1:7701", requests=None, deadline=1e9)
    assert patient.deadline <= DEFAULT_TTL / 2
    assert ReplyCache().ttl == DEFAULT_TTL


def test_a_ttl_too_short_for_the_clients_retries_is_refused(ReplyCache):
    with pytest.raises(ValueError, match="before clients stop retrying"):
        ReplyCache(ttl=2 * transport.MAX_DEADLINE - 1)
    ReplyCache(ttl=2 * transport.MAX_DEADLINE)      # the least that is safe


def test_rotation_moves_current_to_previous_and_forgets_the_previous(ReplyCache):
    cache = ReplyCache(clock=FakeClock())
    cache.put(token(1), b"r1")
    assert cache.rotate() == 0
    assert cache.snapshot() == [{}, {token(1): b"r1"}]
    cache.put(token(2), b"r2")
    assert cache.snapshot() == [{token(2): b"r2"}, {token(1): b"r1"}]
    assert cache.rotate() == 1                       # token 1 forgotten
    assert cache.snapshot() == [{}, {token(2): b"r2"}]
    assert len(cache) == 1


def test_entries_live_between_half_the_ttl_and_the_ttl(ReplyCache):
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


def test_expire_with_nothing_due_is_a_no_op(ReplyCache):
    clock = FakeClock()
    cache = ReplyCache(clock=clock)
    cache.put(token(1), b"r")
    for _ in range(14):
        clock.now += 1
        assert cache.expire() == 0
    assert cache.snapshot() == [{token(1): b"r"}, {}]


def test_a_late_timer_does_not_shorten_the_next_rotation_interval(ReplyCache):
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


def test_an_expired_token_can_be_stored_again(ReplyCache):
    clock = FakeClock()
    cache = ReplyCache(clock=clock)
    cache.put(token(1), b"old")
    cache.rotate()
    cache.rotate()
    assert cache.get(token(1)) is None
    cache.put(token(1), b"new")
    assert cache.get(token(1)) == b"new"


def test_a_full_cache_refuses_new_entries_and_drops_none_before_its_time(ReplyCache):
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


def test_whatever_the_rate_an_entry_outlives_the_retry_deadline(ReplyCache):
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


def test_the_key_ties_a_reply_to_the_whole_request(ReplyCache):
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


def reply(status, number, body=b"", tag=0):
    return bytes((wire.REPLY_MAGIC, wire.VERSION, status, tag)) + number.to_bytes(4, "big") + body


# Replies of every shape: a single-key change's (kept inline by the C
# cache), a PUT_MANY's, and anything else put() may be given.
SHAPES = [
    lambda n: reply(wire.ST_OK, n, b"\x01"),
    lambda n: reply(wire.ST_OK, n, b"\x00", tag=7),
    lambda n: reply(wire.ST_NOT_FOUND, n),
    lambda n: reply(wire.ST_OK, n, b"\x00\x03\x00\x02"),          # PUT_MANY
    lambda n: reply(wire.ST_OK, n + 1, b"\x01"),                     # another request id
    lambda n: b"\xd0" + reply(wire.ST_OK, n)[1:],                    # not a reply header
    lambda n: reply(wire.ST_OK, n, b"\x01\x02"),
    lambda n: b"",
    lambda n: b"abc",
    lambda n: reply(wire.ST_OK, n, bytes(range(256)) * 8),
]


@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_every_shape_of_reply_comes_back_as_it_was_put(ReplyCache, shape):
    cache = ReplyCache(max_entries=200, clock=FakeClock())
    for number in range(50):
        assert cache.put(token(number), SHAPES[shape](number))
    cache.rotate()
    for number in range(50, 90):
        assert cache.put(token(number), SHAPES[shape](number))
    assert [cache.get(token(n)) for n in range(90)] == [SHAPES[shape](n) for n in range(90)]
    assert len(cache) == 90
    assert cache.discard(token(3)) and cache.discard(token(60))
    assert not cache.discard(token(3))
    assert cache.get(token(3)) is None and cache.get(token(60)) is None
    assert len(cache) == 88


def test_a_key_is_twenty_bytes_in_both(ReplyCache):
    cache = ReplyCache(clock=FakeClock())
    assert len(cache.key(bytes(range(30)))) == 20


def test_rotation_frees_what_the_previous_generation_held(ReplyCache):
    cache = ReplyCache(max_entries=40_000, clock=FakeClock())
    for number in range(20_000):
        cache.put(token(number), SHAPES[number % 4](number))
    assert cache.full() and len(cache) == 20_000
    memory = getattr(cache, "memory", None)
    cache.rotate()
    assert len(cache) == 20_000 and not cache.full()
    cache.rotate()
    assert len(cache) == 0
    assert cache.get(token(5)) is None
    if memory is not None:                       # the C cache: its tables are freed
        assert cache.memory < memory / 10


def test_the_c_cache_keeps_a_single_key_reply_in_thirty_bytes_when_full():
    if replycache.CompactReplyCache is None:
        pytest.skip("no C reply cache")
    cache = replycache.CompactReplyCache(max_entries=200_000, clock=FakeClock())
    for number in range(100_000):
        assert cache.put(token(number), SHAPES[number % 3](number))
    assert cache.full()
    # (24-byte slots, at most 4/5 full: the last doubling stops at the size
    # that holds the current generation's limit)
    assert cache.memory <= 100_000 * 30 + 100
    cache.rotate()
    # A steady rate: the next generation starts at the size the last one
    # reached (an eighth more), not at the bottom.
    cache.put(token(10**6), SHAPES[0](10**6))
    assert cache.memory <= 2 * (100_000 * 30 + 100)


def _skip_unless_faults_are_ours():
    if replycache.CompactReplyCache is None:
        pytest.skip("no C reply cache")
    if "libasan" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("under AddressSanitizer, whose shadow memory and quarantine of freed "
                    "blocks fault pages of their own, the page faults counted are not the "
                    "cache's")


def test_the_c_cache_pays_for_a_growths_new_pages_before_it_needs_them():
    # A growing table's inserts land all over its new array, so a fresh
    # array's pages, each costing the kernel a few microseconds when first
    # written, were all faulted in by the few thousand inserts right after
    # the growth: on a busy service, 100 ms at half speed and a queue.
    # The next array is made and its pages touched a few per insert while
    # the table still has room: no stretch of inserts faults more than a
    # fraction of the largest array, and nothing kept is lost on the way.
    _skip_unless_faults_are_ours()
    import resource

    cache = replycache.CompactReplyCache(max_entries=2_400_000, clock=FakeClock())
    window, worst, count = 10_000, 0, 1_000_000
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for number in range(count):
        assert cache.put(token(number), SHAPES[0](number))
        if number % window == window - 1:
            now = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            worst, before = max(worst, now - before), now
    # The last growth (1.0M to 1.5M slots of 24 bytes): 8,800 pages.  Made
    # as it was needed, some 6,000 of them faulted in the first window.
    largest_pages = 1_500_000 * 24 // 4096
    assert worst < largest_pages // 4, (worst, largest_pages)
    for number in range(0, count, 997):
        assert cache.get(token(number)) == SHAPES[0](number)
    assert len(cache) == count


def test_discards_do_not_make_the_next_array_fault_in_at_once():
    # The next array's pages are touched in step with the entries added
    # since it was made; with fewer entries than then (changes whose replies
    # were discarded), the next insert touches a page or so, not all of them.
    _skip_unless_faults_are_ours()
    import resource

    cache = replycache.CompactReplyCache(max_entries=2_000_000, clock=FakeClock())
    for number in range(25_000):
        assert cache.put(token(number), SHAPES[0](number))
    # (39,366 slots and, made ahead, the next array's 59,049)
    assert cache.memory == (39_366 + 59_049) * 24
    for number in range(5_000):
        assert cache.discard(token(number))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    assert cache.put(token(10**6), SHAPES[0](10**6))
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 59_049 * 24 // 4096 // 4, faults    # (346 pages)


def test_the_c_cache_readies_the_next_generations_array_before_the_rotation():
    # The same at a rotation: a new generation starts at the size the last
    # one reached, in the array the rotation drops when that one fits, else
    # in a fresh one whose pages the first inserts would all fault in.
    # PREPARE_AHEAD seconds before the rotation, expire() has the cache make
    # that array and the inserts touch its pages until the rotation.
    _skip_unless_faults_are_ours()
    import resource

    clock = FakeClock()
    cache = replycache.CompactReplyCache(ttl=TTL, max_entries=8_000_000, clock=clock)
    number = 0

    def insert(count):
        nonlocal number
        for _ in range(count):
            assert cache.put(token(number), SHAPES[0](number))
            number += 1

    insert(600_000)                                 # 600,000 over 10 s
    clock.now += HALF - replycache.PREPARE_AHEAD
    memory = cache.memory
    assert cache.expire() == 0
    # (15/10 of 600,000 expected, an eighth more, at most 4/5 full: 1.27M
    # slots of 24 bytes, 29 MiB)
    assert cache.memory - memory >= 1_200_000 * 24
    insert(300_000)
    clock.now += replycache.PREPARE_AHEAD
    assert cache.expire() == 0                      # (the first rotation drops nothing)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    insert(100_000)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    # Made at the rotation instead, the array's 7,400 pages: nearly all of
    # them in these 100,000 inserts.
    assert faults < 1_270_000 * 24 // 4096 // 4, faults
    for kept in range(0, number, 991):
        assert cache.get(token(kept)) == SHAPES[0](kept)
    assert len(cache) == number


def test_both_caches_answer_alike_through_any_sequence_of_calls():
    # The C cache's tables (linear probing, growth, deletion that moves
    # entries back) held to the dicts: random calls, small tables, many
    # collisions, every answer and the contents compared throughout.
    if replycache.CompactReplyCache is None:
        pytest.skip("no C reply cache")
    rng = random.Random(17)
    # (40,000: its tables grow several times, each growth moving entries a
    # few per insert while lookups, puts and discards go on)
    for max_entries in (2, 7, 100, 3000, 40_000):
        seed = rng.getrandbits(64)
        caches = [replycache.ReplyCache(max_entries=max_entries, clock=FakeClock(), seed=seed),
                  replycache.CompactReplyCache(max_entries=max_entries, clock=FakeClock(),
                                               seed=seed)]
        keys = [token(n, client=rng.randrange(3)) for n in range(2 * max_entries + 20)]
        for step in range(6000 if max_entries < 10_000 else 60_000):
            action = rng.random()
            key = rng.choice(keys)
            if action < (0.5 if max_entries < 10_000 else 0.7):
                made = SHAPES[rng.randrange(len(SHAPES))](rng.randrange(1000))
                answers = [cache.put(key, made) for cache in caches]
            elif action < 0.8:
                answers = [cache.get(key) for cache in caches]
            elif action < 0.95:
                answers = [cache.discard(key) for cache in caches]
            elif action < (0.99 if max_entries < 10_000 else 0.9995):
                answers = [cache.full() for cache in caches]
            else:
                answers = [cache.rotate() for cache in caches]
            assert answers[0] == answers[1], f"step {step}"
            if step % 5000 == 0:
                assert caches[0].snapshot() == caches[1].snapshot()
        assert caches[0].snapshot() == caches[1].snapshot()
        assert [len(c) for c in caches] == [len(caches[0])] * 2
        assert caches[0].refused == caches[1].refused
        assert caches[0].hits == caches[1].hits
        assert caches[0].key(b"x" * 40) == caches[1].key(b"x" * 40)


def test_restore_puts_back_a_snapshot(ReplyCache):
    cache = ReplyCache(max_entries=6, clock=FakeClock())
    cache.put(token(1), SHAPES[0](1))
    cache.rotate()
    cache.put(token(2), SHAPES[3](2))
    saved = cache.snapshot()
    for number in range(3, 6):
        cache.put(token(number), b"x")
    cache.rotate()
    cache.restore(saved)
    assert cache.snapshot() == saved
    assert len(cache) == 2 and not cache.full()


def test_a_steady_rate_reuses_the_c_cache_arrays_and_forgets_nothing_early_or_late():
    # At a steady rate a generation starts in the array of the one dropped
    # (its slots of the old epoch read as empty), for 62 generations, then
    # in a fresh one: through 70 rotations the C cache holds what the dicts
    # hold, no stale entry comes back and none goes early.
    if replycache.CompactReplyCache is None:
        pytest.skip("no C reply cache")
    caches = [replycache.ReplyCache(max_entries=4000, clock=FakeClock()),
              replycache.CompactReplyCache(max_entries=4000, clock=FakeClock())]
    memory = []
    for generation in range(70):
        numbers = range(generation * 1500, (generation + 1) * 1500)
        for number in numbers:
            assert [cache.put(token(number), SHAPES[number % 3](number))
                    for cache in caches] == [True, True]
        for number in (numbers[0], numbers[-1], numbers[0] - 1500, numbers[0] - 1,
                       numbers[0] - 1501, numbers[0] - 3000):
            if number < 0:
                continue
            answers = [cache.get(token(number)) for cache in caches]
            assert answers[0] == answers[1]
            assert (answers[0] is not None) == (number >= numbers[0] - 1500)
        assert caches[0].snapshot() == caches[1].snapshot()
        assert [cache.rotate() for cache in caches] == [1500 if generation else 0] * 2
        memory.append(caches[1].memory)
    assert len(caches[1]) == 1500
    assert max(memory[2:]) == min(memory[2:])       # no array more, none less
