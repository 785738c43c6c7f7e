"""Fuzz target of the TCP handshake (domus.wire.auth's HELLO, PROOF,
ACCEPT and REFUSE, as domus.wire.control's MessageProtocol reads them
before anything else on every connection), and of the sealed frames after.

``handshake``: the bytes a peer sends on a new connection.  An input is a
settings byte, then the stream:

    bit 0   this end's side: 0 accepted the connection (it sent HELLO and
            reads PROOF), 1 connected (it reads HELLO, then ACCEPT or REFUSE)
    bit 1   this end holds the deployment's secret
    bit 2   the peer proves itself: the harness writes the right proof into
            the handshake frame of the right kind and length (PROOF, or
            ACCEPT), and seals every whole frame after the handshake with
            the session's key, so the fuzzer gets past the handshake
    bit 3   (the side that connected) its secret was given explicitly

What each input must show: nothing escapes ``dataReceived``; the
connection is authenticated exactly when docs/protocol.md's handshake says
(an expectation computed here from the spec, not by domus.wire.auth); the
handshake frames this end sends are exactly the spec's (its nonce is the
harness's); a refused peer gets a REFUSE with a reason (the side that
accepted) and the connection is closed, its other frames unread, its
refusal counted once, and a call waiting on it fails with
AuthenticationError; nothing but the handshake is sent before it ends; on
a secure connection every frame sent after it opens with the session's
key, and a frame that does not check closes the connection unanswered;
every frame answered is a well-formed reply to a request that came in.
"""

from __future__ import annotations

import hashlib
import hmac
import types
from typing import Any

from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from domus.errors import AuthenticationError
from domus.service.handler import RequestHandler
from domus.wire import auth, control
from domus.wire import protocol as wire
from domus.wire.control import MessageProtocol
from domus.wire.secret import Keys
from fuzz.control import DHT, KEY, QUIET, _well_formed_reply, control_handler, framed, frames
from fuzz.harness import Finding, check, target

KEYS = Keys.from_secret(bytes(range(32)), "fuzz")
IMPLICIT_KEYS = Keys.from_secret(bytes(range(32)), "fuzz", explicit=False)
OTHER_KEYS = Keys.from_secret(bytes(range(1, 33)), "another deployment")
NONCE = bytes(range(0xA0, 0xB0))        # this end's nonce
PEER_NONCE = bytes(range(0xC0, 0xD0))   # the seeds' peer's
MAGIC = bytes((auth.AUTH_MAGIC, auth.AUTH_VERSION))
ACCEPTED, CONNECTED = 0, 1


def hmac256(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


class Nonces:
    """domus.wire.auth's random source, while a handshake object is made:
    the given nonces, in turn (so that runs repeat)."""

    def __init__(self, *nonces: bytes) -> None:
        self.nonces = list(nonces)

    def __enter__(self) -> None:
        self.kept = auth.os
        auth.os = types.SimpleNamespace(urandom=lambda size: self.nonces.pop(0)[:size])

    def __exit__(self, *_exc: Any) -> None:
        auth.os = self.kept


# ------------------------------------------------------------ the spec

class Expected:
    """What docs/protocol.md's handshake makes of a stream's first frames:
    the frames this end sends, whether it authenticates, and the session
    key (a secure connection)."""

    def __init__(self, side: int, keys: Keys | None, handshake: list[bytes]) -> None:
        self.sent: list[bytes] = []
        self.authenticated = False
        self.refused = False            # (this end refuses, or the peer refused it)
        self.session_key: bytes | None = None
        self.frames_read = 0            # handshake frames consumed
        if side == ACCEPTED:
            self._accepting(keys, handshake)
        else:
            self._connecting(keys, handshake)

    def _accepting(self, keys: Keys | None, handshake: list[bytes]) -> None:
        self.sent.append(MAGIC + b"H" + bytes((keys is not None,)) + NONCE)
        if not handshake:
            return
        self.frames_read = 1
        frame = handshake[0]
        if frame[:3] != MAGIC + b"P" or len(frame) != 3 + 16 + 32:
            self.refused = True
            return
        theirs, proof = frame[3:19], frame[19:]
        if keys is None:
            self.sent.append(MAGIC + b"A" + bytes(32))
        elif hmac.compare_digest(proof, hmac256(keys.control, b"connect", NONCE, theirs)):
            self.sent.append(MAGIC + b"A" + hmac256(keys.control, b"accept", theirs, NONCE))
            self.session_key = hmac256(keys.control, b"session", NONCE, theirs)
        else:
            self.refused = True
            return
        self.authenticated = True

    def _connecting(self, keys: Keys | None, handshake: list[bytes]) -> None:
        if not handshake:
            return
        self.frames_read = 1
        hello = handshake[0]
        if hello[:3] != MAGIC + b"H" or len(hello) != 3 + 1 + 16:
            self.refused = True
            return
        secure, theirs = bool(hello[3]), hello[4:]
        if keys is not None and keys.explicit and not secure:
            self.refused = True
            return
        proving = keys is not None and secure
        self.sent.append(MAGIC + b"P" + NONCE + (hmac256(keys.control, b"connect", theirs, NONCE)
                                                 if proving else bytes(32)))
        if len(handshake) < 2:
            return
        self.frames_read = 2
        verdict = handshake[1]
        if verdict[:3] != MAGIC + b"A" or len(verdict) != 3 + 32:
            self.refused = True
            return
        if proving:
            if not hmac.compare_digest(verdict[3:], hmac256(keys.control, b"accept", NONCE,
                                                            theirs)):
                self.refused = True
                return
            self.session_key = hmac256(keys.control, b"session", theirs, NONCE)
        self.authenticated = True


# ------------------------------------------------------------ one connection

def prove(side: int, keys: Keys | None, stream: bytes) -> bytes:
    """The stream with the right proof written into its handshake frame of
    the right kind and length, and its frames after the handshake sealed
    with the session's key (when the spec gives it one)."""
    whole = frames(stream)
    rest = stream[len(framed(*whole)):]
    if keys is not None and side == ACCEPTED and whole and whole[0][:3] == MAGIC + b"P" \
            and len(whole[0]) == 51:
        theirs = whole[0][3:19]
        whole[0] = whole[0][:19] + hmac256(keys.control, b"connect", NONCE, theirs)
    if keys is not None and side == CONNECTED and len(whole) >= 2 \
            and whole[0][:3] == MAGIC + b"H" and len(whole[0]) == 20 and whole[0][3] \
            and whole[1][:3] == MAGIC + b"A" and len(whole[1]) == 35:
        whole[1] = whole[1][:3] + hmac256(keys.control, b"accept", NONCE, whole[0][4:])
    expected = Expected(side, keys, whole[:2])
    if expected.session_key is not None:
        session = peer_session(side, expected.session_key)
        read = expected.frames_read
        whole = whole[:read] + [session.seal(frame) for frame in whole[read:]]
    return framed(*whole) + rest


def peer_session(side: int, key: bytes) -> auth.Session:
    """The peer's end of the session (it sends in the other direction)."""
    key = key[:32]
    return auth.Session(key, sends=1 if side == ACCEPTED else 0,
                        receives=0 if side == ACCEPTED else 1)


class End:
    """This end of a new connection: a MessageProtocol on one side, with a
    service's handlers, which (the side that connected) has made a call."""

    def __init__(self, side: int, keys: Keys | None) -> None:
        self.protocol = MessageProtocol()
        self.protocol.clock = Clock()
        self.protocol.keys = keys
        self.protocol.accepting = side == ACCEPTED
        self.protocol.control_handler = control_handler
        self.refusals: list[str] = []
        self.protocol.auth_failures = self.refusals.append
        service = RequestHandler("s1")
        service.assign(DHT)
        self.protocol.data_handler = service.handle_fast
        self.transport = StringTransport()
        self.verdict: list[Any] = []
        self.protocol.authenticated.addBoth(self.verdict.append)
        self.call: list[Any] = []
        with Nonces(NONCE):
            self.protocol.makeConnection(self.transport)
        if side == CONNECTED:
            self.protocol.call("stats").addBoth(self.call.append)

    def feed(self, stream: bytes) -> bytes:
        logger, control.log = control.log, QUIET
        try:
            self.protocol.dataReceived(stream)
            sent = self.transport.value()
            self.protocol.connectionLost(None)
        finally:
            control.log = logger
        return sent


def settings(side: int, keys: bool, proving: bool, explicit: bool = True) -> int:
    return side | keys << 1 | proving << 2 | explicit << 3


def end_keys(byte: int) -> Keys | None:
    if not byte & 2:
        return None
    return KEYS if byte & 8 or not byte & 1 else IMPLICIT_KEYS


@target("handshake", seeds=lambda: handshake_seeds(), sweep_seeds=lambda: sweep_seeds(),
        fixed=1, smoke=1500, max_len=4096)
def fuzz_handshake(data: bytes) -> None:
    """A new TCP connection's bytes into MessageProtocol on either side,
    with or without the secret: authenticated exactly when the spec says,
    the spec's handshake frames sent, refusals well-formed and final, and
    after the handshake only sealed, well-formed replies."""
    if not data:
        return
    side, keys = data[0] & 1, end_keys(data[0])
    stream = prove(side, keys, data[1:]) if data[0] & 4 else data[1:]
    whole = frames(stream)
    expected = Expected(side, keys, whole[:2])
    end = End(side, keys)
    sent = end.feed(stream)
    protocol = end.protocol
    sent_frames = frames(sent)
    check(framed(*sent_frames) == sent, f"what was sent is not whole frames: {sent[:80]!r}")
    handshake_sent = sent_frames[:len(expected.sent)]
    check(handshake_sent == expected.sent,
          f"the handshake frames sent are {handshake_sent!r}, not the spec's {expected.sent!r}")
    authenticated = end.verdict == [protocol]
    check(authenticated == expected.authenticated,
          f"authenticated: {authenticated}, the spec says {expected.authenticated}, "
          f"after {[frame[:60] for frame in whole[:2]]!r}")
    check(protocol.secure == (expected.session_key is not None),
          f"a secure session: {protocol.secure}, the spec says "
          f"{expected.session_key is not None}")
    after = sent_frames[len(expected.sent):]
    if expected.refused:
        check(protocol._refusal is not None, "a refused peer was not refused")
        check(end.transport.disconnecting, "a refused peer's connection stays open")
        if side == ACCEPTED:
            check(len(end.refusals) == 1, f"a refusal counted {len(end.refusals)} times")
            check(len(after) == 1 and after[0][:3] == MAGIC + b"X"
                  and 0 < len(after[0]) - 3 <= 512 and _utf8(after[0][3:]),
                  f"a refused peer got {after!r}, not one REFUSE with a reason")
        else:
            check(not after, f"the side that connected sent {after!r} after refusing")
            check(len(end.verdict) == 1 and isinstance(end.verdict[0], Failure)
                  and isinstance(end.verdict[0].value, AuthenticationError),
                  f"the handshake ended {end.verdict!r}, not in AuthenticationError")
            check(len(end.call) == 1 and isinstance(end.call[0], Failure)
                  and isinstance(end.call[0].value, AuthenticationError),
                  f"the call waiting on a refused handshake ended {end.call!r}")
        return
    if not expected.authenticated:
        check(not end.refusals, f"refusals counted for a peer not refused: {end.refusals}")
        check(not after, f"{after!r} sent before the handshake ended")
        return
    asked = {}
    tampered = False
    reader = peer_session(side ^ 1, expected.session_key) if expected.session_key else None
    for frame in whole[expected.frames_read:]:
        if reader is not None:          # (as this end reads what the peer sent)
            try:
                frame = reader.open(frame)
            except AuthenticationError:
                tampered = True
                break
        if len(frame) >= wire.REQUEST_HEADER_SIZE and frame[0] == wire.REQUEST_MAGIC:
            asked[frame[4:8]] = frame[2]
    if tampered:
        check(end.transport.disconnecting, "a frame that does not check left the "
              "connection open")
        if side == ACCEPTED:
            check(len(end.refusals) == 1, f"a frame that does not check counted "
                  f"{len(end.refusals)} times")
            check(bool(after) and after[-1][:3] == MAGIC + b"X",
                  f"a frame that does not check was answered {after[-1:]!r}, not REFUSE")
            after = after[:-1]
    check(tampered and side == ACCEPTED or not end.refusals,
          f"refusals counted for a peer not refused: {end.refusals}")
    opener = peer_session(side, expected.session_key) if expected.session_key else None
    call_frames = 1 if side == CONNECTED else 0
    for number, frame in enumerate(after):
        if opener is not None:
            try:
                frame = opener.open(frame)
            except AuthenticationError as exc:
                raise Finding(f"frame {number} sent after the handshake does not open: "
                              f"{frame[:60]!r}") from exc
        if number < call_frames:
            check(frame[:1] == bytes((wire.REQUEST_MAGIC,)) and frame[2] == wire.OP_CONTROL,
                  f"the call held during the handshake went out as {frame[:40]!r}")
            continue
        _well_formed_reply(frame, asked)


def _utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def sweep_seeds() -> list[bytes]:
    """Each handshake, followed by one small request only: what follows the
    handshake is control_stream's to sweep."""
    return handshake_seeds(framed(wire.request_header(wire.OP_PING, 9, 1)))


def handshake_seeds(after: bytes | None = None) -> list[bytes]:
    """Handshakes made by domus.wire.auth's own classes (the peer's nonce
    fixed), each followed by ``after``: a control call and a data request
    unless told."""
    if after is None:
        after = framed(wire.encode_control(7, 1, {"op": "echo", "value": 1}),
                       wire.encode_keyed(wire.OP_GET, 8, 1, 1, 0, KEY))
    found = []
    for keys, peer_keys, proving in ((KEYS, KEYS, True), (KEYS, OTHER_KEYS, False),
                                     (KEYS, None, False), (None, None, False),
                                     (None, IMPLICIT_KEYS, False)):
        # This end accepted: the peer connected and answers its HELLO.
        with Nonces(NONCE):
            accepting = auth.Accepting(keys)
        with Nonces(PEER_NONCE):
            connecting = auth.Connecting(peer_keys, "fuzz")
        try:
            proof = connecting.hello(accepting.hello())
        except AuthenticationError:
            proof = b""         # (the peer refuses this end: it sends nothing)
        found.append(bytes((settings(ACCEPTED, keys is not None, proving),)) + framed(proof)
                     + after)
        # This end connected: the peer accepted, says HELLO, then its verdict.
        with Nonces(PEER_NONCE):
            peer = auth.Accepting(peer_keys)
        with Nonces(NONCE):
            connecting = auth.Connecting(keys, "fuzz")
        hello = peer.hello()
        try:
            verdict = peer.proof(connecting.hello(hello))[0]
        except AuthenticationError as exc:
            verdict = auth.Accepting.refusal(str(exc))
        found.append(bytes((settings(CONNECTED, keys is not None, proving),)) + framed(
            hello, verdict) + after)
    found.append(bytes((settings(ACCEPTED, True, True),)) + after)        # no handshake at all
    found.append(bytes((settings(CONNECTED, True, True, explicit=False),))
                 + framed(MAGIC + b"H\x00" + PEER_NONCE, MAGIC + b"A" + bytes(32)) + after)
    return found


__all__ = ["fuzz_handshake", "Expected"]
