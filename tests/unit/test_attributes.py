"""domus.wire.attributes: DHT attribute defaults and validation."""

import pytest

from domus.errors import InvalidAttribute
from domus.wire.attributes import (
    BUCKETS_PER_SERVICE,
    MAX_BUCKETS,
    check_name,
    check_request,
    default_bucket_count,
)
from domus.wire.keys import HASH_FUNCTIONS


def test_defaults_are_filled_in():
    assert check_request("words", {}) == {
        "hash": "xxh3", "storage": "ram", "platform": "python-dict",
        "routing": "chord", "routing_degree": None, "routing_algorithm": "fewest-hops",
        "lookup": "D", "durability": "none", "replicas": 1, "codec": "msgpack",
    }


@pytest.mark.parametrize("codec", ["msgpack", "pickle", "raw"])
def test_codecs_are_msgpack_pickle_or_raw(codec):
    assert check_request("words", {"codec": codec})["codec"] == codec


@pytest.mark.parametrize("codec", ["json", "Pickle", "", 1, ["raw"]])
def test_an_unknown_codec_is_refused_naming_the_known_ones(codec):
    with pytest.raises(InvalidAttribute, match=r"codec .* is unknown; choose one of "
                                               r"\['msgpack', 'pickle', 'raw'\]"):
        check_request("words", {"codec": codec})


@pytest.mark.parametrize("replicas", [0, 4, "2", 2.0, True, None.__class__])
def test_replicas_are_one_to_three(replicas):
    with pytest.raises(InvalidAttribute, match="replicas must be an int from 1 to 3"):
        check_request("words", {"replicas": replicas})
    assert check_request("words", {"replicas": 3})["replicas"] == 3


def test_none_means_use_the_default():
    merged = check_request("words", {"hash": None, "storage": None, "platform": None,
                                     "routing": None, "lookup": None, "buckets": None,
                                     "routing_services": None, "storage_services": None})
    assert merged["hash"] == "xxh3" and merged["routing"] == "chord"
    assert merged.get("buckets") is None
    assert merged.get("routing_services") is None


def test_the_callers_attributes_are_not_modified():
    attributes = {"lookup": "d", "routing_services": "a,b"}
    check_request("words", attributes)
    assert attributes == {"lookup": "d", "routing_services": "a,b"}


@pytest.mark.parametrize("hash_name", sorted(HASH_FUNCTIONS))
def test_every_hash_function_is_accepted(hash_name):
    assert check_request("words", {"hash": hash_name})["hash"] == hash_name


def test_chosen_values_are_kept():
    merged = check_request("words", {"routing": "bruijn", "buckets": 1024,
                                     "storage": "ram", "platform": "python-dict"})
    assert merged["routing"] == "bruijn"
    assert merged["buckets"] == 1024


@pytest.mark.parametrize("buckets", [1, 2, 64, 1 << 16, MAX_BUCKETS])
def test_power_of_two_bucket_counts_are_accepted(buckets):
    assert check_request("words", {"buckets": buckets})["buckets"] == buckets


@pytest.mark.parametrize("lookup, canonical", [("d", "D"), (" D ", "D"), ("d, c,r", "D,C,R"),
                                               ("C,R", "C,R"), ("r", "R")])
def test_lookup_is_normalised(lookup, canonical):
    assert check_request("words", {"lookup": lookup})["lookup"] == canonical


def test_bruijn_degree_defaults_to_two_and_chord_has_none():
    assert check_request("words", {"routing": "bruijn"})["routing_degree"] == 2
    assert check_request("words", {"routing": "bruijn", "routing_degree": 8})["routing_degree"] == 8
    assert check_request("words", {"routing": "chord"})["routing_degree"] is None
    merged = check_request("words", {"routing_algorithm": "least-work"})
    assert merged["routing_algorithm"] == "least-work"


def test_service_lists_may_be_comma_separated_or_sequences():
    merged = check_request("words", {"routing_services": "s1,s2,",
                                     "storage_services": ("s2", "s3")})
    assert merged["routing_services"] == ["s1", "s2"]
    assert merged["storage_services"] == ["s2", "s3"]


@pytest.mark.parametrize("name", ["a", "A" * 128, "x.y-z_1", "1st", "Words2"])
def test_good_names_are_accepted(name):
    assert check_name(name) == name
    check_request(name, {})


@pytest.mark.parametrize("name", ["", "-x", ".x", "_x", "a" * 129, "a b", "caf\u00e9",
                                  "a/b", "abc\n", "\nabc", "a\x00"])
def test_bad_names_raise_invalid_attribute_naming_them(name):
    with pytest.raises(InvalidAttribute) as raised:
        check_request(name, {})
    assert repr(name) in str(raised.value)


@pytest.mark.parametrize("name", [None, 5, b"words", ["words"]])
def test_names_that_are_not_str_raise_invalid_attribute(name):
    with pytest.raises(InvalidAttribute) as raised:
        check_name(name)
    assert repr(name) in str(raised.value)


# (attributes, text the message must contain: the bad value as the user wrote it)
INVALID = [
    ({"colour": "red"}, "colour"),
    ({"hash": "md5"}, "'md5'"),
    ({"hash": ["xxh3"]}, "['xxh3']"),
    ({"hash": 3}, "3"),
    ({"storage": "tape"}, "'tape'"),
    ({"storage": ["ram"]}, "['ram']"),
    ({"platform": "sqlite"}, "'sqlite'"),
    ({"platform": {"name": "python-dict"}}, "{'name': 'python-dict'}"),
    ({"storage": "disk", "platform": "python-dict"}, "'disk'"),
    ({"routing": "pastry"}, "'pastry'"),
    ({"routing": ["chord"]}, "['chord']"),
    ({"lookup": "X"}, "'X'"),
    ({"lookup": "D,D"}, "'D,D'"),
    ({"lookup": "C"}, "'C'"),
    ({"lookup": 5}, "5"),
    ({"routing_degree": 4}, "chord"),
    ({"routing": "bruijn", "routing_degree": 3}, "3"),
    ({"routing": "bruijn", "routing_degree": 1}, "1"),
    ({"routing": "bruijn", "routing_degree": "4"}, "'4'"),
    ({"routing_algorithm": "shortest"}, "'shortest'"),
    ({"buckets": 0}, "0"),
    ({"buckets": 3}, "3"),
    ({"buckets": 96}, "96"),
    ({"buckets": -64}, "-64"),
    ({"buckets": MAX_BUCKETS * 2}, str(MAX_BUCKETS * 2)),
    ({"buckets": "64"}, "'64'"),
    ({"buckets": 64.0}, "64.0"),
    ({"buckets": True}, "True"),
    ({"routing_services": []}, "routing_services"),
    ({"storage_services": ","}, "storage_services"),
    ({"routing_services": [1, 2]}, "[1, 2]"),
    ({"storage_services": 5}, "5"),
    ({"storage_services": ["s1", "s1"]}, "['s1', 's1']"),
]


@pytest.mark.parametrize("attributes, shown", INVALID,
                         ids=[repr(attributes) for attributes, _shown in INVALID])
def test_invalid_attributes_raise_invalid_attribute_naming_the_value(attributes, shown):
    with pytest.raises(InvalidAttribute) as raised:
        check_request("words", attributes)
    assert shown in str(raised.value)


def test_invalid_attribute_is_a_value_error():
    with pytest.raises(ValueError):
        check_request("words", {"hash": "md5"})


def test_domus_rbt_is_a_ram_platform():
    assert check_request("words", {"platform": "domus-rbt"})["platform"] == "domus-rbt"
    with pytest.raises(InvalidAttribute, match="cannot store on 'disk'"):
        check_request("words", {"platform": "domus-rbt", "storage": "disk"})


@pytest.mark.parametrize("platform, medium, possible", [
    ("python-dict", "ram", True), ("python-dict", "disk", False),
    ("domus-rbt", "ram", True), ("domus-rbt", "disk", False),
    ("domus-bsddb-btree", "ram", True), ("domus-bsddb-btree", "disk", True),
    ("domus-bsddb-hash", "ram", True), ("domus-bsddb-hash", "disk", True),
])
def test_every_platform_and_medium_is_accepted_or_refused_clearly(platform, medium, possible):
    attributes = {"platform": platform, "storage": medium}
    if possible:
        checked = check_request("words", attributes)
        assert (checked["platform"], checked["storage"]) == (platform, medium)
        return
    with pytest.raises(InvalidAttribute, match=f"{platform!r} cannot store on {medium!r}; "
                                               f"it supports \\['ram'\\]"):
        check_request("words", attributes)


def test_an_unknown_platform_is_not_called_planned():
    with pytest.raises(InvalidAttribute) as raised:
        check_request("words", {"platform": "sqlite"})
    assert "not available" not in str(raised.value)
    assert "python-dict" in str(raised.value)        # tells what to use instead


@pytest.mark.parametrize("service_count", list(range(0, 70)) + [100, 1000, 4096])
def test_default_bucket_count_is_a_power_of_two_with_64_per_service(service_count):
    buckets = default_bucket_count(service_count)
    wanted = BUCKETS_PER_SERVICE * max(1, service_count)
    assert buckets & (buckets - 1) == 0
    assert buckets >= wanted
    assert buckets < 2 * wanted              # rounded up, not further
    check_request("words", {"buckets": buckets})   # and the supervisor accepts it


def test_default_bucket_count_examples():
    assert BUCKETS_PER_SERVICE == 64
    assert default_bucket_count(1) == 64
    assert default_bucket_count(2) == 128
    assert default_bucket_count(3) == 256


@pytest.mark.parametrize("storage, platform, durability, expected", [
    ("ram", "python-dict", None, "none"),
    ("ram", "domus-bsddb-btree", "none", "none"),
    ("disk", "domus-bsddb-btree", None, "async"),
    ("disk", "domus-bsddb-hash", "async", "async"),
    ("disk", "domus-bsddb-btree", "sync", "sync"),
])
def test_durability_defaults_to_async_on_disk_and_none_in_ram(storage, platform, durability,
                                                              expected):
    checked = check_request("words", {"storage": storage, "platform": platform,
                                      "durability": durability})
    assert checked["durability"] == expected


def test_durability_is_refused_where_it_means_nothing_or_is_unknown():
    with pytest.raises(InvalidAttribute, match="durability 'sync' is for disk DHTs"):
        check_request("words", {"storage": "ram", "durability": "sync"})
    with pytest.raises(InvalidAttribute, match="durability 'always' is unknown"):
        check_request("words", {"storage": "disk", "platform": "domus-bsddb-btree",
                                "durability": "always"})
