"""A metadata index a test can break: it passes every call to the real one, except while
frozen (calls hang until thawed: a replica that was killed, or cut off from the store) and
while failing (calls raise ConnectionError: a store that does not answer)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from proxy.store.protocol import MetadataIndex

T = TypeVar("T")


class ControlledIndex:
    """A MetadataIndex over `inner` that can be frozen or made to fail."""

    def __init__(self, inner: MetadataIndex) -> None:
        self.inner = inner
        self._thawed = asyncio.Event()
        self._thawed.set()
        self.failures_left = 0  # the next calls that fail
        self.failing_methods: set[str] | None = None  # which fail (None: any)
        self.failed = 0

    def freeze(self) -> None:
        """Every call from now on hangs until thaw()."""
        self._thawed.clear()

    def thaw(self) -> None:
        """Let hung and later calls through."""
        self._thawed.set()

    def fail(self, count: int, methods: set[str] | None = None) -> None:
        """The next `count` calls (of `methods`, if given) raise ConnectionError."""
        self.failures_left = count
        self.failing_methods = methods

    async def _call(self, method: str, call: Callable[[], Awaitable[T]]) -> T:
        await self._thawed.wait()
        if self.failures_left and (self.failing_methods is None
                                   or method in self.failing_methods):
            self.failures_left -= 1
            self.failed += 1
            raise ConnectionError(f"the store does not answer ({method})")
        return await call()

    async def get(self, key: str) -> dict[str, Any] | None:
        return await self._call("get", lambda: self.inner.get(key))

    async def set(self, key: str, value: dict[str, Any]) -> None:
        await self._call("set", lambda: self.inner.set(key, value))

    async def create(self, key: str, value: dict[str, Any]) -> bool:
        return await self._call("create", lambda: self.inner.create(key, value))

    async def delete(self, key: str) -> None:
        await self._call("delete", lambda: self.inner.delete(key))

    async def get_versioned(self, key: str) -> tuple[dict[str, Any], str] | None:
        return await self._call("get_versioned", lambda: self.inner.get_versioned(key))

    async def replace(self, key: str, value: dict[str, Any],
                      expected_version: str) -> str | None:
        return await self._call("replace",
                                lambda: self.inner.replace(key, value, expected_version))

    async def delete_if(self, key: str, expected_version: str) -> bool:
        return await self._call("delete_if", lambda: self.inner.delete_if(key, expected_version))

    async def keys(self, prefix: str) -> list[str]:
        return await self._call("keys", lambda: self.inner.keys(prefix))
