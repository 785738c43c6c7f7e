"""domus.client.aio's datagram layer on a real asyncio loop and real UDP
sockets: the "service" is a socket in a thread of the test that answers,
drops or delays what it receives as each test says.  Timeouts are short
(tens of milliseconds) so that retries and deadlines happen quickly; the
assertions bound times from below only (a busy machine makes them later,
never earlier)."""

from __future__ import annotations

import asyncio
import contextvars
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from domus.client.aio import AioChannel, DatagramRequests
from domus.client.transport import next_timeout
from domus.errors import DomusError, ServiceUnavailable
from domus.wire import protocol as wire

try:
    import uvloop
except ImportError:         # (the test extra installs it; a bare install may not)
    uvloop = None

SLACK = 0.005       # clock reads of the test and of the client differ by this much at most


def request(request_id: int, body: bytes = b"") -> bytes:
    return wire.request_header(wire.OP_GET, request_id, 42) + body


def reply_to(message: bytes, body: bytes = b"") -> bytes:
    return wire.reply_prefix(wire.ST_OK) + message[4:8] + body


class Service:
    """A UDP socket in a thread: every datagram it receives is recorded
    with its time (``time.monotonic``, the asyncio loop's clock) and handed
    to ``answer(datagram, tries_of_its_id)``, which returns the datagrams to
    send back (none: the datagram is dropped)."""

    def __init__(self, answer: Callable[[bytes, int], list[bytes]]) -> None:
        self.answer = answer
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.02)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.received: list[tuple[float, bytes]] = []
        self.tries: dict[bytes, int] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                datagram, peer = self.sock.recvfrom(65536)
            except TimeoutError:
                continue
            self.received.append((time.monotonic(), datagram))
            tries = self.tries[datagram[4:8]] = self.tries.get(datagram[4:8], 0) + 1
            for answer in self.answer(datagram, tries):
                self.sock.sendto(answer, peer)

    def ids(self) -> list[int]:
        return [int.from_bytes(datagram[4:8], "big") for _when, datagram in self.received]

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        self.sock.close()


def silent(_datagram: bytes, _tries: int) -> list[bytes]:
    return []


def answering(datagram: bytes, _tries: int) -> list[bytes]:
    return [reply_to(datagram, datagram[4:8])]


@pytest.fixture
def service_with() -> Any:
    services: list[Service] = []

    def start(answer: Callable[[bytes, int], list[bytes]]) -> Service:
        services.append(Service(answer))
        return services[-1]

    yield start
    for service in services:
        service.close()


@pytest.fixture(params=["asyncio", pytest.param("uvloop", marks=pytest.mark.skipif(
    uvloop is None, reason="uvloop is not installed"))])
def run(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """``run(job, window)``: ``job(requests)`` on a fresh loop (asyncio's
    default, then uvloop's) with an open datagram layer, closed after it."""
    return lambda job, window=32: run_on(request.param, job, window)


def run_on(loop: str, job: Callable[[DatagramRequests], Any], window: int) -> Any:
    async def main() -> Any:
        requests = DatagramRequests(asyncio.get_running_loop(), window)
        await requests.open()
        try:
            return await job(requests)
        finally:
            requests.close()

    return uvloop.run(main()) if loop == "uvloop" else asyncio.run(main())


def channel_to(requests: DatagramRequests, service: Service, *, deadline: float = 5.0,
               first_timeout: float = 2.0, name: str = "s1") -> AioChannel:
    return AioChannel(name, service.address, requests=requests, deadline=deadline,
                      first_timeout=first_timeout)


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true in time"
        await asyncio.sleep(0.005)


# ---------------------------------------------------------------- retries

def test_a_lost_reply_is_retried_with_the_same_bytes(service_with, run) -> None:
    service = service_with(lambda datagram, tries: answering(datagram, tries) if tries == 2
                           else [])

    async def job(requests: DatagramRequests) -> None:
        channel = channel_to(requests, service, first_timeout=0.2)
        message = request(7, b"body")
        assert await channel.request(message, "words", 3) == reply_to(message, message[4:8])
        assert (channel.retries, channel.timeouts) == (1, 1)
        assert requests.pending == {}

    run(job)
    (first, sent), (second, resent) = service.received
    assert sent == resent == request(7, b"body")
    assert second - first >= 0.2 - SLACK


def test_retries_follow_the_rule_until_the_deadline(service_with, run) -> None:
    """First timeout, doubling, the last cut to end at the deadline; then
    ServiceUnavailable naming the service, the DHT and the bucket."""
    service = service_with(silent)

    async def job(requests: DatagramRequests) -> tuple[float, float, Exception]:
        channel = channel_to(requests, service, deadline=0.4, first_timeout=0.05)
        started = time.monotonic()
        with pytest.raises(ServiceUnavailable) as raised:
            await channel.request(request(9), "words", 7)
        assert requests.pending == {} and channel.in_flight == 0
        return started, time.monotonic(), raised.value

    started, ended, error = run(job)
    assert ended - started >= 0.4 - SLACK
    assert (error.service, error.dht, error.bucket) == ("s1", "words", 7)
    assert "did not answer within 0.4s" in str(error)
    times = [when for when, _datagram in service.received]
    # 0, 0.05, 0.15, 0.35 when nothing is late; a late clock makes the next
    # timeout shorter (the rest of the deadline), maybe a try more.
    assert len(times) >= 2
    timeout = 0.05
    for before, after in zip(times, times[1:]):
        assert after - before >= timeout - 4 * SLACK
        timeout = next_timeout(timeout, after - times[0], 0.4) or 0.0


def test_many_requests_with_lost_tries_each_get_their_own_reply(service_with, run) -> None:
    """Thousands through a window of 32, every 7th first try and every 21st
    second try lost: the retry clocks of first tries and of retries (whose
    timeouts differ) all run, and every reply goes to its own request."""
    def lossy(datagram: bytes, tries: int) -> list[bytes]:
        number = int.from_bytes(datagram[4:8], "big")
        if (tries == 1 and number % 7 == 0) or (tries == 2 and number % 21 == 0):
            return []
        return [reply_to(datagram, datagram[4:8])]

    service = service_with(lossy)

    async def job(requests: DatagramRequests) -> None:
        channel = channel_to(requests, service, first_timeout=0.05)
        messages = [request(number) for number in range(1, 2001)]
        replies = await asyncio.gather(*(channel.request(message, "words", 0)
                                         for message in messages))
        assert replies == [reply_to(message, message[4:8]) for message in messages]
        # (at least: on a busy machine a slow reply may be asked for again)
        assert channel.retries >= len(range(7, 2001, 7)) + len(range(21, 2001, 21))
        assert requests.pending == {} and channel.in_flight == 0

    run(job)


def test_answered_requests_leave_no_retry_clocks_behind(service_with, run) -> None:
    service = service_with(answering)

    async def job(requests: DatagramRequests) -> None:
        channel = channel_to(requests, service)
        await asyncio.gather(*(channel.request(request(number)) for number in range(500)))
        # (a clock of an answered request is dropped when the sweep passes it)
        await until(lambda: not any(requests._fifos.values()) and not requests._retries
                    and requests._timer is None)
        assert await channel.request(request(501)) == reply_to(request(501),
                                                               request(501)[4:8])
        assert channel.retries == 0

    run(job)


def test_a_reply_waiting_in_the_socket_beats_the_retry_clock(service_with, run) -> None:
    """The job kept the loop busy past the deadline while the reply sat unread."""
    service = service_with(answering)

    async def job(requests: DatagramRequests) -> None:
        channel = channel_to(requests, service, deadline=0.1, first_timeout=0.05)
        reply = channel.request(request(13), "words", 0)
        time.sleep(0.5)     # (the busy job: the loop runs nothing meanwhile)
        assert await reply == reply_to(request(13), request(13)[4:8])
        assert channel.retries == 0

    run(job)
    assert len(service.received) == 1


def test_a_late_reply_is_counted_and_dropped(service_with, run) -> None:
    service = service_with(lambda datagram, tries: [reply_to(datagram, b"first"),
                                                    reply_to(datagram, b"second")])

    async def job(requests: DatagramRequests) -> None:
        channel = channel_to(requests, service)
        assert await channel.request(request(11)) == reply_to(request(11), b"first")
        await until(lambda: requests.late_replies == 1)

    run(job)


def test_stray_datagrams_are_counted_and_dropped(service_with, run) -> None:
    junk = [b"", b"\xd1\x01", request(5), b"\x00" * 8]
    service = service_with(lambda datagram, tries: [*junk, reply_to(datagram)])

    async def job(requests: DatagramRequests) -> None:
        channel = channel_to(requests, service)
        assert await channel.request(request(5)) == reply_to(request(5))
        assert requests.stray == len(junk)

    run(job)


def test_replies_are_matched_by_id_in_any_order(service_with, run) -> None:
    held: list[bytes] = []

    def reversed_pairs(datagram: bytes, _tries: int) -> list[bytes]:
        held.append(datagram)
        if len(held) < 2:
            return []
        return [reply_to(message, message[4:8]) for message in reversed(held)]

    service = service_with(reversed_pairs)

    async def job(requests: DatagramRequests) -> None:
        channel = channel_to(requests, service, first_timeout=5.0)
        one, two = request(1), request(2)
        assert await asyncio.gather(channel.request(one), channel.request(two)) == [
            reply_to(one, one[4:8]), reply_to(two, two[4:8])]

    run(job)


# ---------------------------------------------------------------- waking the awaiting task

def test_each_task_resumes_in_its_own_context(service_with, run) -> None:
    """A reply wakes its task at once, from the socket's read callback: the
    task still runs in its own context (a ContextVar it set is what it
    reads back), not in the reader's or another task's."""
    held: list[bytes] = []

    def together(datagram: bytes, _tries: int) -> list[bytes]:
        held.append(datagram)   # (both replies go out at once: one read takes both)
        return [reply_to(message, message[4:8]) for message in held] if len(held) == 3 else []

    service = service_with(together)
    name: contextvars.ContextVar[str] = contextvars.ContextVar("name", default="none")

    async def job(requests: DatagramRequests) -> None:
        channel = channel_to(requests, service)

        async def one(number: int) -> tuple[str, bytes]:
            name.set(f"task {number}")
            reply = await channel.request(request(number))
            return name.get(), reply

        outcomes = await asyncio.gather(*(one(number) for number in range(3)))
        assert outcomes == [(f"task {number}", reply_to(request(number), request(number)[4:8]))
                            for number in range(3)]
        assert name.get() == "none"

    run(job)


def test_a_failing_callback_is_reported_and_the_others_still_run(service_with, run) -> None:
    """A done-callback of a reply that raises goes to the loop's exception
    handler, as a callback the loop ran would; the task awaiting the same
    reply gets it all the same, and a removed callback is never called."""
    service = service_with(answering)
    reported: list[dict[str, Any]] = []
    called: list[str] = []

    async def job(requests: DatagramRequests) -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context:
                                                         reported.append(context))
        channel = channel_to(requests, service)
        reply = channel.request(request(7))

        def failing(_future: asyncio.Future) -> None:
            called.append("failing")
            raise ValueError("a callback of the job's")

        def removed(_future: asyncio.Future) -> None:
            called.append("removed")

        reply.add_done_callback(failing)
        reply.add_done_callback(removed)
        assert reply.remove_done_callback(removed) == 1
        assert await reply == reply_to(request(7), request(7)[4:8])
        await until(lambda: bool(called))
        late: list[bytes] = []
        reply.add_done_callback(lambda future: late.append(future.result()))
        await until(lambda: bool(late))     # (added once done: scheduled, as asyncio does)
        assert late == [reply.result()]

    run(job)
    assert called == ["failing"]
    assert len(reported) == 1 and isinstance(reported[0]["exception"], ValueError)


@pytest.mark.timeout(60)   # (stepping the task from inside another would leave it stuck)
def test_a_reply_read_from_inside_a_task_wakes_the_other_task_later(service_with, run) -> None:
    """The socket may be read from inside a task (a sweep of retry clocks
    does not, but nothing forbids it): a reply that wakes another task is
    then scheduled for the loop's next turn, never stepped inside the
    running task (asyncio forbids entering a task from another)."""
    go = threading.Event()

    def when_told(datagram: bytes, tries: int) -> list[bytes]:
        go.wait(5)          # (the reply must not come while the loop polls)
        return answering(datagram, tries)

    service = service_with(when_told)

    async def job(requests: DatagramRequests) -> None:
        channel = channel_to(requests, service)
        reply = channel.request(request(9))

        async def waiting() -> bytes:
            return await reply

        awaiting = asyncio.ensure_future(waiting())
        await asyncio.sleep(0)          # (the task is awaiting the reply)
        go.set()                        # (from here this task does not yield until read)
        readable, _, _ = select.select([requests.sock], [], [], 5)   # (without yielding)
        assert readable, "the reply did not come"
        requests._readable()           # (from inside this task)
        assert reply.done() and not awaiting.done()
        assert await asyncio.wait_for(awaiting, 5) == reply_to(request(9), request(9)[4:8])

    run(job)


# ---------------------------------------------------------------- the window

def test_requests_waiting_behind_a_dead_service_fail_with_the_first(service_with, run) -> None:
    service = service_with(silent)

    async def job(requests: DatagramRequests) -> None:
        channel = channel_to(requests, service, deadline=0.2)
        outcomes = await asyncio.gather(*(channel.request(request(number), "words", number)
                                          for number in range(3)), return_exceptions=True)
        assert all(isinstance(error, ServiceUnavailable) for error in outcomes)
        assert [error.bucket for error in outcomes] == [0, 1, 2]
        assert requests.pending == {} and not channel.waiting and channel.in_flight == 0

    run(job, window=1)
    assert set(service.ids()) == {0}    # (the others never had their turn)


@pytest.mark.parametrize("how", ["task", "future"])
def test_cancelling_a_request_frees_its_slot(service_with, run, how) -> None:
    """Cancelled by the task awaiting it or directly (as ``gather`` does):
    the request leaves the table at once and the next one is sent."""
    service = service_with(lambda datagram, tries: answering(datagram, tries)
                           if datagram[4:8] != request(1)[4:8] else [])

    async def job(requests: DatagramRequests) -> None:
        channel = channel_to(requests, service)
        first = channel.request(request(1))
        second = channel.request(request(2))
        assert list(requests.pending) == [request(1)[4:8]] and channel.waiting
        if how == "task":
            async def awaiting() -> bytes:
                return await first

            task = asyncio.ensure_future(awaiting())
            await asyncio.sleep(0)      # (the task is awaiting the reply)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            first.cancel()
        assert first.cancelled()
        # (the second went out at once; awaiting the task may have let its reply in)
        assert request(1)[4:8] not in requests.pending and not channel.waiting
        assert service.ids()[-1:] == [2] or request(2)[4:8] in requests.pending
        assert await second == reply_to(request(2), request(2)[4:8])
        assert requests.pending == {} and channel.in_flight == 0

    run(job, window=1)


def test_close_fails_what_is_outstanding(service_with, run) -> None:
    service = service_with(silent)

    async def job(requests: DatagramRequests) -> None:
        channel = channel_to(requests, service)
        outstanding = [channel.request(request(number)) for number in range(3)]
        sock = requests.sock
        requests.close()
        for reply in outstanding:
            with pytest.raises(DomusError, match="closed before service s1 answered"):
                await reply
        with pytest.raises(DomusError, match="client is closed"):
            await channel.request(request(4))
        assert sock.fileno() == -1 and requests._timer is None
        requests.close()             # (twice is harmless)

    run(job, window=2)


# ---------------------------------------------------------------- BUSY

def busy_reply(message: bytes, retry_after_ms: int | None = None) -> bytes:
    body = b"" if retry_after_ms is None else retry_after_ms.to_bytes(2, "big")
    return wire.reply_prefix(wire.ST_BUSY) + message[4:8] + body


def test_busy_is_backed_off_and_the_same_bytes_sent_again(service_with, run) -> None:
    """A service that answers BUSY twice, then serves: the request is sent
    again after each backoff (at least half of 50 then 100 ms, jittered),
    never counted as a timeout, and gets its reply."""
    service = service_with(lambda datagram, tries: [busy_reply(datagram)] if tries <= 2
                           else answering(datagram, tries))

    async def job(requests: DatagramRequests) -> None:
        channel = channel_to(requests, service, first_timeout=1.0)
        message = request(21, b"x")
        started = time.monotonic()
        assert await channel.request(message) == reply_to(message, message[4:8])
        assert time.monotonic() - started >= 0.5 * (0.05 + 0.1) - SLACK
        assert (channel.busy, channel.timeouts, channel.retries) == (2, 0, 0)
        assert [datagram for _when, datagram in service.received] == [message] * 3
        assert not requests.pending and channel.in_flight == 0

    run(job)


def test_a_service_busy_until_the_deadline_is_service_busy(service_with, run) -> None:
    from domus.errors import ServiceBusy

    service = service_with(lambda datagram, tries: [busy_reply(datagram, 100)])

    async def job(requests: DatagramRequests) -> None:
        channel = channel_to(requests, service, deadline=0.6, first_timeout=0.2)
        with pytest.raises(ServiceBusy, match="service s1 .* too busy") as raised:
            await channel.request(request(22), "words", 3)
        assert (raised.value.dht, raised.value.bucket) == ("words", 3)
        assert channel.busy >= 2 and channel.timeouts == 0
        # (the retry-after of 100 ms is waited at least half of, each time)
        times = [when for when, _datagram in service.received]
        assert all(later - earlier >= 0.05 - SLACK for earlier, later in zip(times, times[1:]))
        assert not requests.pending and channel.in_flight == 0

    run(job)


def test_a_request_backing_off_keeps_its_window_slot(service_with, run) -> None:
    """With a window of one, a request waiting out a BUSY backoff holds the
    slot: the next request is sent only after the first is answered."""
    service = service_with(lambda datagram, tries: [busy_reply(datagram)]
                           if datagram[4:8] == (31).to_bytes(4, "big") and tries == 1
                           else answering(datagram, tries))

    async def job(requests: DatagramRequests) -> None:
        channel = channel_to(requests, service, first_timeout=1.0)
        first, second = request(31), request(32)
        replies = await asyncio.gather(channel.request(first), channel.request(second))
        assert replies == [reply_to(first, first[4:8]), reply_to(second, second[4:8])]
        assert service.ids() == [31, 31, 32]

    run(job, window=1)
