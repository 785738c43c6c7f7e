"""How many examples a property test runs: all of them, except where
``DOMUS_EXAMPLES_SCALE`` says to run a share (``make check-c`` runs the C
tests again under AddressSanitizer, 10x slower, on a fifth of the
examples; the normal suite has already run them all)."""

from __future__ import annotations

import os

SCALE = float(os.environ.get("DOMUS_EXAMPLES_SCALE", "1") or 1)


def examples(count: int) -> int:
    """``count`` scaled down as the environment asks, never below 10."""
    return count if SCALE >= 1 else max(10, int(count * SCALE))
