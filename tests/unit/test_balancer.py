"""domus.supervisor.balancer on made-up clusters: targets by capacity,
hysteresis, budgets, drains, load damping, and rebasing the descriptor."""

from __future__ import annotations

import random

import pytest
from domus.supervisor import balancer
from domus.supervisor.balancer import Memory, Settings

from domus.placement import layout

GIB = 1 << 30


def service(cores=4, ram=8 * GIB, disk=100 * GIB, state="up", cpu=0.0, node_cpu=0.0,
            platforms=None):
    return {"resources": {"cores": cores, "ram": ram, "disk": disk}, "state": state,
            "load": {"cpu": cpu, "node_cpu": node_cpu}, "platforms": platforms}


def descriptor(buckets=64, storage=("s1", "s2"), routing=None, follow=("routing", "storage"),
               medium="ram", platform="python-dict", counts=None):
    routing = routing or storage
    def entries(names, role_counts):
        role_counts = role_counts or [buckets // len(names)] * len(names)
        role_counts[-1] += buckets - sum(role_counts)
        return [{"name": name, "address": f"127.0.0.1:{7701 + i}", "count": count}
                for i, (name, count) in enumerate(zip(names, role_counts))]
    return {"id": 1, "name": "d", "buckets": buckets, "storage": medium, "platform": platform,
            "routing_services": entries(list(routing), counts and list(counts)),
            "storage_services": entries(list(storage), counts and list(counts)),
            "follow": list(follow)}


def run_to_the_end(dht, services, memory=None, settings=Settings(settle=0, cooldown=0),
                   draining=(), rounds=200):
    """Apply the balancer's moves round after round until it has none;
    returns the final descriptor and every move made."""
    memory = memory or Memory()
    made = []
    for round_number in range(rounds):
        moves = balancer.plan(dht, services, memory, settings, now=float(round_number),
                              draining=draining)
        if not moves:
            return balancer.rebase(dht), made
        for move in moves:
            dht = layout.move(dht, move.role, move.bucket, move.target, "127.0.0.1:1")
            memory.moved_at[(move.dht, move.role, move.bucket)] = float(round_number)
        made += moves
    raise AssertionError("the balancer never settled")


def held(dht, role="storage"):
    owners = layout.owners(dht, role)
    return {name: owners.buckets(name) for name in owners.owners()}


def test_a_joining_service_gets_its_share_and_the_layout_is_counts_again():
    services = {"s1": service(), "s2": service()}
    dht = descriptor(buckets=64)
    assert balancer.plan(dht, services, Memory(), Settings(settle=0)) == []
    services["s3"] = service()
    final, moves = run_to_the_end(dht, services)
    assert held(final) == {"s1": 22, "s2": 21, "s3": 21}
    assert held(final, "routing") == {"s1": 22, "s2": 21, "s3": 21}
    assert "storage_moves" not in final and "routing_moves" not in final   # rebased
    assert [entry["count"] for entry in final["storage_services"]] == [22, 21, 21]
    assert all(move.target in ("s2", "s3") for move in moves)
    assert {move.role for move in moves} == {"routing", "storage"}


@pytest.mark.parametrize("seed", range(5))
def test_heterogeneous_services_end_within_one_bucket_of_their_weighted_targets(seed):
    rng = random.Random(seed)
    services = {f"s{i}": service(cores=rng.choice([1, 2, 8, 32]),
                                 ram=rng.choice([2, 4, 16, 64]) * GIB,
                                 disk=rng.choice([10, 50, 500]) * GIB) for i in range(1, 6)}
    medium = rng.choice(["ram", "disk"])
    dht = descriptor(buckets=rng.choice([64, 256, 1024]), storage=["s1", "s2"], medium=medium)
    final, _moves = run_to_the_end(dht, services)
    for role, field in (("storage", "disk" if medium == "disk" else "ram"),
                        ("routing", "cores")):
        weights = {name: s["resources"][field] for name, s in services.items()}
        total = sum(weights.values())
        for name, count in held(final, role).items():
            exact = final["buckets"] * weights[name] / total
            assert abs(count - exact) < 1, (role, name, count, exact)
        assert set(held(final, role)) == set(services)


def test_no_move_until_the_imbalance_has_lasted_settle_seconds():
    services = {"s1": service(), "s2": service(), "s3": service()}
    dht = descriptor()
    memory = Memory()
    settings = Settings(settle=10)
    assert balancer.plan(dht, services, memory, settings, now=100.0) == []
    assert balancer.plan(dht, services, memory, settings, now=109.0) == []
    assert balancer.plan(dht, services, memory, settings, now=110.0) != []
    # an imbalance that went away starts its clock again
    assert balancer.plan(dht, services | {"s3": service(state="down")}, memory, settings,
                         now=111.0) == []
    assert balancer.plan(dht, services, memory, settings, now=112.0) == []


def test_equal_services_under_noisy_load_never_trade_buckets():
    rng = random.Random(7)
    services = {"s1": service(), "s2": service()}
    dht = descriptor(buckets=128)
    memory = Memory()
    for second in range(600):
        for name in services:
            services[name] = service(cpu=rng.uniform(0, 80), node_cpu=rng.uniform(0, 60))
        balancer.adjust_for_load(services, memory, Settings(), float(second))
        assert balancer.plan(dht, services, memory, Settings(settle=5),
                             now=float(second)) == [], second


def test_routing_follows_the_cores_other_work_leaves_free():
    # s2's node is 75% busy with someone else's job: it routes less
    services = {"s1": service(cores=4), "s2": service(cores=4, node_cpu=75.0, cpu=0.0)}
    final, _moves = run_to_the_end(descriptor(buckets=100), services)
    assert held(final, "routing") == {"s1": 80, "s2": 20}
    assert held(final, "storage") == {"s1": 50, "s2": 50}     # RAM is unchanged


def test_a_round_is_bounded_by_moves_and_records_and_a_moved_bucket_rests():
    services = {"s1": service(), "s2": service(), "s3": service()}
    dht = descriptor(buckets=64, follow=("storage",))
    memory = Memory()
    settings = Settings(settle=0, max_moves=5, cooldown=30, records_per_round=1_000)
    moves = balancer.plan(dht, services, memory, settings, now=0.0,
                          records={"s1": 300.0, "s2": 300.0})
    assert len(moves) == 3                 # 3 x 300 records fit in 1,000; a 4th does not
    assert all(move.records == 300 for move in moves)
    moves = balancer.plan(dht, services, memory, settings, now=0.0)
    assert len(moves) == 5
    for move in moves:
        dht = layout.move(dht, move.role, move.bucket, move.target, "a")
        dht = layout.move(dht, move.role, move.bucket, move.source, "a")   # and back
        memory.moved_at[(move.dht, move.role, move.bucket)] = 0.0
    again = balancer.plan(dht, services, memory, settings, now=10.0)
    assert not {move.bucket for move in moves} & {move.bucket for move in again}
    later = balancer.plan(dht, services, memory, settings, now=31.0)
    assert {move.bucket for move in moves} & {move.bucket for move in later}


def test_a_drain_moves_everything_off_at_once_and_says_why():
    services = {"s1": service(), "s2": service(), "s3": service()}
    dht = descriptor(storage=("s1", "s2", "s3"), follow=())
    memory = Memory()
    moves = balancer.plan(dht, services, memory, Settings(settle=3600, max_moves=1000),
                          now=0.0, draining={"s2"})
    assert {move.source for move in moves} == {"s2"} or all(
        move.target != "s2" for move in moves)
    assert any("s2 is draining" in move.why for move in moves)
    final, _moves = run_to_the_end(dht, services, draining={"s2"})
    assert "s2" not in held(final) and "s2" not in held(final, "routing")


def test_a_berkeley_db_dht_is_balanced_only_over_services_that_have_it():
    services = {"s1": service(), "s2": service(),
                "s3": service(platforms=["python-dict", "domus-rbt"])}
    final, _moves = run_to_the_end(descriptor(platform="domus-bsddb-btree"), services)
    assert set(held(final)) == {"s1", "s2"}
    assert set(held(final, "routing")) == {"s1", "s2", "s3"}


def test_nothing_moves_while_a_holder_is_down():
    services = {"s1": service(), "s2": service(state="down"), "s3": service()}
    assert balancer.plan(descriptor(), services, Memory(), Settings(settle=0)) == []


def test_a_busy_service_is_damped_and_recovers():
    services = {"s1": service(cpu=99.0), "s2": service(cpu=10.0)}
    memory = Memory()
    settings = Settings()
    for second in range(3):
        balancer.adjust_for_load(services, memory, settings, float(second))
    assert memory.factors["s1"] == pytest.approx(0.8 ** 3)
    assert "s1 is busy" in memory.decisions[-1]["decision"]
    final, _moves = run_to_the_end(descriptor(buckets=100), services, memory)
    assert held(final)["s1"] < held(final)["s2"]
    services["s1"] = service(cpu=5.0)
    for second in range(3, 10):
        balancer.adjust_for_load(services, memory, settings, float(second))
    assert "s1" not in memory.factors


def test_a_service_forced_out_leaves_the_lists_and_its_buckets_go_to_the_targets():
    services = {"s1": service(), "s2": service(state="down"), "s3": service()}
    for name, info in services.items():
        info["address"] = f"127.0.0.1:{name[-1]}"
    dht = descriptor(buckets=60, storage=("s1", "s2", "s3"), follow=())
    gone = balancer.force_out(dht, "s2", services, Memory())
    for role in ("routing", "storage"):
        names = [entry["name"] for entry in gone[f"{role}_services"]]
        assert names == ["s1", "s3"]
        assert sum(entry["count"] for entry in gone[f"{role}_services"]) == 60
        owners = layout.owners(gone, role)
        before = layout.owners(dht, role)
        for bucket in range(60):
            if before.owner(bucket) != "s2":
                assert owners.owner(bucket) == before.owner(bucket)   # others keep theirs
            else:
                assert owners.owner(bucket) in ("s1", "s3")
        assert held(gone, role) == {"s1": 30, "s3": 30}


def test_a_hot_bucket_moves_off_a_busy_service_and_stays_pinned_there():
    """s1 is busy and one of its buckets carries half its requests: that
    bucket goes to s2 (which has room) and stays there while the pin lasts,
    though the counts' placement would give it back to s1; then it returns."""
    dht = descriptor(buckets=16)                       # s1 holds 0..7, s2 8..15
    services = {"s1": service(cpu=97.0), "s2": service(cpu=10.0)}
    for name, rate in (("s1", 6000.0), ("s2", 500.0)):
        services[name]["load"]["requests_per_s"] = rate
    heat = {"s1": {3: 3000.0, 4: 400.0, 5: 300.0}, "s2": {9: 200.0}}
    memory = Memory()
    settings = Settings(settle=0, cooldown=0, pin_time=100.0)
    moves = balancer.plan(dht, services, memory, settings, now=0.0, heat=heat)
    hot = [move for move in moves if move.bucket == 3]
    assert [(move.source, move.target, move.role) for move in hot] == [("s1", "s2", "storage")]
    assert "3000" in hot[0].why and "busy s1" in hot[0].why
    for move in moves:
        dht = layout.move(dht, move.role, move.bucket, move.target, "127.0.0.1:1")
    # Calm now: the pin keeps it on s2 (no move back), round after round.
    calm = {"s1": service(cpu=20.0), "s2": service(cpu=20.0)}
    for now in (1.0, 2.0, 50.0):
        assert [move for move in balancer.plan(dht, calm, memory, settings, now=now)
                if move.bucket == 3] == []
    assert layout.owners(dht, "storage").owner(3) == "s2"
    # The pin ends: the counts' placement takes it back.
    back = balancer.plan(dht, calm, memory, settings, now=200.0)
    assert [(move.bucket, move.target) for move in back if move.role == "storage"] == [(3, "s1")]


def test_no_hot_move_without_a_busy_service_or_a_bucket_that_stands_out():
    dht = descriptor(buckets=16)
    settings = Settings(settle=0, cooldown=0)
    for cpus, heat in (((97.0, 96.0), {"s1": {3: 3000.0}}),       # nobody has room
                       ((40.0, 10.0), {"s1": {3: 3000.0}}),       # s1 is not busy
                       ((97.0, 10.0), {"s1": {3: 500.0, 4: 480.0}})):  # nothing stands out
        services = {"s1": service(cpu=cpus[0]), "s2": service(cpu=cpus[1])}
        services["s1"]["load"]["requests_per_s"] = 6000.0
        moves = balancer.plan(dht, services, Memory(), settings, now=0.0, heat=heat)
        assert [move for move in moves if "requests/s" in move.why] == [], (cpus, heat)


def disk_full(**changes):
    full = service(**changes)
    full["load"].update(free_disk=1.0 * GIB, disk_reserve=2.0 * GIB, disk_full=True)
    return full


def test_no_storage_of_a_disk_dht_goes_onto_a_service_whose_disk_is_full():
    """s3 joins with its disk at its reserve: it routes its share, but no
    bucket of a disk DHT's storage is moved there (a RAM DHT's is), and what
    s1 and s2 hold stays; once its heartbeat says it has room, it gets its
    share."""
    services = {"s1": service(), "s2": service(), "s3": disk_full()}
    disk = descriptor(buckets=48, medium="disk", platform="domus-bsddb-btree")
    final, moves = run_to_the_end(disk, services)
    assert held(final, "routing") == {"s1": 16, "s2": 16, "s3": 16}
    assert held(final) == {"s1": 24, "s2": 24}
    assert not [move for move in moves if move.role == "storage"]
    ram = descriptor(buckets=48)
    assert held(run_to_the_end(ram, services)[0]) == {"s1": 16, "s2": 16, "s3": 16}
    drained, _moves = run_to_the_end(final, services, draining=("s1",))
    assert held(drained) == {"s2": 48}               # a drain goes where there is room
    services["s3"] = service()                       # room again
    final, moves = run_to_the_end(final, services)
    assert held(final) == {"s1": 16, "s2": 16, "s3": 16}


def test_storage_waits_while_its_target_holds_some_and_its_disk_is_full():
    services = {"s1": service(), "s2": service(), "s3": disk_full()}
    dht = descriptor(buckets=48, storage=("s1", "s2", "s3"), medium="disk",
                     platform="domus-bsddb-btree", counts=[20, 20, 8])
    moves = balancer.plan(dht, services, Memory(), Settings(settle=0, cooldown=0))
    assert moves and {move.role for move in moves} == {"routing"}     # routing goes on
    services["s3"] = service()
    assert held(run_to_the_end(dht, services)[0]) == {"s1": 16, "s2": 16, "s3": 16}


def test_a_hot_bucket_is_not_moved_onto_a_full_disk():
    dht = descriptor(buckets=16, medium="disk", platform="domus-bsddb-btree")
    services = {"s1": service(cpu=97.0), "s2": disk_full(cpu=10.0)}
    services["s1"]["load"]["requests_per_s"] = 6000.0
    heat = {"s1": {3: 3000.0}}
    moves = balancer.plan(dht, services, Memory(), Settings(settle=0, cooldown=0), now=0.0,
                          heat=heat)
    assert [move for move in moves if move.role == "storage"] == []
    assert balancer.takes_storage(dht, services["s1"])
    assert not balancer.takes_storage(dht, services["s2"])
    assert balancer.takes_storage(descriptor(), services["s2"])     # a RAM DHT's
