"""The pipelined Redis client: replies in order, silent or broken servers, AUTH, TLS, reconnects."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import pytest

from chatlane import testing_redis
from chatlane.errors import StoreError
from chatlane.stores.redis import RedisStore
from chatlane.stores.resp import Endpoint, ReplyError, RespClient, maybe_sent
from chatlane.testing_redis import free_port, server_binary
from tests.keys import chat_key


@contextmanager
def private_server(*options: str, port: int | None = None) -> Iterator[int]:
    """A redis-server of our own with ``options``; yields its port once it listens."""
    try:
        binary = server_binary()
    except testing_redis.TestServerError as error:
        pytest.skip(str(error))
    port = port or free_port()
    with tempfile.TemporaryDirectory(prefix="chatlane-resp-") as folder:
        command = [binary, "--bind", "127.0.0.1", "--save", "", "--dir", folder, *options]
        if "--tls-port" not in options:
            command += ["--port", str(port)]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            _wait_for_port(int(_option(options, "--tls-port") or port), process)
            yield port
        finally:
            process.terminate()
            process.wait(timeout=10)


def _option(options: tuple[str, ...], name: str) -> str | None:
    return options[options.index(name) + 1] if name in options else None


def _wait_for_port(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.skip(
                f"this redis-server cannot run with these options (exit {process.returncode})"
            )
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError("the private redis server did not start")


class Heard:
    """Everything a fake server read, and a way to wait until some bytes arrived."""

    def __init__(self) -> None:
        self.data = b""
        self._more = asyncio.Event()

    def add(self, data: bytes) -> None:
        self.data += data
        self._more.set()

    async def until(self, part: bytes) -> None:
        """Return once ``part`` arrived (within 5 s)."""
        async with asyncio.timeout(5):
            while True:
                self._more.clear()
                if part in self.data:
                    return
                await self._more.wait()


@asynccontextmanager
async def fake_server(answer: bytes | None, heard: Heard | None = None) -> AsyncIterator[int]:
    """A TCP server that reads commands and answers each read with ``answer`` (None: never);
    what it reads goes to ``heard``."""

    writers: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        while data := await reader.read(4096):
            if heard is not None:
                heard.add(data)
            if answer is not None:
                writer.write(answer)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield port
    finally:
        server.close()
        for writer in writers:
            writer.close()
        await server.wait_closed()


@asynccontextmanager
async def sink_server() -> AsyncIterator[int]:
    """A TCP server that answers the first read with ``+PONG`` and then never reads again."""

    writers: list[asyncio.StreamWriter] = []
    done = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await reader.read(4096)
        writer.write(b"+PONG\r\n")
        await done.wait()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        done.set()
        server.close()
        for writer in writers:
            writer.close()
        await server.wait_closed()


def client(port: int, *, retries: int = 0, **settings: object) -> RespClient:
    return RespClient(Endpoint(port=port, **settings), retries=retries)  # type: ignore[arg-type]


class TestBrokenServers:
    async def test_a_silent_server_fails_every_waiting_caller_after_the_reply_timeout(
        self,
    ) -> None:
        async with fake_server(None) as port:
            silent = client(port, reply_timeout=0.3)
            started = time.monotonic()
            results = await asyncio.gather(
                *(silent.execute("PING") for _ in range(5)), return_exceptions=True
            )
            assert all(isinstance(r, ConnectionError) for r in results)
            assert "no reply for 0.3s" in str(results[0])
            assert 0.25 < time.monotonic() - started < 3
            await silent.close()

    async def test_a_server_that_stops_reading_bounds_the_send_buffer(self) -> None:
        async with sink_server() as port:
            stalled = client(port, reply_timeout=1.0)
            await stalled.execute("PING")  # the sink answers the first read only
            value = b"x" * 65536
            commands, high = [], 0
            for n in range(600):  # ~39 MB, far more than the kernel's socket buffers
                commands.append(asyncio.create_task(stalled.execute("SET", f"k{n}", value)))
                await asyncio.sleep(0)
                high = max(high, stalled.buffered)
            results = await asyncio.gather(*commands, return_exceptions=True)
            assert all(isinstance(r, ConnectionError) for r in results)
            assert 0 < high < 2 * 1024 * 1024, high
            await stalled.close()

    async def test_bytes_that_are_not_resp_close_the_connection(self) -> None:
        async with fake_server(b"hello there\r\n") as port:
            confused = client(port)
            with pytest.raises(ConnectionError, match="not RESP"):
                await confused.execute("PING")
            await confused.close()

    async def test_retries_are_bounded_and_say_why(self) -> None:
        closed_port = free_port()
        failing = client(closed_port, retries=2)
        started = time.monotonic()
        with pytest.raises(ConnectionError) as raised:
            await failing.execute("PING")
        assert time.monotonic() - started < 5
        assert not maybe_sent(raised.value)  # never written anywhere: it surely did not run
        await failing.close()

    async def test_a_command_written_before_the_connection_failed_may_have_run(self) -> None:
        async with fake_server(None) as port:
            silent = client(port, reply_timeout=0.3)
            with pytest.raises(ConnectionError) as raised:
                await silent.execute("SET", "k", "v")
            assert maybe_sent(raised.value)
            await silent.close()


class TestConnections:
    async def test_callers_arriving_together_share_one_new_connection(self) -> None:
        with private_server() as port:
            fresh = client(port, client_name="shared-one")
            replies = await asyncio.gather(*(fresh.execute("ECHO", i) for i in range(100)))
            assert replies == [str(i).encode() for i in range(100)]
            listing = await fresh.execute("CLIENT", "LIST")
            assert listing.count(b"name=shared-one") == 1
            await fresh.close()

    async def test_a_restarted_server_is_reached_again(self) -> None:
        port = free_port()
        resilient = client(port, retries=5)
        with private_server(port=port):
            await resilient.execute("SET", "k", "before")
        with private_server(port=port):
            assert await resilient.execute("PING") == b"PONG"
            assert await resilient.execute("GET", "k") is None  # a new server, nothing kept
        await resilient.close()

    async def test_a_closed_client_refuses_and_fails_its_waiting_callers(self) -> None:
        heard = Heard()
        async with fake_server(None, heard) as port:
            closing = client(port, retries=3)
            waiting = asyncio.ensure_future(closing.execute("PING"))
            await heard.until(b"PING")  # sent: the caller waits for a reply that never comes
            await closing.close()
            with pytest.raises(ConnectionError, match="client closed"):
                await waiting
            with pytest.raises(ConnectionError, match="closed"):
                await closing.execute("PING")

    async def test_closing_while_connecting_fails_the_callers_cleanly(self) -> None:
        heard = Heard()
        async with fake_server(None, heard) as port:  # accepts, never answers the handshake
            connecting = client(port, retries=3, client_name="never-answered")
            waiting = asyncio.ensure_future(connecting.execute("PING"))
            await heard.until(b"never-answered")  # the handshake was sent: still connecting
            await connecting.close()
            with pytest.raises(ConnectionError, match="closed"):
                await waiting

    async def test_error_replies_are_raised_not_retried(self) -> None:
        with private_server() as port:
            plain = client(port, retries=5)
            with pytest.raises(ReplyError, match="unknown command"):
                await plain.execute("NOSUCHCOMMAND")
            assert await plain.execute("PING") == b"PONG"
            await plain.close()


class TestAuth:
    async def test_the_password_in_the_url_is_sent_first(self) -> None:
        with private_server("--requirepass", "s3cret") as port:
            store = await RedisStore.open(f"redis://:s3cret@127.0.0.1:{port}/3?prefix=auth")
            assert (await store.acquire(chat_key("k"), "p1", 5)).generation == 1
            await store.close()
            started = time.monotonic()
            with pytest.raises(StoreError, match=r"WRONGPASS|invalid password") as raised:
                await RedisStore.open(f"redis://:n0tit@127.0.0.1:{port}/0")
            assert "n0tit" not in str(raised.value)
            assert time.monotonic() - started < 2

    @pytest.mark.parametrize(
        ("userinfo", "db", "said"),
        [
            ("", 0, "the server needs a password (NOAUTH "),
            (":n0tit@", 0, "the server refused the user name or password (WRONGPASS "),
            ("nobody:s3cret@", 0, "the server refused the user name or password (WRONGPASS "),
            (":s3cret@", 9, "the server has no database of that number (ERR DB index is out"),
        ],
    )
    async def test_a_server_that_answers_and_refuses_is_not_called_unreachable(
        self, userinfo: str, db: int, said: str
    ) -> None:
        with (
            private_server("--requirepass", "s3cret", "--databases", "4") as port,
            pytest.raises(StoreError) as raised,
        ):
            await RedisStore.open(f"redis://{userinfo}127.0.0.1:{port}/{db}")
        assert said in str(raised.value)
        assert "cannot reach" not in str(raised.value)
        assert "n0tit" not in str(raised.value)

    async def test_an_acl_user_and_password(self) -> None:
        acl = ["--user", "bot", "on", ">pw", "~*", "+@all"]
        with private_server(*acl) as port:
            store = await RedisStore.open(f"redis://bot:pw@127.0.0.1:{port}/0")
            assert await store.generation(chat_key("k")) == 0
            await store.close()


@pytest.fixture(scope="module")
def certificate() -> Iterator[Path]:
    """A self-signed certificate for ``localhost`` (and its key) in a temporary folder."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    with tempfile.TemporaryDirectory(prefix="chatlane-tls-") as folder:
        subprocess.run(
            [
                *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
                *("-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"),
                *("-keyout", f"{folder}/key.pem", "-out", f"{folder}/cert.pem"),
            ],
            check=True,
            capture_output=True,
        )
        yield Path(folder)


class TestTls:
    async def test_rediss_with_a_trusted_certificate(self, certificate: Path) -> None:
        port = free_port()
        tls = [
            *("--port", "0", "--tls-port", str(port), "--tls-auth-clients", "no"),
            *("--tls-cert-file", str(certificate / "cert.pem")),
            *("--tls-key-file", str(certificate / "key.pem")),
            *("--requirepass", "s3cret"),
        ]
        with private_server(*tls):
            ca = certificate / "cert.pem"
            store = await RedisStore.open(f"rediss://:s3cret@localhost:{port}/0?ssl_ca_certs={ca}")
            assert (await store.acquire(chat_key("k"), "p1", 5)).generation == 1
            await store.close()
            with pytest.raises(StoreError, match=r"CERTIFICATE_VERIFY_FAILED|certificate"):
                await RedisStore.open(f"rediss://:s3cret@localhost:{port}/0")
            unchecked = f"rediss://:s3cret@localhost:{port}/0?ssl_cert_reqs=none"
            store = await RedisStore.open(unchecked)
            assert await store.generation(chat_key("k")) == 1
            await store.close()
