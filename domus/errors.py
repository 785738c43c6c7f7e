"""Every error Domus raises on purpose.

Each message says what went wrong and what to do about it.  The classes also
derive from the matching built-in exception (``TypeError``, ``ValueError``,
``ConnectionError``, ``LookupError``) so that generic handlers keep working.
"""

from __future__ import annotations

from typing import Any


class DomusError(Exception):
    """Base class of every Domus error."""


class ProtocolError(DomusError, ValueError):
    """A message that does not follow docs/protocol.md (malformed, truncated,
    wrong magic or version).  The codec raises nothing else on bad bytes."""


class SupervisorUnreachable(DomusError, ConnectionError):
    """The supervisor did not answer in time, or refused the connection."""


class SupervisorError(DomusError):
    """The supervisor answered, but could not do what was asked."""


class UnknownDht(SupervisorError, LookupError):
    """No DHT of that name (or id) exists in the deployment."""


class DhtExists(SupervisorError):
    """A DHT of that name already exists."""


class InvalidAttribute(SupervisorError, ValueError):
    """A DHT attribute has a value Domus cannot use."""


class UnknownService(SupervisorError, LookupError):
    """No service of that name is registered."""


class NoServices(SupervisorError):
    """The operation needs at least one live service and there is none."""


class PlatformUnavailable(SupervisorError):
    """No service (or not a named one) can run the DHT's storage platform:
    the Berkeley DB platforms need ``domus[bdb]`` where the services run."""


class AuthenticationError(DomusError):
    """This process and the deployment do not share its secret: a wrong or
    missing secret file (``--secret-file`` or ``$DOMUS_SECRET_FILE``), or a
    peer that is not one of the deployment's own processes.  The message says
    which file was used and what to do."""


class ServiceUnavailable(DomusError, ConnectionError):
    """A service did not answer: it is dead, overloaded or unreachable.

    ``service``, ``address``, ``dht`` and ``bucket`` name what was affected;
    buckets stored elsewhere keep working.
    """

    def __init__(self, message: str, *, service: str = "", address: str = "",
                 dht: str = "", bucket: int | None = None) -> None:
        super().__init__(message)
        self.service = service
        self.address = address
        self.dht = dht
        self.bucket = bucket


class ServiceBusy(ServiceUnavailable):
    """A service answered BUSY (it is overloaded: too many requests, a full
    reply cache, too many open scans) to every try until the client's
    deadline passed.  Nothing was applied by the tries it refused; one that
    timed out may have been.  Retry later, spread the load over more
    services, or raise the client's timeout."""


class RemoteError(DomusError):
    """A service answered a data request with an error status."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class WrongService(RemoteError):
    """The service does not hold the bucket it was asked about."""


class StorageError(RemoteError):
    """The service's repository failed (a database error, a store that
    cannot be opened): the message names the DHT, the bucket, the service,
    the path and the cause.  Nothing was changed."""


class StorageFull(StorageError):
    """The service's disk is at its reserve (``domus service
    --disk-reserve``), or a RAM Berkeley DB DHT's cache is full: the put was
    refused and nothing was stored.  Reads and deletes are still served;
    writes are taken again by themselves once space is back (records
    deleted, the filesystem grown, another job's files removed).  The
    message names the service, the path and the free space."""


class DhtInactive(RemoteError):
    """The DHT is deactivated: its records are kept, but nothing is served
    until it is activated again (``Cluster.activate_dht`` or
    ``domus dht activate NAME``)."""


class DataLost(RemoteError):
    """Every copy of a bucket was lost (its service died, and the DHT kept
    fewer copies than that): requests on it, ``len()`` and iteration raise
    this, naming the DHT, the bucket and the service, until an operator
    accepts the loss (``Cluster.accept_loss`` or ``domus dht accept-loss
    NAME``); the bucket then serves again, empty.  Never a silent KeyError."""


class KeyTypeError(DomusError, TypeError):
    """Keys must be int, str, bytes, or tuples of those."""


class ValueTypeError(DomusError, TypeError):
    """Values must be something msgpack encodes (bytes, str, int, float,
    bool, None, lists and dicts of those)."""


class ValueDecodeError(DomusError, ValueError):
    """A stored value could not be decoded: its bytes are not the msgpack a
    Domus client writes (another program wrote them, or they are corrupt).

    ``reason`` says what is wrong with the bytes; ``dht`` and ``key`` name
    the record where the client knows them ("" and None where it does not).
    The record stays as it is: overwrite or delete the key to mend it.
    """

    def __init__(self, reason: str, *, dht: str = "", key: Any = None) -> None:
        where = []
        if dht:
            where.append(f"DHT {dht!r}")
        if key is not None:
            shown = repr(key)
            where.append(f"key {shown if len(shown) <= 80 else shown[:77] + '...'}")
        super().__init__(f"{', '.join(where)}: {reason}" if where else reason)
        self.reason = reason
        self.dht = dht
        self.key = key

    def with_key(self, key: Any) -> ValueDecodeError:
        """The same error, naming the key of the record."""
        return ValueDecodeError(self.reason, dht=self.dht, key=key)

    def with_dht(self, dht: str) -> ValueDecodeError:
        """The same error, naming the DHT of the record."""
        return ValueDecodeError(self.reason, dht=dht, key=self.key)


class KeyTooLarge(DomusError, ValueError):
    """The encoded key is over the protocol's key limit."""


class ValueTooLarge(DomusError, ValueError):
    """The encoded value is over the protocol's value limit."""


# Names the supervisor may send back in an error reply, mapped to the class
# the client raises.  Anything else becomes a plain SupervisorError.
SUPERVISOR_ERRORS: dict[str, type[SupervisorError]] = {
    cls.__name__: cls
    for cls in (SupervisorError, UnknownDht, DhtExists, InvalidAttribute,
                UnknownService, NoServices, PlatformUnavailable)
}
