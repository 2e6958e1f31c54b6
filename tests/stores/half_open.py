"""A TCP proxy whose connections can be made half-open: what a client sees of a server that
vanished behind something keeping the client's side open.

A pooler whose backend died, a virtual IP that failed over, a NAT entry that was
dropped: the client's connection stays open, what it sends is taken, and nothing
ever comes back. :meth:`HalfOpenProxy.cut` does that to every connection open at
the time (the server sees its side close, as it would); new connections are
proxied as before, unless :attr:`HalfOpenProxy.stalled` makes them black holes
too (accepted, never served).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

__all__ = ["HalfOpenProxy", "half_open_proxy", "through"]


class HalfOpenProxy:
    """Forwards 127.0.0.1:``port`` to ``upstream``; see the module docstring."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.port = 0
        self.stalled = False
        """Whether new connections are black holes too."""
        self.accepted = 0
        """Connections clients opened, black holes included."""
        self.given_up = 0
        """Black holes the client closed: connections it stopped waiting on."""
        self.swallowed = 0
        """Reads of what a client sent into a black hole."""
        self._live: dict[asyncio.StreamWriter, list[asyncio.Task[None]]] = {}
        self._holes: set[asyncio.Task[None]] = set()
        self._changed = asyncio.Condition()
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in [*self._holes, *(t for pumps in self._live.values() for t in pumps)]:
            task.cancel()
        for writer in list(self._live):
            writer.close()
        if self._server is not None:
            await self._server.wait_closed()

    def cut(self) -> int:
        """Make every connection open now half-open; return how many there were."""
        cut = 0
        for client, pumps in list(self._live.items()):
            del self._live[client]
            for task in pumps:
                task.cancel()
            cut += 1
        return cut

    async def until_given_up(self, count: int) -> None:
        """Wait until clients have closed ``count`` black holes in all."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.given_up >= count)

    async def until_swallowed(self, count: int) -> None:
        """Wait until black holes have taken ``count`` reads of what clients sent."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.swallowed >= count)

    async def _counted(self, name: str) -> None:
        async with self._changed:
            setattr(self, name, getattr(self, name) + 1)
            self._changed.notify_all()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self.stalled:
            await self._black_hole(reader, writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        pumps = [
            asyncio.create_task(_pump(reader, up_writer)),
            asyncio.create_task(_pump(up_reader, writer)),
        ]
        self._live[writer] = pumps
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        cut = self._live.pop(writer, None) is None
        for task in pumps:
            task.cancel()
        up_writer.close()  # the server sees the client go
        if cut:  # the client's side stays open, unanswered
            await self._black_hole(reader, writer)
        else:
            writer.close()

    async def _black_hole(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read and drop what the client sends, answer nothing, until it closes."""
        task = asyncio.current_task()
        assert task is not None
        self._holes.add(task)
        try:
            with contextlib.suppress(OSError):
                while await reader.read(65536):
                    await self._counted("swallowed")
        finally:
            self._holes.discard(task)
            writer.close()
        await self._counted("given_up")


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()


@contextlib.asynccontextmanager
async def half_open_proxy(url: str) -> AsyncIterator[HalfOpenProxy]:
    """A proxy to the server of the ``postgresql://`` URL ``url``, closed after the block."""
    parts = urlsplit(url)
    proxy = HalfOpenProxy(parts.hostname or "127.0.0.1", parts.port or 5432)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()


def through(url: str, proxy: HalfOpenProxy) -> str:
    """``url``, reaching its server through ``proxy``."""
    parts = urlsplit(url)
    userinfo, at, _ = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{userinfo}{at}127.0.0.1:{proxy.port}"))
