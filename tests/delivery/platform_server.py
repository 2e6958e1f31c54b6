"""A chat platform stand-in over real HTTP, shared by gateway processes under test.

``POST /send`` with ``{"chat", "text", "ids", "delivery_id", "labelled"}`` is a
message the platform takes. The server runs on its own thread (the process
tests drive workers synchronously), and fails the ways a platform does:

* ``transient``: this share of sends answer 500; half of those after the
  message reached the chat (recorded), so a retry may duplicate it;
* ``down``: every send answers 503, and nothing is recorded;
* ``hold``: the next send is recorded and never answered (the sender's
  process dies waiting), counted in :attr:`held`.

What stays true: :meth:`PlatformServer.received` is every message the chat
saw, in the order it saw them.
"""

from __future__ import annotations

import asyncio
import random
import socket
import threading
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.routing import Route


class _SignallingServer(uvicorn.Server):
    """A uvicorn server that sets :attr:`ready` once it listens (or failed to)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = threading.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().startup(sockets)
        finally:
            self.ready.set()


@dataclass(frozen=True)
class Received:
    """One message a chat saw."""

    chat: str
    text: str
    ids: tuple[str, ...]
    delivery_id: str
    labelled: bool


class PlatformServer:
    """``with PlatformServer() as platform:`` serves on a free port until the block ends."""

    def __init__(
        self, transient: float = 0.0, seed: int = 11, changed: threading.Condition | None = None
    ) -> None:
        """:param changed: notified after each message a chat saw."""
        self.transient = transient
        self.changed = changed or threading.Condition()
        self.down = False
        self.hold = False
        self.held = 0
        self.port = 0
        self._received: list[Received] = []
        self._lock = threading.Lock()
        self._random = random.Random(seed)
        self._server: _SignallingServer | None = None
        self._thread: threading.Thread | None = None
        self._release: asyncio.Event | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Self:
        app = Starlette(routes=[Route("/send", self._send, methods=["POST"])])
        config = uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off", log_level="error")
        self._server = server = _SignallingServer(config)
        self._thread = threading.Thread(target=server.run, daemon=True)
        self._thread.start()
        assert server.ready.wait(timeout=20), "the platform stand-in did not start"
        self.port = server.servers[0].sockets[0].getsockname()[1]
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._server is not None
        assert self._thread is not None
        self._server.should_exit = True
        self._server.force_exit = True
        self._thread.join(timeout=20)

    def received(self) -> list[Received]:
        with self._lock:
            return list(self._received)

    async def _send(self, request: Request) -> JSONResponse:
        try:
            body: dict[str, Any] = await request.json()
        except ClientDisconnect:  # its sender was killed mid-request: nothing arrived
            return JSONResponse({"error": "gone"}, status_code=400)
        message = Received(
            str(body["chat"]),
            str(body["text"]),
            tuple(body["ids"]),
            str(body["delivery_id"]),
            bool(body["labelled"]),
        )
        status, hold = self._take(message)
        with self.changed:
            self.changed.notify_all()
        if hold:
            await asyncio.Event().wait()  # never answered: the sender dies waiting
        return JSONResponse({"ok": status == 200}, status_code=status)

    def _take(self, message: Received) -> tuple[int, bool]:
        """Whether the chat sees ``message``, and the status to answer (or whether to hold)."""
        with self._lock:
            if self.down:
                return 503, False
            if self.hold:
                self.hold = False
                self.held += 1
                self._received.append(message)
                return 200, True
            roll = self._random.random()
            if roll < self.transient / 2:  # failed after the chat saw it
                self._received.append(message)
            if roll < self.transient:
                return 500, False
            self._received.append(message)
            return 200, False
