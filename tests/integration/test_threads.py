"""One blocking client shared by many threads, as a ThreadPoolExecutor job
shares it: every thread's requests in flight side by side, each answered
with its own reply (never another thread's), every value checked against
what that thread wrote."""

from __future__ import annotations

import multiprocessing
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import domus

from .support import first_difference

THREADS = 16
OPERATIONS = 100_000
SEED = 2026


class ThreadWork:
    """One thread's random operations on its own keys (``t<n>-...``) of a
    shared Dht, checked against its own dict.  Values name the thread and
    the operation that wrote them, so a reply meant for another thread, or
    an older one of this thread's, is a mismatch."""

    def __init__(self, dht: domus.Dht, thread: int, operations: int) -> None:
        self.dht = dht
        self.thread = thread
        self.operations = operations
        self.rng = random.Random(SEED * 100 + thread)
        self.model: dict[Any, Any] = {}
        self.keys = [f"t{thread}-{n}" for n in range(300)] + \
            [(thread << 20) + n for n in range(100)]
        self.done = 0

    def value(self) -> Any:
        kind = self.rng.random()
        if kind < 0.5:
            return [self.thread, self.done]
        if kind < 0.8:
            return {"thread": self.thread, "op": self.done, "pad": "x" * self.rng.randint(0, 60)}
        return f"{self.thread}:{self.done}".encode() * self.rng.randint(1, 20)

    def check(self, what: str, actual: Any, expected: Any) -> None:
        assert actual == expected, (f"thread {self.thread}, op #{self.done} {what}: got "
                                    f"{actual!r:.120}, expected {expected!r:.120}")

    def run(self) -> int:
        rng, dht, model = self.rng, self.dht, self.model
        for done in range(self.operations):
            self.done = done
            key = rng.choice(self.keys)
            kind = rng.random()
            if kind < 0.35:
                value = self.value()
                self.check(f"put({key!r})", dht.put(key, value), key not in model)
                model[key] = value
            elif kind < 0.70:
                self.check(f"get({key!r})", dht.get(key, "absent"), model.get(key, "absent"))
            elif kind < 0.80:
                self.check(f"delete({key!r})", dht.delete(key), key in model)
                model.pop(key, None)
            elif kind < 0.88:
                self.check(f"{key!r} in dht", key in dht, key in model)
            elif kind < 0.94:
                items = {rng.choice(self.keys): self.value() for _ in range(rng.randint(1, 30))}
                new = sum(key not in model for key in items)
                self.check("put_many", dht.put_many(items), new)
                model.update(items)
            else:
                wanted = [rng.choice(self.keys) for _ in range(rng.randint(1, 30))]
                expected = {key: model[key] for key in wanted if key in model}
                problems = first_difference(dht.get_many(wanted), expected)
                assert not problems, f"thread {self.thread}, op #{self.done} get_many: {problems}"
        return self.operations


@pytest.mark.timeout(240)
def test_sixteen_threads_share_one_client(shared_cluster):
    dht = shared_cluster.create_dht("threads", buckets=64)
    works = [ThreadWork(dht, thread, OPERATIONS // THREADS) for thread in range(THREADS)]
    started = time.monotonic()
    with ThreadPoolExecutor(THREADS) as pool:
        done = sum(pool.map(ThreadWork.run, works))
    elapsed = time.monotonic() - started
    assert done == OPERATIONS
    expected: dict[Any, Any] = {}
    for work in works:
        expected.update(work.model)
    assert first_difference(dict(dht.items()), expected) == []
    assert len(dht) == len(expected)
    print(f"{OPERATIONS} operations from {THREADS} threads on one client in {elapsed:.1f}s "
          f"({OPERATIONS / elapsed:,.0f} ops/s, machine shared)")


@pytest.mark.timeout(120)
def test_threads_share_a_cached_lookup_strategy(shared_cluster):
    """C,R: the lookup cache and its distributed lookups are shared too."""
    shared_cluster.create_dht("threads-cached", buckets=256)
    dht = shared_cluster.open_dht("threads-cached", lookup="C,R", cache=0.25)
    works = [ThreadWork(dht, thread, 1_000) for thread in range(8)]
    with ThreadPoolExecutor(8) as pool:
        assert sum(pool.map(ThreadWork.run, works)) == 8_000
    expected: dict[Any, Any] = {}
    for work in works:
        expected.update(work.model)
    assert first_difference(dht.get_many(list(expected)), expected) == []
    stats = dht.stats()
    assert stats["cache"]["entries"] <= stats["cache"]["capacity"]
    assert stats["lookups"]["C"]["hits"] > 0


@pytest.mark.timeout(120)
def test_a_process_forked_while_threads_work_gets_its_own_sockets(shared_cluster):
    dht = shared_cluster.create_dht("threads-fork")
    stop = threading.Event()
    failures: list[BaseException] = []

    def busy(thread: int) -> None:
        try:
            number = 0
            while not stop.is_set():
                dht[f"busy{thread}-{number % 50}"] = number
                assert dht[f"busy{thread}-{number % 50}"] == number
                number += 1
        except BaseException as exc:
            failures.append(exc)

    def child() -> None:
        for number in range(300):
            dht[f"child-{number}"] = number
        ok = dht.get_many([f"child-{n}" for n in range(300)]) == {
            f"child-{n}": n for n in range(300)}
        raise SystemExit(0 if ok else 3)

    threads = [threading.Thread(target=busy, args=(thread,)) for thread in range(4)]
    for thread in threads:
        thread.start()
    try:
        process = multiprocessing.get_context("fork").Process(target=child)
        process.start()
        process.join(60)
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert process.exitcode == 0
    assert not failures, failures
    assert dht["child-299"] == 299


def test_threads_popping_the_same_keys_with_a_default_never_get_key_error(shared_cluster):
    """dict.pop(key, default) never raises KeyError, however many threads
    pop: a Dht's pop reads the value, then deletes the key, and the thread
    whose delete finds the key gone (another took it in between) gets the
    default.  Each key's value goes to exactly one thread."""
    dht = shared_cluster.create_dht("pops")
    keys = [f"p{number}" for number in range(300)]
    dht.put_many({key: key.upper() for key in keys})
    taken: dict[int, list[Any]] = {}

    def pop_all(thread: int) -> None:
        order = keys[:]
        random.Random(thread).shuffle(order)
        taken[thread] = [dht.pop(key, None) for key in order]

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(pop_all, range(8)))
    values = [value for popped in taken.values() for value in popped if value is not None]
    assert sorted(values) == sorted(key.upper() for key in keys)
    assert len(dht) == 0
    with pytest.raises(KeyError):
        dht.pop("p0")
