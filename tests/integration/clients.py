"""The asyncio client behind the blocking client's interface, so that one
behavioural suite runs against both (the ``any_cluster`` fixture).

An event loop runs in a thread of its own; each call of the facade runs
the matching coroutine of domus.aio there and waits for its result or its
exception (the very exception object the coroutine raised).  Nothing here
decides anything: every answer is the asyncio client's."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import domus.aio
from domus.client.aio import AioCluster, AioDht

CALL_TIMEOUT = 300.0


class LoopThread:
    """An asyncio event loop (the default one, or ``loop_factory()``'s)
    running in a daemon thread."""

    def __init__(self, loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
                 ) -> None:
        self.loop = (loop_factory or asyncio.new_event_loop)()
        self.thread = threading.Thread(target=self.loop.run_forever, name="aio-loop",
                                       daemon=True)
        self.thread.start()

    def run(self, awaitable: Any) -> Any:
        async def awaited() -> Any:
            return await awaitable

        return asyncio.run_coroutine_threadsafe(awaited(), self.loop).result(CALL_TIMEOUT)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


class SyncAioCluster:
    """An AioCluster used as a domus.Cluster."""

    def __init__(self, bridge: LoopThread, cluster: AioCluster) -> None:
        self.bridge = bridge
        self.aio = cluster

    @classmethod
    def connect(cls, bridge: LoopThread, address: str, **options: Any) -> SyncAioCluster:
        return cls(bridge, bridge.run(domus.aio.connect(address, **options)))

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.aio, name)
        if not inspect.iscoroutinefunction(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            result = self.bridge.run(attribute(*args, **kwargs))
            return SyncAioDht(self.bridge, result) if isinstance(result, AioDht) else result

        return call

    def close(self) -> None:
        self.bridge.run(self.aio.close())


class SyncAioDht(MutableMapping):
    """An AioDht used as a domus.Dht (a mapping; put, get_many, ...)."""

    def __init__(self, bridge: LoopThread, dht: AioDht) -> None:
        self.bridge = bridge
        self.aio = dht

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.aio, name)
        if inspect.iscoroutinefunction(attribute):
            return lambda *args, **kwargs: self.bridge.run(attribute(*args, **kwargs))
        return attribute

    def _collect(self, iterator: Any) -> list[Any]:
        async def collected() -> list[Any]:
            return [item async for item in iterator]

        return self.bridge.run(collected())

    def put(self, key: Any, value: Any) -> bool:
        return self.bridge.run(self.aio.put(key, value))

    __setitem__ = put  # type: ignore[assignment]

    def __getitem__(self, key: Any) -> Any:
        return self.bridge.run(self.aio.getitem(key))

    def get(self, key: Any, default: Any = None) -> Any:
        return self.bridge.run(self.aio.get(key, default))

    def delete(self, key: Any) -> bool:
        return self.bridge.run(self.aio.delete(key))

    def __delitem__(self, key: Any) -> None:
        if not self.delete(key):
            raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return self.bridge.run(self.aio.contains(key))

    def pop(self, key: Any, *default: Any) -> Any:
        return self.bridge.run(self.aio.pop(key, *default))

    def setdefault(self, key: Any, default: Any = None) -> Any:
        return self.bridge.run(self.aio.setdefault(key, default))

    def __len__(self) -> int:
        return self.bridge.run(self.aio.length())

    def __iter__(self) -> Iterator[Any]:
        return iter(self._collect(self.aio.keys()))

    def items(self) -> list[tuple[Any, Any]]:  # type: ignore[override]
        return self._collect(self.aio.items())

    def values(self) -> list[Any]:  # type: ignore[override]
        return self._collect(self.aio.values())

    def put_many(self, items: Any) -> int:
        return self.bridge.run(self.aio.put_many(items))

    def get_many(self, keys: Any) -> dict[Any, Any]:
        return self.bridge.run(self.aio.get_many(keys))

    def irange(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        # (called here: argument errors are raised at once, as the blocking
        # client's; each step is then one step of the asyncio iterator)
        return self._stepwise(self.aio.irange(*args, **kwargs))

    def _stepwise(self, iterator: Any) -> Iterator[Any]:
        try:
            while True:
                try:
                    yield self.bridge.run(iterator.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self.bridge.run(iterator.aclose())
