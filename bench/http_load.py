"""The load generator of ``bench.http``: raw HTTP/1.1 over asyncio, the same for every server.

What stays true:

* One kept-alive connection per worker, opened before the clock starts; a
  worker writes one request and reads its whole response before it writes the
  next, so a worker has at most one request in flight.
* Every request's bytes are built before the clock starts; the client only
  writes them and reads and checks responses, so it costs both sides the same.
* A request's latency runs from just before its bytes are written to just
  after the last byte of its response is read (for a stream: the end of the
  chunked body, after ``data: [DONE]``).
* A response counts only when it is a ``200`` with the expected body: a
  ``chat.completion`` holding the echo, or an event stream with a stop chunk
  that ends in ``data: [DONE]``. Anything else raises :class:`BenchError`.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.common import BenchError

TEXT = "hello"
"""Every request's user message; the demo agent (and the floor) answer ``echo: hello``."""
COMPLETION_MARK = b'"content": "echo: hello"'
STOP_MARK = b'"finish_reason": "stop"'
DONE = b"data: [DONE]\n\n"
SETTLE = 0.25
"""Seconds of quiet before each reading of the server's CPU time, so work a server
finishes after its last response (or the warmup's) is counted in the right cell."""

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@dataclass(frozen=True, slots=True)
class Target:
    """Where requests go, with which token, and what they ask for."""

    port: int
    token: str
    stream: bool
    text: str = TEXT
    """The user's message: the echo's, or (streams only: a completion is checked for the
    echo) one asking the demo agent for a longer reply."""

    def request(self, session: str) -> bytes:
        """A chat completion for ``session`` (named by the ``X-Chatlane-Session`` header)."""
        body = json.dumps(
            {
                "model": "chatlane",
                "messages": [{"role": "user", "content": self.text}],
                "stream": self.stream,
            }
        ).encode()
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\n"
            f"Host: 127.0.0.1:{self.port}\r\n"
            f"Authorization: Bearer {self.token}\r\n"
            "Content-Type: application/json\r\n"
            f"X-Chatlane-Session: {session}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        return head.encode("latin-1") + body

    def get(self, path: str) -> bytes:
        """A ``GET`` of ``path`` with the token."""
        return (
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
            f"Authorization: Bearer {self.token}\r\n\r\n"
        ).encode("latin-1")


@dataclass(frozen=True, slots=True)
class CellResult:
    """One timed section: its requests' latencies, the wall time, and the CPU both ends used."""

    latencies_ns: tuple[int, ...]
    """Sorted."""
    wall_ns: int
    server_cpu_s: float
    client_cpu_s: float
    events: int
    """``data:`` events read, over every streamed response (0 when not streaming)."""

    @property
    def requests(self) -> int:
        return len(self.latencies_ns)

    def percentile_ms(self, percent: int) -> float:
        """The nearest-rank ``percent``-th percentile of the latencies, in ms."""
        rank = max(1, -(-percent * self.requests // 100))
        return self.latencies_ns[rank - 1] / 1e6


async def open_connections(port: int, count: int) -> list[Connection]:
    return [await asyncio.open_connection("127.0.0.1", port) for _ in range(count)]


async def close_connections(connections: Sequence[Connection]) -> None:
    for _, writer in connections:
        writer.close()
    for _, writer in connections:
        await writer.wait_closed()


async def exchange(connection: Connection, request: bytes) -> tuple[int, bytes]:
    """Write ``request``; read its response; return the status and the (de-chunked) body."""
    reader, writer = connection
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    lower = head.lower()
    at = lower.find(b"content-length:")
    if at >= 0:
        return status, await reader.readexactly(int(lower[at + 15 : lower.index(b"\r\n", at)]))
    if b"transfer-encoding: chunked" not in lower:
        raise BenchError(f"a response with neither a length nor chunks: {head!r}")
    parts: list[bytes] = []
    while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
        parts.append((await reader.readexactly(size + 2))[:-2])
    await reader.readexactly(2)  # the last chunk's CRLF (no trailers are sent)
    return status, b"".join(parts)


def check(status: int, body: bytes, stream: bool) -> int:
    """The ``data:`` events of a good response (0 for a completion).

    :raises BenchError: unless it is a 200 with the echo, or a finished stream.
    """
    if status == 200 and not stream and COMPLETION_MARK in body:
        return 0
    if status == 200 and stream and body.endswith(DONE) and STOP_MARK in body:
        return body.count(b"data: ")
    raise BenchError(f"unexpected response: {status} {body[:300]!r}")


async def run_lanes(
    connections: Sequence[Connection], lanes: Sequence[Sequence[bytes]], stream: bool
) -> tuple[list[int], int]:
    """Every lane on its own connection; every latency in ns, and the events read."""
    latencies: list[int] = []
    events = 0

    async def worker(connection: Connection, lane: Sequence[bytes]) -> None:
        nonlocal events
        clock = time.perf_counter_ns
        for request in lane:
            start = clock()
            status, body = await exchange(connection, request)
            latencies.append(clock() - start)
            events += check(status, body, stream)

    await asyncio.gather(*(worker(c, lane) for c, lane in zip(connections, lanes, strict=True)))
    return latencies, events


async def run_cell(
    target: Target,
    warmup: Sequence[Sequence[bytes]],
    timed: Sequence[Sequence[bytes]],
    server_cpu: Callable[[], float],
) -> CellResult:
    """Open a connection per lane, run ``warmup``, then time ``timed``.

    The server's CPU time (``server_cpu``, in seconds) is read after a quiet
    :data:`SETTLE` on either side of the timed section.
    """
    connections = await open_connections(target.port, max(len(warmup), len(timed)))
    try:
        await run_lanes(connections[: len(warmup)], warmup, target.stream)
        await asyncio.sleep(SETTLE)
        cpu_before = server_cpu()
        gc.collect()
        client_before = time.process_time()
        start = time.perf_counter_ns()
        latencies, events = await run_lanes(connections[: len(timed)], timed, target.stream)
        wall = time.perf_counter_ns() - start
        client_cpu = time.process_time() - client_before
        await asyncio.sleep(SETTLE)
        server_cpu_s = server_cpu() - cpu_before
    finally:
        await close_connections(connections)
    return CellResult(tuple(sorted(latencies)), wall, server_cpu_s, client_cpu, events)


async def get(target: Target, path: str) -> bytes:
    """The body of a ``GET`` of ``path``.

    :raises BenchError: unless it is a 200.
    """
    connections = await open_connections(target.port, 1)
    try:
        status, body = await exchange(connections[0], target.get(path))
    finally:
        await close_connections(connections)
    if status != 200:
        raise BenchError(f"GET {path}: {status} {body[:300]!r}")
    return body


async def post(target: Target, session: str) -> bytes:
    """The checked body of one chat completion for ``session``, on a connection of its own."""
    connections = await open_connections(target.port, 1)
    try:
        status, body = await exchange(connections[0], target.request(session))
    finally:
        await close_connections(connections)
    check(status, body, target.stream)
    return body


async def each(lanes: Sequence[Sequence[bytes]], target: Target) -> None:
    """Send every lane's requests untimed, one connection per lane."""
    connections = await open_connections(target.port, len(lanes))
    try:
        await run_lanes(connections, lanes, target.stream)
    finally:
        await close_connections(connections)
