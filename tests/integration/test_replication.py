"""Replication with real processes (issue 14): writers put into a
replicated RAM DHT while services are killed with SIGKILL and started
again; every acknowledged write reads back with its value, and the writers
see no error (a request that meets a dead primary waits for its backup to
take over and is sent again).  With one copy, a restarted service's buckets
raise DataLost, never KeyError, until the loss is accepted."""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import signal
import socket
import struct
import threading
import time

import pytest

import domus
from domus.errors import DataLost
from domus.wire import auth
from domus.wire import protocol as wire

from .conftest import TrackedDeployment, start_deployment
from .support import (
    CLIENT_TIMEOUT,
    first_difference,
    owner_of,
    service_addresses,
    service_stats,
    wait_until,
)


class Writer:
    """Puts from its own client until stopped (new keys, and every fifth
    write an earlier key again), keeping the last acknowledged value of
    every key, and every error with when it came."""

    def __init__(self, address: str, name: str, tag: str, lookup: str) -> None:
        self.acknowledged: dict[str, int] = {}
        self.errors: list[tuple[float, BaseException]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(address, name, tag, lookup))
        self._thread.start()

    def _run(self, address: str, name: str, tag: str, lookup: str) -> None:
        with domus.connect(address, timeout=CLIENT_TIMEOUT) as own:
            dht = own.open_dht(name, lookup=lookup)
            number = 0
            while not self._stop.is_set():
                key = f"{tag}{number // 5 if number % 5 == 4 else number}"
                try:
                    dht[key] = number
                except Exception as exc:  # counted: the test says what it allows
                    self.errors.append((time.monotonic(), exc))
                    self._stop.wait(0.05)
                else:
                    self.acknowledged[key] = number
                number += 1

    def written(self) -> int:
        return len(self.acknowledged)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)
        assert not self._thread.is_alive(), "a writer did not stop"


def keeps_writing(writers: list[Writer], more: int = 300) -> None:
    marks = [writer.written() for writer in writers]
    wait_until(lambda: all(writer.written() >= mark + more
                           for writer, mark in zip(writers, marks)),
               timeout=60, what="the writers to go on")


def replication(cluster: domus.Cluster, name: str) -> dict:
    return cluster.dht_info(name)["replication"]


def restart(deployment: TrackedDeployment, name: str) -> None:
    deployment.start_service(deployment.service_index(name))
    deployment.wait_until_up([name], timeout=30)


def check_everything(cluster: domus.Cluster, name: str, writers: list[Writer],
                     base: dict[int, int]) -> None:
    expected = {key: value for writer in writers for key, value in writer.acknowledged.items()}
    fresh = cluster.open_dht(name)
    assert first_difference(fresh.get_many(list(expected)), expected) == []
    assert fresh.get_many(list(base)) == base
    assert len(fresh) == len(expected) + len(base)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("copies, killed_together", [(2, 1), (3, 2)])
def test_no_acknowledged_write_is_lost_when_services_die(tmp_path, copies, killed_together):
    deployment = start_deployment(tmp_path, services=4)        # manual balancer
    writers: list[Writer] = []
    try:
        with domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as cluster:
            cluster.create_dht("copies", buckets=32, replicas=copies)
            view = replication(cluster, "copies")
            assert view["replicas"] == copies and view["missing_copies"] == 0
            assert all(len(set(part["holders"])) == copies for part in view["copies"])
            base = {number: number for number in range(5_000)}
            cluster.open_dht("copies").put_many(base)
            writers = [Writer(deployment.supervisor_address, "copies", tag, lookup)
                       for tag, lookup in (("a", "D"), ("b", "D,C,R"))]
            keeps_writing(writers)
            # Kill; writes go on; start the dead ones again (empty: RAM);
            # wait for every copy to be whole again; then kill others.
            for victims in (["s2", "s3"][:killed_together], ["s4", "s1"][:killed_together]):
                for victim in victims:
                    deployment.kill_service(victim, signal.SIGKILL)
                keeps_writing(writers)
                for victim in victims:
                    restart(deployment, victim)
                wait_until(lambda: replication(cluster, "copies")["missing_copies"] == 0,
                           timeout=90, what="the missing copies to be repaired")
                keeps_writing(writers)
    finally:
        for writer in writers:
            writer.stop()
    try:
        for writer in writers:
            assert [repr(exc) for _at, exc in writer.errors] == []
        with domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as cluster:
            check_everything(cluster, "copies", writers, base)
        with open(deployment.log_path("supervisor"), encoding="utf-8") as log:
            said = log.read()
        assert said.count("failover: service") >= 2, said[-3000:]
        assert "repair: DHT 'copies'" in said, said[-3000:]
    finally:
        deployment.stop_everything()


@pytest.mark.timeout(180)
def test_pops_hand_each_record_to_one_client_across_a_failover(tmp_path):
    """Three clients pop the records of a replicas=2 DHT while the primary
    of some of its buckets is killed (SIGKILL): a pop whose DELETE_IF was
    in flight is retried at the promoted backup, which answers it from
    its reply cache if it had applied it.  Every record is popped by
    exactly one client, or is still there; none is lost or popped twice."""
    deployment = start_deployment(tmp_path, services=3)
    try:
        with domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as cluster:
            dht = cluster.create_dht("queue", buckets=16, replicas=2)
            # (enough that popping goes on well past the kill: three clients
            # pop a few thousand a second)
            records = {number: f"item-{number}" for number in range(12_000)}
            dht.put_many(records)
            popped: list[list[tuple[int, str]]] = [[], [], []]
            errors: list[BaseException] = []
            stop = threading.Event()

            def popper(index: int) -> None:
                with domus.connect(deployment.supervisor_address,
                                   timeout=CLIENT_TIMEOUT) as own:
                    mine = own.open_dht("queue")
                    order = list(records)
                    random.Random(index).shuffle(order)
                    for key in order:
                        if stop.is_set():
                            return
                        try:
                            value = mine.pop(key, None)
                        except Exception as exc:  # none is allowed
                            errors.append(exc)
                            return
                        if value is not None:
                            popped[index].append((key, value))

            threads = [threading.Thread(target=popper, args=(index,)) for index in range(3)]
            for thread in threads:
                thread.start()
            try:
                wait_until(lambda: sum(map(len, popped)) >= 600, timeout=60,
                           what="pops before the kill", interval=0.005)
                at_kill = sum(map(len, popped))
                deployment.kill_service("s2", signal.SIGKILL)
            finally:
                for thread in threads:
                    thread.join(120)
                stop.set()
            assert [repr(exc) for exc in errors] == []
            taken = [item for items in popped for item in items]
            assert len(taken) == len({key for key, _value in taken}), "a record popped twice"
            assert all(records[key] == value for key, value in taken)
            with domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as fresh:
                left = fresh.open_dht("queue").get_many(list(records))
            assert not {key for key, _value in taken} & set(left)
            assert len(taken) + len(left) == len(records), "a record was lost"
            assert len(taken) >= at_kill + 1000, (at_kill, len(taken))  # (popping went on)
        with open(deployment.log_path("supervisor"), encoding="utf-8") as log:
            said = log.read()
        assert "failover: service" in said, said[-3000:]
    finally:
        deployment.stop_everything()


@pytest.mark.timeout(120)
def test_one_copy_lost_with_its_service_is_data_lost_until_accepted(deployment, cluster):
    dht = cluster.create_dht("single", buckets=16)
    records = {number: number for number in range(6_000)}
    dht.put_many(records)
    on_s2 = [key for key in records if owner_of(dht, key) == "s2"]
    elsewhere = [key for key in records if owner_of(dht, key) != "s2"]
    deployment.kill_service("s2", signal.SIGKILL)
    restart(deployment, "s2")
    wait_until(lambda: replication(cluster, "single")["lost_buckets"], timeout=15,
               what="the supervisor to mark s2's buckets lost")
    for key in on_s2[:50]:
        with pytest.raises(DataLost, match=r"lost its records with service s2.*accept-loss"):
            dht[key]
        with pytest.raises(DataLost):
            dht[key] = 1
    assert dht.get_many(elsewhere) == {key: key for key in elsewhere}
    with pytest.raises(DataLost):
        len(dht)
    with pytest.raises(DataLost):
        list(dht)
    assert [entry["lost_buckets"] for entry in cluster.list_dhts()] == [
        len(replication(cluster, "single")["lost_buckets"])]
    lost = replication(cluster, "single")["lost_buckets"]
    assert lost and all(owner_of(dht, key) == "s2" for key in on_s2)
    assert cluster.accept_loss("single") == lost
    assert replication(cluster, "single")["lost_buckets"] == []
    assert len(dht) == len(elsewhere)
    with pytest.raises(KeyError):
        dht[on_s2[0]]
    dht[on_s2[0]] = "back"
    assert dht[on_s2[0]] == "back"


@pytest.mark.timeout(180)
def test_copies_follow_capacity_when_services_join(tmp_path):
    """A replicated DHT over two services: two more join, and the balancer
    gives them their share of the copies, primaries and backups (never two
    copies of a bucket on one service), while a writer goes on."""
    from domus.placement import replicas

    deployment = start_deployment(tmp_path, services=2, supervisor_args=(
        "--balance", "auto", "--balance-settle", "1", "--balance-cooldown", "1",
        "--balance-cpu-busy", "101"))
    writers: list[Writer] = []
    try:
        with domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as cluster:
            cluster.create_dht("joined", buckets=32, replicas=2)
            base = {number: number for number in range(4_000)}
            cluster.open_dht("joined").put_many(base)
            writers = [Writer(deployment.supervisor_address, "joined", "w", "D,C,R")]
            keeps_writing(writers)
            for name in ("s3", "s4"):
                deployment.spawn_service(name, f"127.0.0.1:{free_port()}")
            deployment.wait_until_up(["s3", "s4"], timeout=30)

            def spread() -> bool:
                held = replicas.copies_held(cluster.dht_info("joined"))
                return len(held) == 4 and max(held.values()) - min(held.values()) <= 2

            wait_until(spread, timeout=120, what="the copies to spread over four services")
            keeps_writing(writers)
            copies = replication(cluster, "joined")["copies"]
            assert all(len(set(part["holders"])) == 2 for part in copies), copies
    finally:
        for writer in writers:
            writer.stop()
    try:
        assert [repr(exc) for writer in writers for _at, exc in writer.errors] == []
        with domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as cluster:
            check_everything(cluster, "joined", writers, base)
    finally:
        deployment.stop_everything()


def free_port() -> int:
    from domus.ops.deploy import free_port_block

    return free_port_block(1)


def forwarded(cluster: domus.Cluster) -> dict[str, int]:
    """Replicated changes each service's C path sent to backups."""
    return {name: service_stats(address)["forwarded"]
            for name, address in service_addresses(cluster).items()}


@pytest.mark.timeout(180)
def test_single_changes_and_batches_reach_the_backups_in_the_primarys_order(tmp_path):
    """Puts and deletes of single keys (which the C path sends to the
    backups) race with put_many batches, pops and setdefaults (which the
    Python path sends: DELETE_IF and PUT_IF_ABSENT) on the same few keys,
    from five clients.  The backups apply each bucket's
    changes in the order its primary does, whichever path sent them: once
    a primary is killed, its promoted backup holds exactly what it held."""
    deployment = start_deployment(tmp_path, services=2)
    try:
        with domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as cluster:
            cluster.create_dht("order", buckets=8, replicas=2)
            keys = [f"k{number}" for number in range(40)]
            stop = threading.Event()
            errors: list[BaseException] = []
            done = [0, 0, 0, 0, 0]

            def change(seed: int, batches: bool) -> None:
                with domus.connect(deployment.supervisor_address,
                                   timeout=CLIENT_TIMEOUT) as own:
                    dht = own.open_dht("order")
                    pick = random.Random(seed)
                    while not stop.is_set():
                        try:
                            if seed == 4:       # (conditional changes: the Python path)
                                if pick.random() < 0.5:
                                    dht.setdefault(pick.choice(keys), [seed, done[seed]])
                                else:
                                    dht.pop(pick.choice(keys), None)
                            elif batches:
                                dht.put_many({pick.choice(keys): [seed, done[seed], n]
                                              for n in range(6)})
                            elif pick.random() < 0.25:
                                with contextlib.suppress(KeyError):
                                    del dht[pick.choice(keys)]
                            else:
                                dht[pick.choice(keys)] = [seed, done[seed]]
                        except Exception as exc:  # counted: none is allowed
                            errors.append(exc)
                        done[seed] += 1

            threads = [threading.Thread(target=change, args=(seed, seed in (2, 3)))
                       for seed in range(5)]
            for thread in threads:
                thread.start()
            try:
                wait_until(lambda: min(done) >= 1200 and sum(forwarded(cluster).values()) >= 3000,
                           timeout=90, what="changes by both paths")
            finally:
                stop.set()
                for thread in threads:
                    thread.join(60)
            assert [repr(exc) for exc in errors] == []
            dht = cluster.open_dht("order")
            held = dht.get_many(keys)
            on_s1 = [key for key in keys if owner_of(dht, key) == "s1"]
            assert on_s1 and len(on_s1) < len(keys)
            deployment.kill_service("s1", signal.SIGKILL)
            with domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as fresh:
                promoted = fresh.open_dht("order").get_many(keys)
            assert first_difference(promoted, held) == []
    finally:
        deployment.stop_everything()


@pytest.mark.timeout(120)
def test_a_backup_that_pauses_delays_writes_and_loses_none(tmp_path):
    """A backup stopped for a moment (SIGSTOP) does not answer the
    REPLICATEs its primary sends: the primary sends them again until it
    answers, and the writes that waited for it are acknowledged then, none
    failed, none lost."""
    deployment = start_deployment(tmp_path, services=2)
    try:
        with domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as cluster:
            cluster.create_dht("pause", buckets=8, replicas=2)
            addresses = service_addresses(cluster)
            dht = cluster.open_dht("pause")
            # (keys whose primary is s1, so that the writer never waits for s2 itself)
            keys = [key for key in range(2_000) if owner_of(dht, key) == "s1"]
            acknowledged: dict[int, int] = {}
            errors: list[BaseException] = []
            stop = threading.Event()

            def write() -> None:
                for round_ in itertools.count():
                    for key in keys:
                        if stop.is_set():
                            return
                        try:
                            dht[key] = round_
                        except Exception as exc:  # counted: none is allowed
                            errors.append(exc)
                        else:
                            acknowledged[key] = round_

            writer = threading.Thread(target=write)
            writer.start()
            try:
                wait_until(lambda: len(acknowledged) >= 200, timeout=30, what="writes")
                before = service_stats(addresses["s1"])
                backup = deployment.services["s2"]
                backup.send_signal(signal.SIGSTOP)
                try:
                    time.sleep(0.3)             # (the pause under test)
                finally:
                    backup.send_signal(signal.SIGCONT)
                mark = sum(acknowledged.values())
                wait_until(lambda: sum(acknowledged.values()) >= mark + 500, timeout=30,
                           what="writes after the pause")
            finally:
                stop.set()
                writer.join(60)
            assert [repr(exc) for exc in errors] == []
            after = service_stats(addresses["s1"])
            assert after["forward_resends"] > before["forward_resends"]
            # The backup, woken, answers each REPLICATE it was sent, the
            # resends too: the answers after the first are counted late,
            # not as forged datagrams (nor malformed ones).
            wait_until(lambda: service_stats(addresses["s1"])["late_answers"]
                       > before["late_answers"], timeout=10, what="late answers counted")
            after = service_stats(addresses["s1"])
            assert after["unauthenticated"] == before["unauthenticated"]
            assert after["malformed"] == before["malformed"]
            assert first_difference(dht.get_many(list(acknowledged)), acknowledged) == []
    finally:
        deployment.stop_everything()


# ------------------------------------------------------------ forged answers

def _udp_payloads(sniffer, source_port: int, destination_port: int):
    """The UDP payloads from 127.0.0.1:source_port to destination_port that
    the packet socket ``sniffer`` has read so far (IPv4 packets, no link
    header)."""
    while True:
        try:
            packet = sniffer.recv(65536)
        except BlockingIOError:
            return
        if len(packet) < 28 or packet[9] != socket.IPPROTO_UDP:
            continue
        udp = (packet[0] & 0x0F) * 4
        ports = struct.unpack_from("!HH", packet, udp)
        if ports == (source_port, destination_port):
            yield packet[udp + 8:]


def _spoofed_udp(raw, source_port: int, destination_port: int, payload: bytes) -> None:
    """Sends ``payload`` to 127.0.0.1:destination_port as if from
    127.0.0.1:source_port (the kernel fills in the IP checksum, total
    length and id; a zero UDP checksum means none, in IPv4)."""
    udp = struct.pack("!HHHH", source_port, destination_port, 8 + len(payload), 0)
    loopback = socket.inet_aton("127.0.0.1")
    header = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 0, 0, 0, 64, socket.IPPROTO_UDP, 0,
                         loopback, loopback)
    raw.sendto(header + udp + payload, ("127.0.0.1", 0))


@pytest.mark.skipif(os.geteuid() != 0, reason="reads the loopback's packets and sends "
                    "spoofed ones (raw sockets): needs root")
def test_forged_answers_from_a_backups_address_acknowledge_no_write(tmp_path):
    """A hostile process on the primary's host, root, sees the REPLICATE
    the primary sends to a backup that is paused (SIGSTOP), and answers it
    in the backup's name: from the backup's address and port, to the
    REPLICATE's own request id, the answer well formed, only its MAC made
    up.  The write is not acknowledged on the strength of it: it waits for
    the backup, is acknowledged once the backup has applied it, and each
    forgery is dropped and counted unauthenticated."""
    deployment = start_deployment(tmp_path, services=2)
    sniffer = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(0x0800))
    raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    try:
        sniffer.bind(("lo", 0x0800))
        sniffer.setblocking(False)
        with domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as cluster:
            cluster.create_dht("forged", buckets=8, replicas=2)
            addresses = service_addresses(cluster)
            primary = int(addresses["s1"].rsplit(":", 1)[1])
            backup_port = int(addresses["s2"].rsplit(":", 1)[1])
            dht = cluster.open_dht("forged")
            key = next(key for key in range(1_000) if owner_of(dht, key) == "s1")
            dht[key] = "before"
            list(_udp_payloads(sniffer, primary, backup_port))      # (what came so far)
            before = service_stats(addresses["s1"])
            backup_before = service_stats(addresses["s2"])
            backup = deployment.services["s2"]
            done = threading.Event()
            failures: list[BaseException] = []

            def write() -> None:
                try:
                    dht[key] = "after"
                except BaseException as exc:     # reported below
                    failures.append(exc)
                finally:
                    done.set()

            backup.send_signal(signal.SIGSTOP)
            try:
                writer = threading.Thread(target=write)
                writer.start()
                ids: set[bytes] = set()
                forged = 0
                deadline = time.monotonic() + 0.8       # (under the primary's 2 s)
                while time.monotonic() < deadline:
                    for payload in _udp_payloads(sniffer, primary, backup_port):
                        if (len(payload) >= 8 and payload[0] == wire.REQUEST_MAGIC
                                and payload[2] == wire.OP_REPLICATE):
                            ids.add(payload[4:8])
                    for request_id in ids:
                        inner = bytes((wire.REPLY_MAGIC, wire.VERSION, wire.ST_OK, 0)) + \
                            request_id + b"\x01"
                        answer = bytes((wire.REPLY_MAGIC, wire.VERSION, wire.ST_OK, 0)) + \
                            request_id + inner + os.urandom(auth.REPLY_TRAILER)
                        _spoofed_udp(raw, backup_port, primary, answer)
                        forged += 1
                    assert not done.is_set(), "a write was acknowledged while its backup " \
                                              "was stopped"
                    time.sleep(0.01)
                assert ids, "no REPLICATE was seen on the loopback"
            finally:
                backup.send_signal(signal.SIGCONT)
            assert done.wait(30) and failures == []
            writer.join(10)
            wait_until(lambda: service_stats(addresses["s1"])["unauthenticated"]
                       >= before["unauthenticated"] + forged, timeout=10,
                       what="the forgeries counted")
            assert service_stats(addresses["s2"])["replicated"] > backup_before["replicated"]
            assert dht[key] == "after"
    finally:
        sniffer.close()
        raw.close()
        deployment.stop_everything()
