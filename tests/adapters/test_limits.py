"""Global limits and client identity, attacked over real servers: the openai SDK and WebSockets."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import sys
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import httpx
import httpx2
import openai
import pytest
import uvicorn
from openai import AsyncOpenAI
from websockets.exceptions import ConnectionClosed

from chatlane.access import GUESS_WINDOW, GUESSES, AccessToken, GuessLimiter
from chatlane.adapters import web
from chatlane.adapters.api import ApiAdapter
from chatlane.adapters.api_clients import ApiClients
from chatlane.adapters.web_ids import SECRET_SUFFIX, BrowserIds, id_secret
from chatlane.adapters.web_page import IDENTITY_COOKIE
from chatlane.agents.demo import DemoAgent
from chatlane.config import (
    ApiClientConfig,
    ApiConfig,
    Config,
    LimitsConfig,
    Secret,
    StoreConfig,
    check_config,
    load_config,
)
from chatlane.errors import ConfigError
from chatlane.hub import Hub, build_app
from chatlane.runtime.capacity import CapacitySettings
from chatlane.runtime.turn import Turn
from chatlane.secrets import TokenSource
from chatlane.stores import open_store
from tests.adapters.test_api import TOKEN, eventually, make_config
from tests.adapters.test_web import browser_id, chat_socket, drain, greeted, web_server
from tests.keys import chat_key

MIB = 1024 * 1024


class HeldAgent:
    """Answers only once ``release`` is set, so messages stay held by the gateway."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def __call__(self, turn: Turn) -> str:
        await self.release.wait()
        return "done"


@contextlib.asynccontextmanager
async def served(hub: Hub, token: str = TOKEN) -> AsyncIterator[AsyncOpenAI]:
    """``hub`` (with its adapters added) on a real uvicorn server; an SDK client for it."""
    server = uvicorn.Server(
        uvicorn.Config(build_app(hub), host="127.0.0.1", port=0, lifespan="on", log_level="warning")
    )
    task = asyncio.create_task(server.serve())
    await eventually(lambda: server.started)
    port = server.servers[0].sockets[0].getsockname()[1]
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=token, max_retries=0)
    try:
        async with client:
            yield client
    finally:
        server.should_exit = True
        await task


async def api_hub(config: Config, agent: object) -> Hub:
    hub = Hub(config, await open_store("memory://"), agent)  # type: ignore[arg-type]
    hub.add(ApiAdapter(config))
    return hub


def ask(client: AsyncOpenAI, text: str, session: str) -> asyncio.Task[object]:
    create = client.chat.completions.create(
        model="chatlane", messages=[{"role": "user", "content": text}], user=session
    )
    return asyncio.ensure_future(create)


# -- queued bytes and live sessions ---------------------------------------------------------


async def test_big_bodies_under_invented_names_stop_at_the_global_byte_limit(
    tmp_path: Path,
) -> None:
    """Each session keeps under its own cap; their sum is refused with an explicit 503."""
    config = make_config(tmp_path, capacity=CapacitySettings(queued_bytes=3 * MIB))
    agent = HeldAgent()
    hub = await api_hub(config, agent)
    body = "x" * (MIB - 4096)
    async with served(hub) as client:
        held = [ask(client, body, f"invented-{n}") for n in range(3)]
        engine = hub.gateway.engine
        keys = [chat_key(f"invented-{n}", "api") for n in range(3)]
        await eventually(lambda: all(engine.unanswered(key) for key in keys))
        with pytest.raises(openai.InternalServerError) as refused:
            await client.chat.completions.create(
                model="chatlane", messages=[{"role": "user", "content": body}], user="invented-9"
            )
        assert refused.value.status_code == 503
        assert refused.value.code == "gateway_full"
        assert "queued_bytes" in refused.value.message
        agent.release.set()
        assert len(await asyncio.gather(*held)) == 3
        reply = await client.chat.completions.create(
            model="chatlane", messages=[{"role": "user", "content": body}], user="invented-9"
        )
        assert reply.choices[0].message.content == "done"


async def test_a_message_larger_than_the_byte_limit_alone_is_a_413(tmp_path: Path) -> None:
    """A 503 would have the client (and the SDK, by default) retry what can never pass."""
    config = make_config(tmp_path, capacity=CapacitySettings(queued_bytes=4000))
    hub = await api_hub(config, HeldAgent())
    async with served(hub) as client:
        with pytest.raises(openai.APIStatusError) as refused:
            await client.chat.completions.create(
                model="chatlane", messages=[{"role": "user", "content": "x" * 5000}], user="big"
            )
    assert (refused.value.status_code, refused.value.code) == (413, "message_too_large")
    assert "queued_bytes = 4000" in refused.value.message


async def test_a_session_beyond_the_live_limit_is_refused_but_a_live_one_queues(
    tmp_path: Path,
) -> None:
    config = make_config(tmp_path, capacity=CapacitySettings(live_sessions=2))
    agent = HeldAgent()
    hub = await api_hub(config, agent)
    engine = hub.gateway.engine
    async with served(hub) as client:
        held = [ask(client, "hi", "a"), ask(client, "hi", "b")]
        await eventually(lambda: engine.running_count() == 2)
        with pytest.raises(openai.InternalServerError) as refused:
            await client.chat.completions.create(
                model="chatlane", messages=[{"role": "user", "content": "hi"}], user="c"
            )
        assert (refused.value.status_code, refused.value.code) == (503, "gateway_full")
        assert "live_sessions" in refused.value.message
        held.append(ask(client, "again", "a"))  # a live session still queues
        await eventually(lambda: len(engine.unanswered(chat_key("a", "api"))) == 2)
        agent.release.set()
        assert len(await asyncio.gather(*held)) == 3


def test_active_turns_are_bounded_by_default() -> None:
    assert load_config(environ={}).runtime.leases.max_active_sessions == 64


# -- sockets and browser ids ---------------------------------------------------------------


async def closed_with(host: str, cookie: str) -> tuple[int, str]:
    async with chat_socket(host, cookie) as ws:
        with pytest.raises(ConnectionClosed) as closed:
            await drain(ws)
    assert closed.value.rcvd is not None
    return closed.value.rcvd.code, closed.value.rcvd.reason


async def test_sockets_beyond_the_global_limit_are_closed_1013() -> None:
    async with web_server(Config(limits=LimitsConfig(sockets=3))) as host:
        bids = [await browser_id(host) for _ in range(4)]
        async with contextlib.AsyncExitStack() as open_sockets:
            for bid in bids[:3]:
                await open_sockets.enter_async_context(greeted(host, bid))
            code, reason = await closed_with(host, f"{IDENTITY_COOKIE}={bids[3]}")
            assert code == 1013
            assert "too many open connections" in reason


@pytest.mark.parametrize(
    "invented",
    ["A" * 24, "A" * 24 + "." + "B" * 43],
    ids=["unsigned", "forged-signature"],
)
async def test_an_invented_browser_id_is_refused_so_the_tab_limit_holds(
    invented: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(web, "MAX_TABS", 1)
    async with web_server() as host:
        bid = await browser_id(host)
        async with greeted(host, bid):
            assert await closed_with(host, f"{IDENTITY_COOKIE}={bid}") == (
                1013,
                "too many open tabs",
            )
            code, _ = await closed_with(host, f"{IDENTITY_COOKIE}={invented}")
            assert code == 4400
        async with httpx.AsyncClient(base_url=f"http://{host}") as page:
            fresh = await page.get("/", headers={"Cookie": f"{IDENTITY_COOKIE}={invented}"})
        assert fresh.cookies[IDENTITY_COOKIE] != invented


def test_the_id_secret_is_a_private_file_next_to_the_database(tmp_path: Path) -> None:
    config = Config(store=StoreConfig(url=f"sqlite:///{tmp_path / 'chat.db'}"))
    first = id_secret(config)
    path = tmp_path / ("chat.db" + SECRET_SUFFIX)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    issued = BrowserIds(first).issue()
    assert BrowserIds(id_secret(config)).verify(issued) == issued.partition(".")[0]
    assert BrowserIds(b"another secret, 32 bytes long...").verify(issued) is None


def started_together(count: int, start: Callable[[], bytes]) -> list[bytes]:
    """``start()`` in ``count`` threads released at the same moment; what each returned."""
    barrier = threading.Barrier(count)

    def run(_: int) -> bytes:
        barrier.wait()
        return start()

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(run, range(count)))


def test_processes_starting_together_all_read_the_one_whole_secret(tmp_path: Path) -> None:
    """Several gateways on one database start at once: none reads a half-written secret."""
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the threads as densely as the interpreter can
    try:
        for attempt in range(30):
            config = Config(store=StoreConfig(url=f"sqlite:///{tmp_path / f'{attempt}.db'}"))
            secrets = set(started_together(8, partial(id_secret, config)))
            assert len(secrets) == 1
            assert len(secrets.pop()) == 32
            assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []
    finally:
        sys.setswitchinterval(switch)


# -- API clients -----------------------------------------------------------------------------


def clients_config(tmp_path: Path) -> Config:
    for name in ("alice", "bob"):
        (tmp_path / name).write_text(f"{name}-token")
    clients = {
        name: ApiClientConfig(token=Secret(file=str(tmp_path / name))) for name in ("alice", "bob")
    }
    return make_config(tmp_path, api=ApiConfig(clients=clients))


async def test_a_client_can_never_name_another_clients_session(tmp_path: Path) -> None:
    config = clients_config(tmp_path)
    hub = await api_hub(config, DemoAgent())
    async with served(hub, token="alice-token") as alice:
        reply = await alice.chat.completions.create(
            model="chatlane", messages=[{"role": "user", "content": "whoami"}], user="alice:x"
        )
        assert "user=alice key=main:api:dm:alice%3Ax " in (reply.choices[0].message.content or "")
        for stolen in ("bob:x", "bob:", "alicex", "x"):
            with pytest.raises(openai.PermissionDeniedError) as refused:
                await alice.chat.completions.create(
                    model="chatlane", messages=[{"role": "user", "content": "hi"}], user=stolen
                )
            assert refused.value.code == "session_not_allowed"
        for token in (TOKEN, "bob-token!", ""):
            anonymous = alice.with_options(api_key=token or "-")
            with pytest.raises(openai.AuthenticationError):
                await anonymous.chat.completions.create(
                    model="chatlane", messages=[{"role": "user", "content": "hi"}], user="bob:x"
                )
        assert hub.gateway.engine.registry.peek(chat_key("bob:x", "api")) is None


async def test_wrong_client_tokens_block_their_address(tmp_path: Path) -> None:
    """A client's token is guessed like the access token: five wrong ones block the address
    (even alice's right token is not judged from there), and no other address."""
    hub = await api_hub(clients_config(tmp_path), DemoAgent())
    async with served(hub, token="alice-token") as alice:
        guesser = alice.with_options(default_headers={"X-Forwarded-For": "203.0.113.7"})
        for guess in range(GUESSES):
            with pytest.raises(openai.AuthenticationError):
                await guesser.with_options(api_key=f"bob-token-{guess}").models.list()
        with pytest.raises(openai.RateLimitError) as blocked:
            await guesser.models.list()
        assert blocked.value.code == "too_many_wrong_tokens"
        assert 0 < int(blocked.value.response.headers["retry-after"]) <= GUESS_WINDOW
        neighbour = alice.with_options(default_headers={"X-Forwarded-For": "198.51.100.2"})
        assert [model.id async for model in neighbour.models.list()] == ["chatlane"]


async def test_credentials_of_another_scheme_are_no_client_guesses(tmp_path: Path) -> None:
    """``Authorization: Basic …`` (a proxy's own password check) names no client: 401 each
    time, never counted, so alice's token is still served from that address."""
    hub = await api_hub(clients_config(tmp_path), DemoAgent())
    async with served(hub, token="alice-token") as alice:
        behind = alice.with_options(default_headers={"X-Forwarded-For": "203.0.113.7"})
        basic = behind.with_options(
            default_headers={
                "X-Forwarded-For": "203.0.113.7",
                "Authorization": "Basic dXNlcjpwYXNz",
            }
        )
        for _ in range(GUESSES + 1):
            with pytest.raises(openai.AuthenticationError):
                await basic.models.list()
        assert [model.id async for model in behind.models.list()] == ["chatlane"]


async def test_a_blocked_address_is_told_at_once_not_to_retry(tmp_path: Path) -> None:
    """The SDK, left to retry a 429 as it does by default, obeys ``x-should-retry: false``:
    the right token from a blocked address fails at once with RateLimitError, after one
    request, instead of being sent twice more after ``Retry-After`` (up to a minute each).
    The limiter's clock stands still, so the address stays blocked whatever the SDK does."""
    config = make_config(tmp_path)
    guesses = GuessLimiter(window=1, clock=lambda: 0.0)
    access = AccessToken(TokenSource.read(config.server.token), guesses)
    hub = Hub(config, await open_store("memory://"), DemoAgent())
    hub.add(ApiAdapter(config, access=access))
    sent: list[httpx2.Request] = []  # the SDK's own HTTP client library

    async def note(request: httpx2.Request) -> None:
        sent.append(request)

    async with (
        served(hub) as client,
        httpx2.AsyncClient(event_hooks={"request": [note]}) as http,
    ):
        for guess in range(GUESSES):
            with pytest.raises(openai.AuthenticationError):
                await client.with_options(api_key=f"guess-{guess}").models.list()
        retrying = client.with_options(max_retries=2, http_client=http)
        with pytest.raises(openai.RateLimitError) as blocked:
            await retrying.models.list()
    assert len(sent) == 1
    assert blocked.value.code == "too_many_wrong_tokens"
    assert blocked.value.response.headers["x-should-retry"] == "false"


def test_a_client_whose_token_is_unset_is_told_where_it_was_read() -> None:
    clients = {"alice": ApiClientConfig(Secret(env="ALICE_API_TOKEN"))}
    config = Config(api=ApiConfig(clients=clients))
    with pytest.raises(ConfigError) as refused:
        ApiClients.from_config(config, {})
    assert str(refused.value) == (
        "configuration key 'api.clients.alice.token': no token: "
        "the environment variable ALICE_API_TOKEN is not set"
    )


def test_client_prefixes_that_overlap_are_refused(tmp_path: Path) -> None:
    (tmp_path / "t").write_text("t")
    token = Secret(file=str(tmp_path / "t"))
    clients = {"a": ApiClientConfig(token, prefix="team"), "b": ApiClientConfig(token, "team-b")}
    with pytest.raises(ConfigError, match="could name its sessions"):
        check_config(Config(api=ApiConfig(clients=clients)))
