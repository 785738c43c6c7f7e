"""domus.service.replycache: the cache that makes a retried change apply once."""

from domus.service.replycache import DEFAULT_TTL, ReplyCache


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


def test_hits_count_only_found_tokens():
    cache = ReplyCache(clock=FakeClock())
    cache.put(token(1), b"r")
    cache.get(token(1))
    cache.get(token(1))
    cache.get(token(2))
    assert cache.hits == 2


def test_the_first_reply_for_a_token_is_kept():
    # A retry is answered with what the first try answered, whatever a later
    # put for the same token carries.
    cache = ReplyCache(clock=FakeClock())
    cache.put(token(1), b"first")
    cache.put(token(1), b"second")
    assert cache.get(token(1)) == b"first"
    assert len(cache) == 1


def test_an_empty_reply_is_a_cached_reply():
    cache = ReplyCache(clock=FakeClock())
    cache.put(token(1), b"")
    assert cache.get(token(1)) == b""


def test_default_ttl_outlives_the_longest_client_retry():
    # docs/protocol.md: clients stop retrying after at most 15 s.
    assert DEFAULT_TTL >= 2 * 15
    assert ReplyCache().ttl == DEFAULT_TTL


def test_entries_live_ttl_seconds():
    clock = FakeClock()
    cache = ReplyCache(ttl=30.0, clock=clock)
    cache.put(token(1), b"r1")
    clock.now += 10
    cache.put(token(2), b"r2")
    clock.now += 19.999                   # token 1 is 29.999 s old
    assert cache.expire() == 0
    assert cache.get(token(1)) == b"r1"
    clock.now += 0.001                    # token 1 is exactly 30 s old
    assert cache.expire() == 1
    assert cache.get(token(1)) is None
    assert cache.get(token(2)) == b"r2"
    clock.now += 10
    assert cache.expire() == 1
    assert cache.get(token(2)) is None
    assert len(cache) == 0


def test_expire_with_nothing_due_is_a_no_op():
    clock = FakeClock()
    cache = ReplyCache(ttl=5.0, clock=clock)
    assert cache.expire() == 0
    cache.put(token(1), b"r")
    assert cache.expire() == 0
    assert len(cache) == 1


def test_an_expired_token_can_be_stored_again():
    clock = FakeClock()
    cache = ReplyCache(ttl=5.0, clock=clock)
    cache.put(token(1), b"old")
    clock.now += 5
    cache.expire()
    cache.put(token(1), b"new")
    assert cache.get(token(1)) == b"new"
    clock.now += 4
    assert cache.expire() == 0
    assert cache.get(token(1)) == b"new"


def test_expiry_is_not_extended_by_a_repeated_put():
    clock = FakeClock()
    cache = ReplyCache(ttl=5.0, clock=clock)
    cache.put(token(1), b"r")
    clock.now += 3
    cache.put(token(1), b"r")
    clock.now += 2
    assert cache.expire() == 1
    assert len(cache) == 0


def test_the_cap_evicts_the_oldest_and_counts_it():
    clock = FakeClock()
    cache = ReplyCache(ttl=30.0, max_entries=3, clock=clock)
    for number in range(5):
        cache.put(token(number), b"r%d" % number)
        clock.now += 1
    assert len(cache) == 3
    assert cache.evicted_early == 2
    assert cache.get(token(0)) is None
    assert cache.get(token(1)) is None
    assert [cache.get(token(n)) for n in (2, 3, 4)] == [b"r2", b"r3", b"r4"]


def test_under_the_cap_nothing_is_evicted_early():
    cache = ReplyCache(max_entries=3, clock=FakeClock())
    for number in range(3):
        cache.put(token(number), b"r")
    cache.put(token(0), b"again")        # already there: not a new entry
    assert len(cache) == 3
    assert cache.evicted_early == 0


def test_expiry_after_early_eviction_counts_each_entry_once():
    clock = FakeClock()
    cache = ReplyCache(ttl=10.0, max_entries=2, clock=clock)
    for number in range(4):
        cache.put(token(number), b"r")
    assert cache.evicted_early == 2
    clock.now += 10
    assert cache.expire() == 2
    assert len(cache) == 0
    assert cache.expire() == 0
