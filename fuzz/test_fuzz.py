"""The fuzz targets in the suite: every regression input replayed, every
seed's boundaries swept, and a short smoke of seeded mutations per target.

``make check-c`` (so ``make test``) runs this file on the sanitizer build,
each object its own allocation (PYTHONMALLOC=malloc), where the harness
fences each input of the C code: a read even one byte past its end is an
ASan report, which ends the run.  What each input must show otherwise is
in fuzz/harness.py; a failure names the target, the seed and what was
changed in it.  Everything here is deterministic: the same inputs every run.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
import zlib

import pytest

from fuzz import harness

TARGETS = harness.load()
UNDER_ASAN = "libasan" in os.environ.get("LD_PRELOAD", "")
# The service's sweep is the longest: it is cut in parts that run side by side.
SWEEP_PARTS = {"service": 4}


def failed(name: str, where: str, data: bytes, error: BaseException) -> None:
    pytest.fail(f"fuzz target {name}: {where} ({len(data)} bytes: {data[:64]!r}"
                f"{'...' if len(data) > 64 else ''}):\n{type(error).__name__}: {error}",
                pytrace=False)


def run(name: str, where: str, data: bytes) -> None:
    CURRENT[0] = (name, where, data)
    try:
        TARGETS[name].run(data)
    except Exception as error:  # noqa: BLE001 - a Finding or an escaped error: both bugs
        failed(name, where, data, error)
    finally:
        CURRENT[0] = None


# A sanitizer report ends the process before pytest can say which input
# made it: the sanitizer's death callback says so, after the report.
CURRENT: list[tuple[str, str, bytes] | None] = [None]


@ctypes.CFUNCTYPE(None)
def _say_which_input() -> None:
    if CURRENT[0] is not None:
        name, where, data = CURRENT[0]
        os.write(2, f"\nfuzz: the sanitizer stopped fuzz target {name} on {where}; the "
                    f"input, in hex: {data.hex()}\n".encode())


if UNDER_ASAN:
    ctypes.CDLL(None).__sanitizer_set_death_callback(_say_which_input)


# ------------------------------------------------------------ the registry

def test_the_targets_cover_every_entry_point():
    assert sorted(TARGETS) == sorted([
        "service", "service_udp", "sealed_udp", "open_datagram", "handshake",
        "unpack_value", "get_many_take", "decode_get_many_reply", "decode_scan_reply",
        "decode_range_reply", "lookup_reply", "decode_key", "client_roundtrip",
        "sealed_roundtrip", "control_stream", "control_reply", "aio_stream"])
    for target in TARGETS.values():
        assert target.doc, f"{target.name} says nothing of what it checks"
        assert target.seeds(), f"{target.name} has no seeds"


def test_every_regression_folder_belongs_to_a_target():
    # A renamed target would leave its regression inputs unreplayed.
    if harness.REGRESSIONS.is_dir():
        folders = {path.name for path in harness.REGRESSIONS.iterdir() if path.is_dir()}
        assert folders <= set(TARGETS), folders - set(TARGETS)


def test_the_inputs_of_the_c_code_are_fenced_under_asan():
    if not UNDER_ASAN:
        pytest.skip("not under AddressSanitizer (make check-c runs this file under it)")
    assert harness.FENCE_ACTIVE, "PYTHONMALLOC=malloc is needed for the fence"
    # A read of the byte just past a fenced input is a report (in a child:
    # ASan ends the process it finds one in).
    probe = textwrap.dedent("""
        import ctypes
        from fuzz import harness
        data = bytes(range(40, 60))
        with harness.fenced(data):
            ctypes.string_at(id(data) + bytes.__basicsize__ - 1, len(data) + 1)
        """)
    child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           timeout=120)
    assert child.returncode != 0
    assert "AddressSanitizer: heap-buffer-overflow" in child.stderr \
        or "AddressSanitizer: use-after-poison" in child.stderr, child.stderr[-2000:]
    # ... and the byte is readable again once the C code is done.
    data = bytes(range(40, 60))
    with harness.fenced(data):
        pass
    assert harness.ctypes.string_at(id(data) + bytes.__basicsize__ - 1, 21) == data + b"\0"


def test_the_sweep_makes_every_boundary_case():
    variants = dict(harness.boundary_variants(b"\x07ab\xff", fixed=1))
    cuts = {what: data for what, data in variants.items() if what.startswith("cut")}
    assert sorted(cuts.values()) == [b"\x07", b"\x07a", b"\x07ab"]
    assert variants["one extra byte"] == b"\x07ab\xff\x00"
    assert variants["byte 0 0x61 -> 0x62"] == b"\x07bb\xff"
    assert variants["byte 0 0x61 -> 0x60"] == b"\x07`b\xff"
    assert variants["byte 2 0xff -> 0x00"] == b"\x07ab\x00"
    assert variants["byte 2 0xff -> 0xfe"] == b"\x07ab\xfe"
    assert "byte 2 0xff -> 0xff" not in variants
    assert len(variants) == 3 + 1 + 4 + 4 + 2      # 0xff's neighbours are 0xfe and 0x00


# ------------------------------------------------------------ replays, sweeps, smokes

@pytest.mark.parametrize("name", sorted(TARGETS))
def test_regression_inputs_are_handled(name):
    for file_name, data in harness.regressions(name):
        run(name, f"regression input fuzz/regressions/{name}/{file_name}", data)


SWEEPS = [(name, part) for name in sorted(TARGETS) for part in range(SWEEP_PARTS.get(name, 1))]


@pytest.mark.parametrize(("name", "part"), SWEEPS,
                         ids=[f"{name}-{part}" for name, part in SWEEPS])
def test_boundary_sweep(name, part):
    target = TARGETS[name]
    parts = SWEEP_PARTS.get(name, 1)
    seeds = target.sweep_inputs()
    for index in range(part, len(seeds), parts):
        seed = seeds[index]
        for what, data in harness.boundary_variants(seed, target.fixed):
            run(name, f"seed {index} ({len(seed)} bytes: {seed[:40]!r}...), {what}", data)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_smoke(name):
    target = TARGETS[name]
    mutator = harness.Mutator(target.seeds(), seed=zlib.crc32(name.encode()),
                              fixed=target.fixed, max_len=target.max_len)
    for number, data in zip(range(target.smoke), mutator):
        run(name, f"smoke input {number} (seed {zlib.crc32(name.encode())})", data)
