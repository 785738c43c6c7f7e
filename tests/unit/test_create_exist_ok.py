"""Creating a DHT that tasks started together all create: the supervisor's
``create_dht(exist_ok=True)`` and ``open_dht`` while a creation is in flight
(driven as in test_supervisor, with a service's acknowledgement held back)."""

import pytest
from test_supervisor import deployment, result_of  # noqa: F401  (a fixture)
from twisted.python.failure import Failure

from domus.wire.control import ControlError


def pending(deferred):
    """What ``deferred`` fired with so far: [] while it has not fired."""
    results = []
    deferred.addBoth(results.append)
    return results


def raised(results):
    assert results and isinstance(results[0], Failure), results
    return results[0].value


def test_exist_ok_returns_the_dht_with_the_same_attributes(deployment):  # noqa: F811
    supervisor, links, _records = deployment
    first = result_of(supervisor.op_create_dht(None, name="w", attributes={"buckets": 16}))
    again = result_of(supervisor.op_create_dht(None, name="w", attributes={"buckets": 16},
                                               exist_ok=True))
    assert again["id"] == first["id"] and again["existed"] is True
    # attributes left out match whatever the DHT was given
    assert result_of(supervisor.op_create_dht(None, name="w", exist_ok=True))["id"] == first["id"]
    assert [name for name in supervisor.state.dhts if name == "w"] == ["w"]


def test_without_exist_ok_an_existing_dht_is_refused_as_before(deployment):  # noqa: F811
    supervisor, _links, _records = deployment
    result_of(supervisor.op_create_dht(None, name="w"))
    with pytest.raises(ControlError, match="already exists.*exist_ok") as refused:
        result_of(supervisor.op_create_dht(None, name="w"))
    assert refused.value.kind == "DhtExists"


def test_exist_ok_with_other_attributes_names_each_difference(deployment):  # noqa: F811
    supervisor, _links, _records = deployment
    result_of(supervisor.op_create_dht(None, name="w", attributes={"buckets": 16}))
    before = dict(supervisor.state.dhts["w"])
    with pytest.raises(ControlError) as refused:
        result_of(supervisor.op_create_dht(None, name="w", exist_ok=True, attributes={
            "buckets": 32, "platform": "domus-rbt", "lookup": "C,R",
            "storage_services": ["s1"]}))
    assert refused.value.kind == "DhtExists"
    message = str(refused.value)
    for difference in ("buckets: has 16, asked for 32",
                       "platform: has 'python-dict', asked for 'domus-rbt'",
                       "lookup: has 'D', asked for 'C,R'",
                       "storage_services: has ['s1', 's2', 's3'], asked for ['s1']"):
        assert difference in message
    assert "routing" not in message.replace("routing_services", "")   # the same: not named
    assert supervisor.state.dhts["w"] == before                      # nothing changed


def test_open_waits_for_a_creation_in_flight(deployment):  # noqa: F811
    supervisor, links, _records = deployment
    links["s1"].hold("assign")
    creating = pending(supervisor.op_create_dht(None, name="w"))
    opening = pending(supervisor.op_open_dht(None, name="w"))
    joining = pending(supervisor.op_create_dht(None, name="w", exist_ok=True))
    refused = pending(supervisor.op_create_dht(None, name="w"))
    assert creating == [] and opening == [] and joining == []
    assert raised(refused).kind == "DhtExists" and "being created" in str(raised(refused))
    links["s1"].release()
    dht_id = creating[0]["id"]
    assert opening[0]["id"] == dht_id and joining[0]["id"] == dht_id
    assert links["s2"].calls.count("assign") == 1          # created once


def test_a_failed_creation_in_flight_fails_opens_and_exist_ok_creates_again(deployment):  # noqa: F811,E501
    supervisor, links, _records = deployment
    links["s1"].fail("assign")
    links["s2"].hold("assign")
    creating = pending(supervisor.op_create_dht(None, name="w"))
    opening = pending(supervisor.op_open_dht(None, name="w"))
    joining = pending(supervisor.op_create_dht(None, name="w", exist_ok=True))
    links["s2"].release()
    assert raised(creating).kind == "SupervisorError"
    assert raised(opening).kind == "UnknownDht"
    # the waiting exist_ok creation tried again, and this time it worked
    assert joining[0]["name"] == "w" and "w" in supervisor.state.dhts
    assert supervisor._creating == {}
