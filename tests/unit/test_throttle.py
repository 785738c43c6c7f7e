"""The client's throttle (domus.client.throttle): nothing held while a
service takes what it is sent; under a sustained overload, the service is
sent about K times what it serves; off again once the BUSY answers stop."""

import random

import pytest

from domus.client import throttle as module
from domus.client.throttle import Throttle


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_service_that_takes_everything_is_never_throttled():
    clock = Clock()
    throttle = Throttle(clock)
    for _ in range(10_000):
        assert throttle.allow()
        throttle.answered(False)
        clock.now += 0.001
    assert (throttle.armed, throttle.held) == (False, 0)


def test_a_short_burst_of_busy_is_only_backed_off():
    clock = Clock()
    throttle = Throttle(clock, draw=lambda: 0.0)     # (holds whenever it may)
    for _ in range(3):
        assert throttle.allow()
        throttle.answered(True)
    assert throttle.armed
    # Fewer than MIN_ATTEMPTS attempts, none taken: still nothing held.
    assert all(throttle.allow() for _ in range(int(module.MIN_ATTEMPTS) - 4))
    assert throttle.held == 0


@pytest.mark.parametrize("capacity", [0.5, 0.25])
def test_an_overloaded_service_is_sent_about_k_times_what_it_serves(capacity):
    """A service that can take ``capacity`` of what the client wants to
    send (it refuses the rest): once the throttle has settled, what is sent
    is about K times what is taken, far less than what is wanted."""
    clock = Clock()
    draws = random.Random(7)
    throttle = Throttle(clock, draw=draws.random)
    served_credit = 0.0
    wanted = sent = taken = 0
    for step in range(40_000):            # 1,000 attempts a second for 40 s
        clock.now += 0.001
        served_credit = min(served_credit + capacity, 1.0)
        if not throttle.allow():
            continue
        busy = served_credit < 1.0
        if not busy:
            served_credit -= 1.0
        throttle.answered(busy)
        if step >= 20_000:                # (after 20 s: settled)
            wanted += 1
            sent += 1
            taken += not busy
    assert throttle.armed and throttle.held > 0
    assert taken > 0
    assert sent / taken == pytest.approx(module.K, rel=0.15)
    assert sent < 0.8 * 20_000            # far less than every attempt


def test_it_turns_off_once_the_service_stops_refusing():
    clock = Clock()
    throttle = Throttle(clock, draw=lambda: 0.0)
    for _ in range(100):
        throttle.allow()
        throttle.answered(True)
        clock.now += 0.01
    assert not throttle.allow()           # (attempts and no reply taken: held)
    clock.now += module.REST + 0.1        # no BUSY since
    assert throttle.allow() and not throttle.armed
    held = throttle.held
    for _ in range(1_000):
        assert throttle.allow()
        throttle.answered(False)
    assert throttle.held == held


def test_arming_starts_from_the_counts_so_far():
    """A client that had its requests taken for a while, then meets one
    BUSY: its history counts, so it does not hold what follows."""
    clock = Clock()
    throttle = Throttle(clock, draw=lambda: 0.0)
    for _ in range(5_000):
        throttle.allow()
        throttle.answered(False)
        clock.now += 0.001
    throttle.allow()
    throttle.answered(True)
    assert throttle.armed
    assert all(throttle.allow() for _ in range(50))
    assert throttle.held == 0
