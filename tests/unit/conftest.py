"""Unit tests run without a deployment's secret in the environment: an
integration module's deployment that ran before in the same process
(pytest-xdist hands a worker tests of both kinds) must not make a unit
test's service secure, or its client ask a fake supervisor for a
handshake.  A test that wants the variable sets it itself."""

from __future__ import annotations

import pytest

from domus.wire import secret


@pytest.fixture(autouse=True)
def _no_secret_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(secret.ENVIRONMENT, raising=False)
