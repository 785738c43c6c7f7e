"""The deployment secret: what lets a deployment's own processes in, and
keeps everyone else out.

A supervisor creates one at its first start (``<data dir>/secret``: 32
random bytes, written as 64 hex digits, mode 0600) unless it is given one
(``--secret-file``), or runs ``--insecure``.  Every other process (services,
clients, the ``domus`` command) finds it, in this order:

1. ``--secret-file FILE`` (``domus.connect(secret_file=...)``);
2. ``$DOMUS_SECRET_FILE``;
3. ``./domus-data/supervisor/secret``, where ``domus up`` keeps it when run
   in the same directory.

A secret file must be readable by its owner only (as ssh's keys): one that
others may read is refused, saying how to fix it.  The secret itself never
travels: the control plane proves it with HMACs over fresh nonces, the data
plane with a MAC on every datagram (domus.wire.auth).  From the secret come
two keys, one per plane, so that neither is the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from dataclasses import dataclass

from domus.errors import AuthenticationError

SECRET_FILE = "secret"
SECRET_BYTES = 32
ENVIRONMENT = "DOMUS_SECRET_FILE"
DEFAULT_PATH = os.path.join("domus-data", "supervisor", SECRET_FILE)


@dataclass(frozen=True)
class Keys:
    """The keys a process of a secure deployment uses, and where they came
    from (for error messages)."""

    control: bytes          # HMAC-SHA256 key of the control plane's handshake
    data: bytes             # SipHash-2-4 key of the data plane's datagrams (16 bytes)
    source: str
    # Given on purpose (--secret-file, $DOMUS_SECRET_FILE), not found at the
    # default path: a peer that runs without a secret is then refused, since
    # it is not the deployment this process was told to trust.
    explicit: bool = True

    @classmethod
    def from_secret(cls, secret: bytes, source: str, explicit: bool = True) -> Keys:
        return cls(control=hmac.new(secret, b"domus control plane v1", hashlib.sha256).digest(),
                   data=hmac.new(secret, b"domus data plane v1", hashlib.sha256).digest()[:16],
                   source=source, explicit=explicit)


def create(path: str) -> bytes:
    """A new secret in ``path`` (mode 0600, created exclusively: an
    existing file is never overwritten); returns it.  The file appears
    whole or not at all (written under a temporary name, then linked), so a
    process that starts meanwhile never reads half a secret."""
    secret = secrets.token_bytes(SECRET_BYTES)
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o700, exist_ok=True)
    temporary = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "w", encoding="ascii") as target:
            target.write(secret.hex() + "\n")
            target.flush()
            os.fsync(target.fileno())
        os.link(temporary, path)        # (FileExistsError if one is there: never replaced)
    finally:
        os.unlink(temporary)
    return secret


def load(path: str) -> bytes:
    """The secret in ``path``; AuthenticationError saying what is wrong
    (missing, readable by others, not a secret)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise AuthenticationError(f"the deployment secret file {path} does not exist; give "
                                  f"the one the supervisor made (<its data dir>/secret) with "
                                  f"--secret-file or ${ENVIRONMENT}") from None
    except OSError as exc:
        raise AuthenticationError(f"cannot read the deployment secret file {path}: "
                                  f"{exc.strerror}") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AuthenticationError(f"the deployment secret file {path} may be read by others "
                                  f"(mode {stat.S_IMODE(info.st_mode):o}); `chmod 600 {path}`")
    try:
        with open(path, encoding="ascii") as source:
            text = source.read().strip()
        secret = bytes.fromhex(text)
    except (OSError, ValueError, UnicodeDecodeError):
        raise AuthenticationError(f"{path} is not a Domus deployment secret (64 hex "
                                  f"digits)") from None
    if len(secret) < 16:
        raise AuthenticationError(f"the deployment secret in {path} is {len(secret)} bytes; "
                                  f"it needs 16 at least")
    return secret


def find(explicit: str | None = None, *, environ: dict[str, str] | None = None) -> str | None:
    """The secret file a process uses (see the module's docstring), or None
    when none is given and the default does not exist."""
    if explicit:
        return explicit
    environ = os.environ if environ is None else environ   # type: ignore[assignment]
    named = environ.get(ENVIRONMENT, "").strip()
    if named:
        return named
    return DEFAULT_PATH if os.path.exists(DEFAULT_PATH) else None


def keys(explicit: str | None = None) -> Keys | None:
    """The keys from the secret file found (``find``), or None: insecure."""
    path = find(explicit)
    if path is None:
        return None
    return Keys.from_secret(load(path), path, explicit=path != DEFAULT_PATH or bool(explicit))


__all__ = ["Keys", "create", "load", "find", "keys", "SECRET_FILE", "ENVIRONMENT",
           "DEFAULT_PATH"]
