"""The Redis client through what a managed Redis does: not-ready replies, failovers, dead peers.

A server that answers ``-LOADING``, ``-READONLY``, ``-MASTERDOWN``,
``-TRYAGAIN`` or ``-BUSY`` ran nothing: the client drops that connection and
tries again on a new one, so a restart, a failover or a long script is waited
out instead of failing the store's calls. A half-open connection is found by
an idle ``PING`` before a command waits on it.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest

from chatlane.errors import StoreError
from chatlane.stores.redis_url import parse_url
from chatlane.stores.resp import ReplyError, RespClient, ServerNotReady, not_ready
from tests.stores.test_resp import client, private_server

NOT_READY_REPLIES = [
    b"-LOADING Redis is loading the dataset in memory\r\n",
    b"-READONLY You can't write against a read only replica.\r\n",
    b"-MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.\r\n",
    b"-TRYAGAIN Multiple keys request during rehashing of slot\r\n",
    b"-BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.\r\n",
]

SPIN = """
local function now() local t = redis.call('TIME') return t[1] * 1000 + t[2] / 1000 end
local start = now()
while now() - start < tonumber(ARGV[1]) do end
return 1
"""
"""A script that keeps the server busy for ARGV[1] milliseconds."""


@asynccontextmanager
async def scripted_server(*answers: bytes) -> AsyncIterator[int]:
    """A server whose n-th connection answers every command with ``answers[n]`` (then the last)."""
    connections = 0
    writers: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        answer = answers[min(connections, len(answers) - 1)]
        connections += 1
        writers.append(writer)
        while await reader.read(4096):
            writer.write(answer)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for writer in writers:
            writer.close()
        await server.wait_closed()


@asynccontextmanager
async def half_open_server() -> AsyncIterator[int]:
    """Answers the first command with ``+PONG``, then reads on and never answers again."""
    writers: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await reader.read(4096)
        writer.write(b"+PONG\r\n")
        while await reader.read(4096):
            pass

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for writer in writers:
            writer.close()
        await server.wait_closed()


async def until(predicate: Callable[[], bool]) -> None:
    """Wait for a state only a timer of the client's own can reach (nothing to await there)."""
    async with asyncio.timeout(10):
        while not predicate():  # noqa: ASYNC110 - a condition, not an event
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("reply", NOT_READY_REPLIES, ids=lambda r: r.split()[0][1:].decode())
async def test_a_server_not_ready_drops_the_connection_and_the_command_is_tried_again(
    reply: bytes,
) -> None:
    async with scripted_server(reply, b"+PONG\r\n") as port:
        once = client(port)
        with pytest.raises(ServerNotReady, match=reply.split()[0][1:].decode()):
            await once.execute("PING")
        assert once._connection is not None
        assert once._connection.closed
        await once.close()
    async with scripted_server(reply, reply, b"+PONG\r\n") as port:
        patient = client(port, retries=5)
        assert await patient.execute("PING") == b"PONG"  # on the third connection
        await patient.close()


async def test_other_error_replies_are_raised_and_keep_the_connection() -> None:
    for reply in (b"-ERR wrong number of arguments\r\n", b"-BUSYKEY Target key exists\r\n"):
        async with scripted_server(reply) as port:
            plain = client(port, retries=5)
            with pytest.raises(ReplyError) as raised:
                await plain.execute("PING")
            assert not isinstance(raised.value, ConnectionError)
            assert plain._connection is not None
            assert not plain._connection.closed
            await plain.close()
    assert not not_ready(ReplyError("BUSYGROUP Consumer Group name already exists"))


async def test_a_long_script_on_a_real_server_is_waited_out() -> None:
    with private_server("--lua-time-limit", "20") as port:
        spinner, probe, patient = client(port), client(port), client(port, retries=8)
        await patient.execute("SET", "k", "kept")
        spinning = asyncio.ensure_future(spinner.execute("EVAL", SPIN, 0, 600))
        refusal = None
        while refusal is None:  # until the server says it is busy
            try:
                await probe.execute("PING")
            except ServerNotReady as busy:
                refusal = str(busy)
        assert "BUSY" in refusal
        assert await patient.execute("GET", "k") == b"kept"
        assert await spinning == 1
        for each in (spinner, probe, patient):
            await each.close()


async def test_a_replica_refuses_writes_until_it_is_promoted() -> None:
    with (
        private_server() as primary,
        private_server("--replicaof", "127.0.0.1", str(primary)) as replica,
    ):
        admin, plain = client(replica), client(replica)
        with pytest.raises(ServerNotReady, match="READONLY"):
            await plain.execute("SET", "k", "v")
        patient = client(replica, retries=8)
        writing = asyncio.ensure_future(patient.execute("SET", "k", "v"))
        assert await admin.execute("REPLICAOF", "NO", "ONE") == b"OK"  # the failover
        assert await writing == b"OK"
        assert await plain.execute("GET", "k") == b"v"  # a new connection, to the new primary
        for each in (admin, plain, patient):
            await each.close()


async def test_an_idle_connection_whose_server_went_silent_is_closed_before_it_is_used() -> None:
    async with half_open_server() as port:
        idle = client(port, health_check=0.05, reply_timeout=0.2)
        assert await idle.execute("PING") == b"PONG"
        connection = idle._connection
        assert connection is not None
        await until(lambda: connection.closed)  # no command waited on it
        await idle.close()


async def test_a_live_idle_connection_stays_open_through_health_checks() -> None:
    with private_server() as port:
        idle = client(port, health_check=0.02)
        await idle.execute("CLIENT", "SETNAME", "checked")
        connection = idle._connection
        assert connection is not None
        await until(lambda: b"cmd=ping" in _listing(port))  # a health check reached the server
        assert not connection.closed
        assert await idle.execute("CLIENT", "GETNAME") == b"checked"  # the same connection
        await idle.close()


def _listing(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(b"CLIENT LIST\r\n")
        return conn.recv(65536)


async def test_connections_have_tcp_keepalive_unless_the_url_turns_it_off() -> None:
    with private_server() as port:
        for url, expected in (
            (f"redis://127.0.0.1:{port}", 1),
            (f"redis://127.0.0.1:{port}?socket_keepalive=false", 0),
        ):
            endpoint, _ = parse_url(url)
            probed = RespClient(endpoint)
            await probed.execute("PING")
            assert probed._connection is not None
            assert probed._connection._transport is not None
            sock = probed._connection._transport.get_extra_info("socket")
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == expected
            if expected and hasattr(socket, "TCP_KEEPIDLE"):
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 30
            await probed.close()


@pytest.mark.parametrize(
    ("query", "health_check"),
    [("", 15.0), ("?health_check_interval=0", 0.0), ("?health_check_interval=2.5", 2.5)],
)
def test_the_url_sets_the_health_check(query: str, health_check: float) -> None:
    endpoint, _ = parse_url(f"redis://127.0.0.1:6379/0{query}")
    assert endpoint.health_check == health_check


@pytest.mark.parametrize(
    "query",
    [
        "health_check_interval=-1",
        "health_check_interval=inf",
        "health_check_interval=soon",
        "socket_keepalive=maybe",
    ],
)
def test_a_bad_health_option_is_refused_by_name(query: str) -> None:
    name = query.partition("=")[0]
    with pytest.raises(StoreError, match=name):
        parse_url(f"redis://127.0.0.1:6379/0?{query}")
