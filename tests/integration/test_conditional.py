"""pop and setdefault against other clients: each is one conditional step
on the service (DELETE_IF, PUT_IF_ABSENT), so neither loses a value another
client wrote at the same time (docs/protocol.md, *Conditional changes*)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import domus
from domus.wire import protocol as wire

from .support import CLIENT_TIMEOUT, wait_until


def test_pop_never_deletes_a_value_written_after_it_read(any_cluster, shared_deployment):
    # Another client writes between the pop's read and its delete: the
    # value read is not the one there any more, so it is not deleted; the
    # pop reads again and takes (returns and deletes) the new one.  Read,
    # then delete, returned "first" and deleted "second" unseen.
    any_cluster.create_dht("pop-race")
    dht = any_cluster.open_dht("pop-race")
    dht["job"] = "first"
    inner = dht.aio if hasattr(dht, "aio") else dht
    original = inner._request
    written = []

    def meddled(op, key, value=None):
        if op in (wire.OP_DELETE, wire.OP_DELETE_IF) and not written:
            with domus.connect(shared_deployment.supervisor_address,
                               timeout=CLIENT_TIMEOUT) as other:
                other.open_dht("pop-race")["job"] = "second"
            written.append(True)
        return original(op, key, value)

    inner._request = meddled
    try:
        assert dht.pop("job") == "second"
    finally:
        inner._request = original
    assert written and "job" not in dht
    assert dht.pop("job", "gone") == "gone"
    with pytest.raises(KeyError):
        dht.pop("job")


def test_setdefault_stores_a_default_once_and_keeps_what_is_there(any_cluster):
    any_cluster.create_dht("setdefault")
    dht = any_cluster.open_dht("setdefault")
    default = {"a": [1, 2]}
    assert dht.setdefault("k", default) == default
    assert dht.setdefault("k", "other") == default
    assert dht["k"] == default
    dht["k"] = "changed"
    assert dht.setdefault("k", "other") == "changed"
    del dht["k"]
    assert dht.setdefault("k") is None and "k" in dht and dht["k"] is None
    big = bytes(range(256)) * 1000          # (over a datagram: PUT_IF_ABSENT over TCP)
    assert dht.setdefault("big", big) == big
    assert dht.setdefault("big", b"small") == big
    assert dht.pop("big") == big and "big" not in dht


def test_clients_racing_for_one_key_all_get_the_one_default_stored(shared_cluster,
                                                                    shared_deployment):
    shared_cluster.create_dht("claims", buckets=4)
    address = shared_deployment.supervisor_address
    claims = [f"claim-{number}" for number in range(30)]
    got: dict[int, list] = {}
    start = threading.Barrier(4)

    def claimer(index: int) -> None:
        with domus.connect(address, timeout=CLIENT_TIMEOUT) as own:
            dht = own.open_dht("claims")
            start.wait()
            got[index] = [dht.setdefault(claim, f"worker-{index}") for claim in claims]

    threads = [threading.Thread(target=claimer, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    stored = shared_cluster.open_dht("claims").get_many(claims)
    for position, claim in enumerate(claims):
        assert {got[index][position] for index in range(4)} == {stored[claim]}, claim


def test_every_item_produced_is_popped_exactly_once_or_left(shared_cluster, shared_deployment):
    # Producers put items on a few slots with setdefault (an item is
    # produced only if its slot was free); consumers pop the slots.  Every
    # item produced is popped by exactly one consumer or still in its slot
    # at the end: none is deleted unseen, none handed out twice.
    shared_cluster.create_dht("slots", buckets=4)
    address = shared_deployment.supervisor_address
    slots = [f"slot-{number}" for number in range(3)]
    produced: list[list[str]] = [[], []]
    popped: list[list[str]] = [[], []]
    errors: list[BaseException] = []
    stop = threading.Event()

    def producer(index: int) -> None:
        serial = itertools.count()
        with domus.connect(address, timeout=CLIENT_TIMEOUT) as own:
            dht = own.open_dht("slots")
            while not stop.is_set():
                try:
                    for slot in slots:
                        item = f"p{index}-{next(serial)}"
                        if dht.setdefault(slot, item) == item:
                            produced[index].append(item)
                except Exception as exc:  # none is allowed
                    errors.append(exc)
                    return

    def consumer(index: int) -> None:
        with domus.connect(address, timeout=CLIENT_TIMEOUT) as own:
            dht = own.open_dht("slots")
            while not stop.is_set() or any(slot in dht for slot in slots):
                try:
                    for slot in slots:
                        item = dht.pop(slot, None)
                        if item is not None:
                            popped[index].append(item)
                except Exception as exc:  # none is allowed
                    errors.append(exc)
                    return

    threads = [threading.Thread(target=producer, args=(index,)) for index in range(2)]
    threads += [threading.Thread(target=consumer, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: sum(map(len, popped)) >= 600 or errors, timeout=60,
                   what="600 items popped")
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert [repr(exc) for exc in errors] == []
    made = [item for items in produced for item in items]
    taken = [item for items in popped for item in items]
    # (a producer may fill a slot after the consumers found them all empty)
    left = list(shared_cluster.open_dht("slots").get_many(slots).values())
    assert len(taken) == len(set(taken)), "an item was handed to two consumers"
    assert not set(taken) & set(left), "an item was popped and is still there"
    assert sorted(taken + left) == sorted(made), "an item produced was lost or one appeared"


def test_popitem_hands_each_record_to_one_client(shared_cluster, shared_deployment):
    shared_cluster.create_dht("items", buckets=4)
    dht = shared_cluster.open_dht("items")
    with pytest.raises(KeyError, match="empty"):
        dht.popitem()
    dht.put_many({number: f"v{number}" for number in range(200)})
    address = shared_deployment.supervisor_address
    got: list[list[tuple]] = [[], [], []]

    def popper(index: int) -> None:
        with domus.connect(address, timeout=CLIENT_TIMEOUT) as own:
            mine = own.open_dht("items")
            while True:
                try:
                    got[index].append(mine.popitem())
                except KeyError:
                    return

    threads = [threading.Thread(target=popper, args=(index,)) for index in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    items = [item for popped in got for item in popped]
    assert sorted(items) == [(number, f"v{number}") for number in range(200)]
    assert len(dht) == 0


def test_the_work_queue_example_computes_every_chunk_once(shared_cluster, shared_deployment):
    # clients/work_queue.py: three tasks at once claim chunks with
    # setdefault; each chunk is computed by one task.  A claim left by a
    # task that died is named by --collect and freed by --release, and a
    # task run again computes that chunk.
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, **shared_deployment.environment())
    command = [sys.executable, str(root / "clients" / "work_queue.py"), "--dht", "queue-example",
               "--items", "3000", "--chunk", "100"]
    shared_cluster.create_dht("queue-example", buckets=8)
    shared_cluster.open_dht("queue-example")[("claim", 29)] = "a task that died"
    tasks = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    outputs = [task.communicate(timeout=120)[0] for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0, 0], outputs
    computed = sorted(int(output.split("computed ")[1].split(" of")[0]) for output in outputs)
    assert sum(computed) == 29, outputs             # (chunk 29 is the dead task's)
    collect = subprocess.run([*command, "--collect"], env=env, capture_output=True, text=True,
                             timeout=120)
    assert collect.returncode == 1 and "claimed and undone: [29]" in collect.stdout
    released = subprocess.run([*command, "--release"], env=env, capture_output=True,
                              text=True, timeout=120)
    assert "released 1 chunks" in released.stdout, released.stdout + released.stderr
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert "computed 1 of 30 chunks" in again.stdout, again.stdout + again.stderr
    collect = subprocess.run([*command, "--collect"], env=env, capture_output=True, text=True,
                             timeout=120)
    assert collect.returncode == 0 and "3,000 of 3,000 results" in collect.stdout, collect.stdout
    dht = shared_cluster.open_dht("queue-example")
    claims = dht.get_many([("claim", chunk) for chunk in range(30)])
    done = dht.get_many([("done", chunk) for chunk in range(30)])
    assert {key[1]: worker for key, worker in claims.items()} == \
        {key[1]: worker for key, worker in done.items()}


def test_changes_to_a_replicated_dht_wait_longer_before_they_sleep(shared_cluster,
                                                                    monkeypatch):
    """A change to a DHT with copies is answered once its backup has it, so
    its first try spins REPLICATED_SPIN for the reply (docs/architecture.md,
    "Waiting for a reply"); a read, or any request to a DHT of one copy,
    spins the usual SPIN.  Seen on the real requests, which still succeed."""
    from domus.client import transport
    spins = []
    original = transport.ServiceChannel.request

    def noted(self, message, dht="", bucket=None, spin=None):
        spins.append((dht, message[2], spin))
        return original(self, message, dht, bucket, spin)

    shared_cluster.create_dht("spin-copies", buckets=16, replicas=2)
    shared_cluster.create_dht("spin-one", buckets=16)
    monkeypatch.setattr(transport.ServiceChannel, "request", noted)
    for name in ("spin-copies", "spin-one"):
        dht = shared_cluster.open_dht(name)
        dht["k"] = 1
        assert dht["k"] == 1
        assert dht.setdefault("d", 2) == 2
        assert dht.pop("k") == 1
        del dht["d"]
    longer = transport.REPLICATED_SPIN
    assert longer > transport.SPIN or transport.SPIN == 0
    by_dht = {name: [(op, spin) for dht, op, spin in spins if dht == name]
              for name in ("spin-copies", "spin-one")}
    changes = {wire.OP_PUT, wire.OP_PUT_IF_ABSENT, wire.OP_DELETE_IF, wire.OP_DELETE}
    assert changes | {wire.OP_GET} == {op for op, _spin in by_dht["spin-copies"]}
    assert all(spin == (longer if op in changes else None)
               for op, spin in by_dht["spin-copies"]), by_dht
    assert by_dht["spin-one"] == [(op, None) for op, _spin in by_dht["spin-copies"]]
