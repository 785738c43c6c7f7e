"""Fuzz targets for every function that reads bytes from a peer.

Each target is a function of one input, for one entry point: the service's
request handling (the C hot path against the Python handler, on every
storage platform, with UDP and TCP reply limits, and over a real UDP
socket), a secure service's sealed datagrams (the C trailer check against
the Python path's) and ``open_request``/``open_reply``, each reply decoder
of the clients (C against Python where both exist), the client's round
trip, the control plane's TCP framing, the asyncio client's TCP frame
reader (against the blocking client's), and the TCP handshake (HELLO,
PROOF, ACCEPT, REFUSE and the sealed frames after it).
Every input goes through three checks: no crash and no sanitizer report,
only the documented rejection errors, and the same answer from the C code
and its pure-Python twin (see fuzz/harness.py).

- ``python -m fuzz.run --seconds N [TARGET ...]`` runs targets under
  libFuzzer (atheris), coverage-guided; ``make fuzz SECONDS=N`` builds the C
  extensions with ASan, UBSan and libFuzzer's coverage instrumentation
  first, and prints executions and coverage per target.
- ``fuzz/test_fuzz.py`` (run by ``make check-c``, so by ``make test``, on the
  sanitizer build) replays every input in ``fuzz/regressions/``, sweeps every
  seed's boundaries (every truncation, one extra byte, each byte set to its
  neighbours, 0x00 and 0xFF) and gives each target a short smoke of seeded
  random mutations.

Seeds are built by the project's own encoders at run time, so they follow
the wire format as it is today; only crash reproducers are kept as bytes.
"""
