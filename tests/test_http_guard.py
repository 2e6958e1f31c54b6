"""Slow and idle clients against a real uvicorn server, over real sockets: headers and
WebSocket handshakes have a deadline, and connections are capped with a 503."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
import subprocess
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import uvicorn

from chatlane.config import Config, ServerConfig
from chatlane.hub import build_app, open_hub
from chatlane.serve import add_adapters, connection_limits, uvicorn_config
from tests.ports import free_port
from tests.test_serve import read_response, start, stop, wait_ready

WAIT = 20.0
"""Bounds a wait for the server to act, so a missing deadline fails instead of hanging."""
REQUEST = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
PARTIAL = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n"
UPGRADE = (
    b"GET /ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
)

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@contextlib.asynccontextmanager
async def served(**server: object) -> AsyncIterator[int]:
    """The web chat and the API served as ``chatlane serve`` serves them; yields the port."""
    config = Config(server=ServerConfig(**server))  # type: ignore[arg-type]
    hub = await open_hub(config, store_url="memory://")
    add_adapters(hub)
    options = uvicorn_config(build_app(hub), config)
    options.port = 0
    uv = uvicorn.Server(options)
    task = asyncio.create_task(uv.serve())
    try:
        async with asyncio.timeout(WAIT):
            while not uv.started:
                assert not task.done(), "the server did not start"
                await asyncio.sleep(0.02)
        yield uv.servers[0].sockets[0].getsockname()[1]
    finally:
        uv.should_exit = True
        await task


async def connect(port: int) -> Stream:
    return await asyncio.open_connection("127.0.0.1", port)


async def response_head(reader: asyncio.StreamReader) -> bytes:
    """One response with a ``Content-Length``: its head (the body is read and dropped)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    await reader.readexactly(length)
    return head


async def closed_by_server(reader: asyncio.StreamReader) -> bytes:
    """Everything the server still sends, once it closed the connection."""
    return await asyncio.wait_for(reader.read(), WAIT)


async def test_headers_that_never_finish_are_cut_off() -> None:
    async with served(header_timeout=1) as port:
        reader, writer = await connect(port)
        writer.write(PARTIAL)
        assert await closed_by_server(reader) == b""
        writer.close()


async def test_a_connection_that_sends_nothing_is_cut_off() -> None:
    async with served(header_timeout=1) as port:
        reader, writer = await connect(port)
        assert await closed_by_server(reader) == b""
        writer.close()


async def test_a_websocket_handshake_that_never_finishes_is_cut_off() -> None:
    async with served(header_timeout=1) as port:
        reader, writer = await connect(port)
        writer.write(UPGRADE)
        assert await closed_by_server(reader) == b""
        writer.close()


async def test_the_next_request_on_a_kept_alive_connection_has_a_deadline_too() -> None:
    async with served(header_timeout=1, keep_alive=600) as port:
        reader, writer = await connect(port)
        writer.write(REQUEST)
        assert (await response_head(reader)).startswith(b"HTTP/1.1 200")
        writer.write(PARTIAL)
        assert await closed_by_server(reader) == b""
        writer.close()


async def test_an_idle_kept_alive_connection_outlives_the_header_deadline() -> None:
    async with served(header_timeout=1, keep_alive=600) as port:
        reader, writer = await connect(port)
        writer.write(REQUEST)
        assert (await response_head(reader)).startswith(b"HTTP/1.1 200")
        # a connection opened after the first went idle is cut off: the deadline has passed
        late_reader, late_writer = await connect(port)
        assert await closed_by_server(late_reader) == b""
        late_writer.close()
        writer.write(REQUEST)  # yet the idle one is still open, for keep_alive
        assert (await response_head(reader)).startswith(b"HTTP/1.1 200")
        writer.close()


async def test_connections_over_the_cap_get_503_until_one_closes() -> None:
    async with served(header_timeout=1, keep_alive=600, max_connections=3) as port:
        held = [await connect(port) for _ in range(3)]
        for reader, writer in held:  # each one served once, so each is counted
            writer.write(REQUEST)
            assert (await response_head(reader)).startswith(b"HTTP/1.1 200")
        reader, writer = await connect(port)
        refused = await closed_by_server(reader)
        assert refused.startswith(b"HTTP/1.1 503")
        assert b"retry-after" in refused.lower()
        writer.close()
        for _, writer in held:  # slow clients are cut off, and free their places
            writer.write(PARTIAL)
        for reader, writer in held:
            assert await closed_by_server(reader) == b""
            writer.close()
        reader, writer = await connect(port)
        writer.write(REQUEST)
        assert (await response_head(reader)).startswith(b"HTTP/1.1 200")
        writer.close()


def test_the_cap_is_lowered_to_fit_the_open_file_limit() -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    config = Config(server=ServerConfig(max_connections=10**9))
    assert connection_limits(config).max_connections < soft
    assert connection_limits(Config()).header_timeout == 10


# -- the reported attack: 300 held sockets under `ulimit -n 256` ---------------------------


@pytest.mark.slow
def test_300_held_sockets_do_not_stop_a_server_limited_to_256_files(tmp_path: Path) -> None:
    port = free_port()
    env = {"CHATLANE_SERVER__HEADER_TIMEOUT": "3"}
    process = start_limited(tmp_path, port, env)
    try:
        wait_ready(process)
        drain = threading.Thread(target=lambda: process.stdout and process.stdout.read())
        drain.start()  # the server's log must never fill the pipe and block it
        held = [socket.create_connection(("127.0.0.1", port), timeout=WAIT) for _ in range(300)]
        for sock in held:
            sock.sendall(PARTIAL)
        answers = [read_to_end(sock) for sock in held]  # each closed: refused or cut off
        assert all(a == b"" or a.startswith(b"HTTP/1.1 503") for a in answers)
        assert any(a.startswith(b"HTTP/1.1 503") for a in answers)
        for sock in held:
            sock.close()
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
            sock.sendall(REQUEST)
            assert read_response(sock).startswith(b"HTTP/1.1 200")
    finally:
        assert stop(process) == 0


def start_limited(tmp_path: Path, port: int, env: dict[str, str]) -> subprocess.Popen[str]:
    """``chatlane serve`` with at most 256 open files."""
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, before[1]))
    try:
        return start(tmp_path, "--port", str(port), "--store", "memory://", env=env)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)


def read_to_end(sock: socket.socket) -> bytes:
    """What the server sent until it closed the connection (a reset counts as closing)."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


async def test_a_hub_opened_on_another_store_writes_nothing_beside_the_configured_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # where the default store (sqlite:///chatlane.db) would be
    async with served():
        pass
    assert await asyncio.to_thread(os.listdir, tmp_path) == []
