"""domus.wire.address: HOST:PORT parsing and the supervisor address rule."""

import pytest

from domus.wire import address


@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:7700", ("127.0.0.1", 7700)),
    ("node-3:1", ("node-3", 1)),
    ("[::1]:7700", ("::1", 7700)),
    (":7700", ("127.0.0.1", 7700)),
    (" 10.1.2.3:65535 ", ("10.1.2.3", 65535)),
])
def test_parse(text, expected):
    assert address.parse(text) == expected


def test_a_default_port_fills_a_bare_host():
    assert address.parse("head", default_port=7700) == ("head", 7700)


@pytest.mark.parametrize("text, message", [
    ("head", "needs a port"), ("head:http", "not a number"), ("head:70000", "out of range"),
])
def test_parse_errors_name_the_problem(text, message):
    with pytest.raises(ValueError, match=message):
        address.parse(text)


def test_supervisor_address_prefers_the_argument_then_the_environment(monkeypatch):
    monkeypatch.setenv("DOMUS_SUPERVISOR", "env-host:1")
    assert address.supervisor_address("arg-host:2") == "arg-host:2"
    assert address.supervisor_address() == "env-host:1"
    monkeypatch.delenv("DOMUS_SUPERVISOR")
    assert address.supervisor_address() == address.DEFAULT_SUPERVISOR == "127.0.0.1:7700"
