"""Client-side throttling of a service that answers BUSY.

A service that sheds load answers ``BUSY`` (domus.wire.protocol), and a
client sends the refused request again after a backoff.  Under a sustained
overload that alone is not enough: every request refused comes back, and
each refusal (a read, a MAC check and a send) costs the service a part of
what serving costs, so a service offered twice what it can serve spends a
growing share of its CPU refusing.  So each client also holds requests back
*itself* once a service has begun to refuse, in proportion to how much it
refuses (the adaptive throttling of Google's SRE book, "Handling
Overload"): over the last few seconds it counts the requests it wanted to
send to the service (``attempts``) and those the service took (``taken``:
answered with anything but BUSY), and holds a new one back with
probability::

    max(0, (attempts - K * taken) / (attempts + 1))

A request held back is treated as if the service had answered BUSY with a
retry-after of HOLD_PAUSE_MS (the counts change over seconds, so trying
again much sooner would mostly be held again): it is backed off and tried
again, and fails as ServiceBusy at the client's deadline.  While the
service takes everything it is sent, the probability is 0 and nothing is
held; with K = 1.25, a service refusing a fifth of what it is sent or less
is not throttled at all, and an overloaded one receives about K times what
it serves, so its refusals stay a small share of its work.  With fewer than
MIN_ATTEMPTS attempts in the window nothing is held (a short burst of BUSY
is only backed off).  The counts decay with a time constant of ``DECAY``
seconds; once a client has seen no BUSY for ``REST`` seconds the throttle
is off again, and then costs two additions per request.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable

K = 1.25        # how much more than the service takes a client still sends
DECAY = 2.0     # seconds: the counts' time constant
REST = 3 * DECAY  # seconds without a BUSY after which the throttle is off
MIN_ATTEMPTS = 16.0  # fewer attempts in the window say too little: none held
HOLD_PAUSE_MS = 500  # a request held back waits at least this long (its retry-after)


class Throttle:
    """One client's view of one service (not locked: a lost update between
    threads only blurs a statistic).  While off, it only counts attempts
    and replies taken (two additions per request); when the first BUSY
    arms it, those raw counts, scaled to the window, are where the decaying
    counts start."""

    __slots__ = ("attempts", "taken", "stamp", "since", "last_busy", "armed", "held",
                 "clock", "random")

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 draw: Callable[[], float] = random.random) -> None:
        self.clock = clock
        self.random = draw
        self.attempts = 0.0
        self.taken = 0.0
        self.stamp = self.since = clock()
        self.last_busy = 0.0
        self.armed = False       # a BUSY was seen within the last REST seconds
        self.held = 0            # requests held back, in all

    def allow(self) -> bool:
        """Whether to send a request now (False: hold it back, as if BUSY)."""
        self.attempts += 1.0
        if not self.armed:
            return True
        now = self.clock()
        if now - self.last_busy > REST:
            self.armed = False
            self.attempts = self.taken = 0.0
            self.since = now
            return True
        elapsed = now - self.stamp
        if elapsed > 0:
            factor = math.exp(-elapsed / DECAY)
            self.attempts *= factor
            self.taken *= factor
            self.stamp = now
        if self.attempts < MIN_ATTEMPTS:
            return True
        refuse = (self.attempts - K * self.taken) / (self.attempts + 1.0)
        if refuse > 0 and self.random() < refuse:
            self.held += 1
            return False
        return True

    def answered(self, busy: bool) -> None:
        """The service answered a request: BUSY (``busy``) or anything else."""
        if not busy:
            self.taken += 1.0
            return
        now = self.clock()
        self.last_busy = now
        if not self.armed:
            # (the counts so far, as the window would hold them)
            scale = min(1.0, DECAY / max(now - self.since, 1e-3))
            self.attempts *= scale
            self.taken *= scale
            self.stamp = now
            self.armed = True
