"""What every fuzz target shares.

A *target* is ``run(data)`` for one entry point that reads bytes from a
peer, registered with ``@target``.  It raises ``Finding`` (an
AssertionError) when an input shows a bug; any other exception escaping it
is a bug as well.  atheris (``python -m fuzz.run``) keeps the input of
either; the suite (``fuzz/test_fuzz.py``) names the seed and the change
that made it.

The three checks every target makes on every input:

1. *No crash, no sanitizer report.*  Under AddressSanitizer the C code's
   input is *fenced* (``fenced``): the byte just after a bytes object's
   contents (its terminating NUL, inside the allocation, so ASan would not
   see a read of it) is poisoned while the C code runs, so an over-read of
   even one byte is a report, not a silent read of a zero.
2. *Only the documented rejection errors* (``documented``): the decoders
   raise ProtocolError, values ValueDecodeError, services answer with a
   status of docs/protocol.md, never INTERNAL.
3. *C and Python agree* (``same``): the C function and its pure-Python
   twin give equal results, or the same exception type with the same
   message.

The boundary sweep (``boundary_variants``) and the smoke's mutator
(``Mutator``) live here too: both are deterministic.
"""

from __future__ import annotations

import ctypes
import importlib
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REGRESSIONS = HERE / "regressions"
# The modules that register targets, in the order they are listed.
MODULES = ("fuzz.service", "fuzz.sealed", "fuzz.client", "fuzz.control", "fuzz.handshake")


class Finding(AssertionError):
    """An input that shows a bug: a difference between the C code and its
    Python twin, an undocumented error, a malformed or missing answer."""


# ------------------------------------------------------------ the registry

@dataclass(frozen=True)
class Target:
    """One fuzz target.  ``seeds()`` builds its seed inputs with the
    project's encoders; ``sweep_seeds()`` the ones the suite sweeps (all of
    them unless the target says otherwise); ``fixed`` leading bytes of an
    input are settings (a platform, a reply limit), which the sweep leaves
    alone.  ``smoke`` is how many mutated inputs the suite's smoke runs,
    ``max_len`` the longest input libFuzzer makes, ``c_sources`` the C
    files whose coverage ``fuzz.run`` reports."""

    name: str
    run: Callable[[bytes], None]
    seeds: Callable[[], list[bytes]]
    doc: str
    sweep_seeds: Callable[[], list[bytes]] | None = None
    fixed: int = 0
    smoke: int = 3000
    max_len: int = 4096
    c_sources: tuple[str, ...] = ()
    dictionary: tuple[bytes, ...] = field(default=())

    def sweep_inputs(self) -> list[bytes]:
        return (self.sweep_seeds or self.seeds)()


TARGETS: dict[str, Target] = {}


def target(name: str, *, seeds: Callable[[], list[bytes]],
           sweep_seeds: Callable[[], list[bytes]] | None = None, fixed: int = 0,
           smoke: int = 3000, max_len: int = 4096, c_sources: Sequence[str] = (),
           dictionary: Sequence[bytes] = ()) -> Callable[[Callable[[bytes], None]],
                                                         Callable[[bytes], None]]:
    """Register ``run`` as the fuzz target ``name`` (its docstring says what
    it checks)."""
    def register(run: Callable[[bytes], None]) -> Callable[[bytes], None]:
        if name in TARGETS:
            raise ValueError(f"two fuzz targets are called {name!r}")
        TARGETS[name] = Target(name, run, seeds, (run.__doc__ or "").strip(), sweep_seeds,
                               fixed, smoke, max_len, tuple(c_sources), tuple(dictionary))
        return run
    return register


def load() -> dict[str, Target]:
    """Every target, by name."""
    for module in MODULES:
        importlib.import_module(module)
    return TARGETS


def regressions(name: str) -> list[tuple[str, bytes]]:
    """The inputs kept in fuzz/regressions/NAME/ (crashes found once, kept
    so that the suite replays them), as (file name, bytes)."""
    folder = REGRESSIONS / name
    if not folder.is_dir():
        return []
    return [(path.name, path.read_bytes()) for path in sorted(folder.iterdir())
            if path.is_file() and not path.name.startswith(".")]


# ------------------------------------------------------------ the fence

_NUL_OFFSET = bytes.__basicsize__ - 1      # where a bytes object's contents start


def _asan_interface() -> tuple[Any, Any, Any] | None:
    """ASan's poisoning functions, when an ASan runtime is loaded."""
    try:
        process = ctypes.CDLL(None)
        poison = getattr(process, "__asan_poison_memory_region")
        unpoison = getattr(process, "__asan_unpoison_memory_region")
        is_poisoned = getattr(process, "__asan_address_is_poisoned")
    except (AttributeError, OSError):
        return None
    for function in (poison, unpoison):
        function.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        function.restype = None
    is_poisoned.argtypes = (ctypes.c_void_p,)
    is_poisoned.restype = ctypes.c_int
    return poison, unpoison, is_poisoned


def _nul_address(data: bytes) -> int:
    return id(data) + _NUL_OFFSET + len(data)


def _probe_fence(interface: tuple[Any, Any, Any] | None) -> bool:
    """Whether poisoning a bytes object's terminating NUL takes: it does
    under ASan with PYTHONMALLOC=malloc (each object its own allocation,
    which ends right after the NUL), not inside pymalloc's arenas."""
    if interface is None:
        return False
    poison, unpoison, is_poisoned = interface
    probe = bytes(range(7, 20))
    if ctypes.string_at(id(probe) + _NUL_OFFSET, len(probe) + 1) != probe + b"\0":
        return False        # not the bytes layout this relies on
    address = _nul_address(probe)
    poison(address, 1)
    try:
        return bool(is_poisoned(address))
    finally:
        unpoison(address, 1)


_ASAN = _asan_interface()
FENCE_ACTIVE = _probe_fence(_ASAN)


@contextmanager
def fenced(*objects: Any) -> Iterator[None]:
    """While the block runs, the byte after each bytes object's contents is
    poisoned (when ``FENCE_ACTIVE``), so that C code reading past the end of
    its input is an ASan report even by one byte.  Objects of one byte or
    none are shared singletons and are left alone; so is anything that is
    not exactly bytes.  Only C code runs inside: Python's own bytes
    functions never read the terminator, but a fence is a place to be
    careful."""
    if not FENCE_ACTIVE:
        yield
        return
    poison, unpoison, _is_poisoned = _ASAN  # type: ignore[misc]
    addresses = [_nul_address(item) for item in objects
                 if type(item) is bytes and len(item) > 1]
    for address in addresses:
        poison(address, 1)
    try:
        yield
    finally:
        for address in addresses:
            unpoison(address, 1)


# ------------------------------------------------------------ the checks

Outcome = tuple[Any, ...]


def outcome(function: Callable[..., Any], *args: Any) -> Outcome:
    """("ok", result) or ("error", exception type, message)."""
    try:
        return ("ok", function(*args))
    except Exception as exc:  # noqa: BLE001 - every exception is an outcome
        return ("error", type(exc), str(exc))


def c_outcome(function: Callable[..., Any], *args: Any) -> Outcome:
    """``outcome`` of a C function, its bytes arguments fenced."""
    with fenced(*args):
        return outcome(function, *args)


def describe(result: Outcome, limit: int = 300) -> str:
    if result[0] == "ok":
        text = repr(result[1])
    else:
        text = f"{result[1].__name__}: {result[2]}"
    return text if len(text) <= limit else text[:limit] + "..."


def equal(got: Outcome, expected: Outcome) -> bool:
    """Outcomes are equal: the same error type and message, or results with
    the same repr (NaN is not equal to itself; 1, 1.0 and True are equal)."""
    if got[0] != expected[0]:
        return False
    if got[0] == "error":
        return got[1] is expected[1] and got[2] == expected[2]
    return type(got[1]) is type(expected[1]) and repr(got[1]) == repr(expected[1])


def same(what: str, c_result: Outcome, python_result: Outcome) -> None:
    """Finding unless the C and the Python outcome are equal."""
    if not equal(c_result, python_result):
        raise Finding(f"{what}: C and Python differ\n  C:      {describe(c_result)}\n"
                      f"  Python: {describe(python_result)}")


def documented(what: str, result: Outcome, *errors: type[BaseException]) -> None:
    """Finding if ``result`` is an error other than the documented ones."""
    if result[0] == "error" and not issubclass(result[1], errors):
        names = ", ".join(error.__name__ for error in errors) or "none"
        raise Finding(f"{what} raised {describe(result)}; the documented errors are {names}")


def check(condition: bool, message: str) -> None:
    if not condition:
        raise Finding(message)


# ------------------------------------------------------------ the sweep

SWEEP_WINDOW = 256      # a longer seed is swept at its first and last 256 bytes


def boundary_variants(seed: bytes, fixed: int = 0,
                      window: int = SWEEP_WINDOW) -> Iterator[tuple[str, bytes]]:
    """(what was done, input) for every boundary case of ``seed``: every
    truncation, one extra byte, and each byte set to its neighbours (+1 and
    -1), to 0x00 and to 0xFF, the ``fixed`` leading bytes left alone.  In a
    body longer than ``2 * window`` bytes only the first and last ``window``
    positions are cut and changed (the middle of a long value is data)."""
    head, body = seed[:fixed], seed[fixed:]
    size = len(body)
    if size <= 2 * window:
        positions: Sequence[int] = range(size)
    else:
        positions = [*range(window), *range(size - window, size)]
    for position in positions:
        yield f"cut to {position} bytes", head + body[:position]
    yield "one extra byte", head + body + b"\0"
    for position in positions:
        old = body[position]
        for new in sorted({(old + 1) & 0xFF, (old - 1) & 0xFF, 0x00, 0xFF} - {old}):
            yield (f"byte {position} 0x{old:02x} -> 0x{new:02x}",
                   head + body[:position] + bytes((new,)) + body[position + 1:])


# ------------------------------------------------------------ the smoke's mutator

INTERESTING_8 = (0x00, 0x01, 0x7F, 0x80, 0xFE, 0xFF)
INTERESTING_16 = (0x0000, 0x0001, 0x00FF, 0x0100, 0x7FFF, 0x8000, 0xFFFE, 0xFFFF)
INTERESTING_32 = (0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF)


class Mutator:
    """Seeded random mutations of seed inputs, in the spirit of libFuzzer's
    (bit flips, interesting bytes and big-endian lengths, erased, inserted,
    repeated and spliced spans), without coverage feedback: the suite's
    smoke, the same every run.  ``fixed`` leading bytes are kept."""

    def __init__(self, seeds: Sequence[bytes], seed: int, fixed: int = 0,
                 max_len: int = 4096) -> None:
        if not seeds:
            raise ValueError("a mutator needs at least one seed")
        self.seeds = list(seeds)
        self.rng = random.Random(seed)
        self.fixed = fixed
        self.max_len = max_len

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        rng = self.rng
        data = rng.choice(self.seeds)
        head, body = data[:self.fixed], bytearray(data[self.fixed:])
        if self.fixed and rng.random() < 0.2:
            head = bytes(rng.getrandbits(8) for _ in range(self.fixed))
        for _ in range(rng.choice((1, 1, 2, 3, 4, 6))):
            self._mutate(body)
        return head + bytes(body[:max(0, self.max_len - self.fixed)])

    def _mutate(self, body: bytearray) -> None:
        rng = self.rng
        size = len(body)
        how = rng.randrange(11)
        position = rng.randrange(size) if size else 0
        if how == 0 and size:
            body[position] ^= 1 << rng.randrange(8)
        elif how == 1 and size:
            body[position] = rng.choice(INTERESTING_8)
        elif how == 2 and size:
            body[position] = rng.getrandbits(8)
        elif how == 3 and size >= 2:
            position = rng.randrange(size - 1)
            body[position:position + 2] = rng.choice(
                INTERESTING_16 + ((size - position) & 0xFFFF,)).to_bytes(2, "big")
        elif how == 4 and size >= 4:
            position = rng.randrange(size - 3)
            body[position:position + 4] = rng.choice(
                INTERESTING_32 + (size - position, size - position - 4)).to_bytes(4, "big")
        elif how == 5 and size:
            del body[position:position + rng.randint(1, 8)]
        elif how == 6:
            body[position:position] = rng.randbytes(rng.randint(1, 8))
        elif how == 7 and size:
            span = body[position:position + rng.randint(1, 16)]
            at = rng.randrange(size + 1)
            body[at:at] = span * rng.randint(1, 3)
        elif how == 8:
            del body[rng.randint(0, size):]
        elif how == 9:
            body += rng.randbytes(rng.randint(1, 4))
        else:
            other = rng.choice(self.seeds)[self.fixed:]
            cut = rng.randint(0, len(other))
            body[position:] = other[cut:]
