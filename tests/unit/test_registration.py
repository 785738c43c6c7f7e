"""Registration (domus.supervisor.server.op_register) and what the wire
checks (domus.wire.checks, domus.wire.identities, control bodies): a
registration never takes over a live service's name or address, a
connection registers once, figures and names are checked, a transient
error is not a refusal; holdings of a destroyed DHT are dropped by name,
those of another deployment kept and their ids skipped."""

import errno
import math

import msgpack
import pytest
from test_supervisor import deployment, result_of  # noqa: F401  (the fixture)
from twisted.internet import defer
from twisted.python.failure import Failure

from domus.errors import ProtocolError
from domus.wire import checks, identities
from domus.wire import protocol as wire
from domus.wire.control import ControlError

REFUSED = "RegistrationRefused"


class NewLink:
    """A connection that has just been made (no service on it yet)."""

    connected = True
    secure = False
    transport = None

    def __init__(self):
        self.lost = defer.Deferred()
        self.peer_name = ""


def register(supervisor, link, name, address, **changes):
    params = {"resources": {"cores": 2, "ram": 2**30, "disk": 2**34}, **changes}
    try:
        answer = supervisor.op_register(link, name=name, address=address, **params)
    except ControlError as exc:
        return exc
    if isinstance(answer, defer.Deferred):
        results = []
        answer.addBoth(results.append)
        assert results, "the registration has not been answered"
        if isinstance(results[0], Failure):
            return results[0].value
        return results[0]
    return answer


def test_a_connection_registers_once(deployment):  # noqa: F811
    supervisor, _links, _records = deployment
    link = NewLink()
    assert "dhts" in register(supervisor, link, "s4", "127.0.0.1:14")
    second = register(supervisor, link, "s1", supervisor.state.services["s1"]["address"])
    assert isinstance(second, ControlError) and second.kind == REFUSED
    assert "registered service 's4' already" in second.message
    assert supervisor.links["s4"] is link and supervisor.links["s1"] is not link


@pytest.mark.parametrize("claim", ["name and address", "name", "address"])
def test_a_live_services_name_or_address_is_not_taken(deployment, claim):  # noqa: F811
    supervisor, links, _records = deployment
    own = supervisor.state.services["s1"]["address"]
    name, address = {"name and address": ("s1", own), "name": ("s1", "127.0.0.1:19"),
                     "address": ("intruder", own)}[claim]
    answer = register(supervisor, NewLink(), name, address)
    assert isinstance(answer, ControlError) and answer.kind == REFUSED, answer
    assert "live service" in answer.message
    assert links["s1"].calls == ["ping"]          # it was asked, and answered
    assert supervisor.links["s1"] is links["s1"]
    assert supervisor.state.services["s1"]["address"] == own
    assert "intruder" not in supervisor.state.services


def test_a_service_that_does_not_answer_its_ping_may_be_replaced(deployment):  # noqa: F811
    supervisor, links, _records = deployment
    links["s1"].fail("ping", error=TimeoutError("no reply in time"))
    link = NewLink()
    answer = register(supervisor, link, "s1", "127.0.0.1:21")
    assert "dhts" in answer, answer
    assert supervisor.links["s1"] is link
    assert supervisor.state.services["s1"]["address"] == "127.0.0.1:21"


@pytest.mark.parametrize("resources", [
    {"cores": 2, "ram": -1, "disk": 1}, {"cores": math.nan, "ram": 1, "disk": 1},
    {"cores": 2, "ram": 1e300, "disk": 1}, {"cores": 2, "ram": "1", "disk": 1},
    {"cores": True, "ram": 1, "disk": 1}, {"cores": 2, "ram": 1, "disk": math.inf}, [],
])
def test_figures_that_are_not_finite_positive_and_bounded_are_refused(
        deployment, resources):  # noqa: F811
    supervisor, _links, _records = deployment
    answer = register(supervisor, NewLink(), "s9", "127.0.0.1:29", resources=resources)
    assert isinstance(answer, ControlError) and answer.kind == REFUSED
    assert "s9" not in supervisor.state.services


def test_a_state_that_cannot_be_saved_is_an_error_to_retry_not_a_refusal(
        deployment, monkeypatch):  # noqa: F811
    supervisor, _links, _records = deployment

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(supervisor.state, "save", full)
    answer = register(supervisor, NewLink(), "s5", "127.0.0.1:15")
    assert isinstance(answer, ControlError) and answer.kind != REFUSED
    assert "No space left" in answer.message and "retry" in answer.message
    monkeypatch.undo()
    link = NewLink()
    assert "dhts" in register(supervisor, link, "s5", "127.0.0.1:15")     # (its retry)


def test_holdings_are_sorted_into_drops_and_orphans(deployment):  # noqa: F811
    supervisor, _links, _records = deployment
    supervisor.state.destroyed["a" * 32] = {"name": "gone", "id": 40, "destroyed": 0}
    holdings = [
        {"id": 40, "name": "gone", "deployment": supervisor.state.deployment,
         "stamp": "a" * 32},
        {"id": 77, "name": "elsewhere", "deployment": "b" * 32, "stamp": "c" * 32,
         "storage": "disk", "platform": "domus-bsddb-btree", "loaded": False},
    ]
    answer = register(supervisor, NewLink(), "s6", "127.0.0.1:16", holdings=holdings)
    assert answer["drop"] == [{"id": 40, "deployment": supervisor.state.deployment,
                               "stamp": "a" * 32}]
    assert [orphan["id"] for orphan in supervisor.live["s6"]["orphans"]] == [77]
    assert supervisor.state.next_dht_id == 78          # no new DHT will be given 77
    bad = register(supervisor, NewLink(), "s7", "127.0.0.1:17",
                   holdings=[{"id": "../x", "deployment": None, "stamp": None}])
    assert isinstance(bad, ControlError) and "DHT id" in bad.message


# ------------------------------------------------------------ the wire's checks

@pytest.mark.parametrize("value", ["1", 0, -1, 2**32, True, None, 1.0, "../1"])
def test_dht_ids_are_ints_in_range(value):
    with pytest.raises(ValueError, match="not valid"):
        checks.dht_id(value)
    assert checks.dht_id(1) == 1 and checks.dht_id(2**32 - 1) == 2**32 - 1


@pytest.mark.parametrize("host", ["node-1", "node-1.cluster.example", "10.0.0.7", "fe80::1",
                                  "localhost"])
def test_host_names_and_ip_addresses_pass(host):
    assert checks.host(host)


@pytest.mark.parametrize("host", ["-oProxyCommand=x", "a b", "a;b", "$(id)", "node-", "",
                                  "a" * 64 + ".b", "ｎode", "a\nb", None, 5])
def test_anything_else_is_not_a_host(host):
    with pytest.raises(ValueError, match="not a valid host"):
        checks.host(host)


@pytest.mark.parametrize("path", ["relative", "/a/../b", "/a\0b", "/a\nb", "", None,
                                  "/" + "x" * 5000])
def test_paths_must_be_absolute_and_plain(path):
    with pytest.raises(ValueError, match="absolute path"):
        checks.absolute_path(path, "data dir")


def test_identities_are_fresh_hex_and_named_exactly():
    first, second = identities.new(), identities.new()
    assert first != second and len(first) == 32 and int(first, 16) >= 0
    recorded = {"id": 3, "deployment": first, "stamp": second}
    assert identities.same(recorded, dict(recorded))
    assert not identities.same(recorded, {**recorded, "stamp": first})
    assert not identities.same(recorded, {"id": 3})
    with pytest.raises(ValueError, match="DHT stamp"):
        identities.checked({"id": 3, "deployment": first, "stamp": "/etc"})


def control(body: bytes) -> bytes:
    return wire.request_header(wire.OP_CONTROL, 1, 2) + body


def test_a_control_body_is_bounded_before_it_is_expanded():
    assert wire.decode_control(control(wire.pack({"op": "ping"}))) == {"op": "ping"}
    with pytest.raises(ProtocolError, match="over the 100-byte limit"):
        wire.decode_control(control(wire.pack({"op": "x", "pad": "y" * 200})), max_body=100)
    empties = b"\x82\xa2op\xa1x\xa1a\xdd" + (5000).to_bytes(4, "big") + b"\x90" * 5000
    with pytest.raises(ProtocolError, match="more than 1000 arrays and maps"):
        wire.decode_control(control(empties), max_containers=1000)
    assert len(wire.decode_control(control(empties), max_containers=6000)["a"]) == 5000
    too_long = b"\x81\xa2op\xdd" + (wire.MAX_CONTROL_ELEMENTS + 1).to_bytes(4, "big")
    with pytest.raises(ProtocolError):
        wire.decode_control(control(too_long))
    deep = b"\x82\xa2op\xa1x\xa1a" + b"\x91" * 5000 + b"\x00"
    with pytest.raises(ProtocolError):
        wire.decode_control(control(deep))
    assert msgpack.version >= (1, 0, 0)
