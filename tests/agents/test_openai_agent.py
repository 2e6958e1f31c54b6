"""The ``openai`` agent against a real chatlane gateway (demo agent) behind its own API adapter."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chatlane.adapters.api import ApiAdapter
from chatlane.agents.demo import DemoAgent
from chatlane.agents.openai_agent import (
    EndpointFailed,
    OpenAIAgent,
    request_options,
    upstream_session,
    user_input,
)
from chatlane.config import ApiConfig, Config, OpenAIConfig, Secret, ServerConfig
from chatlane.endpoints import NOT_ALLOWED
from chatlane.hub import Hub, build_app
from chatlane.runtime.busy import BusyPolicy, BusySettings
from chatlane.runtime.output import failure_text
from chatlane.runtime.settings import RuntimeSettings
from chatlane.runtime.turn import TurnOverrides
from chatlane.state import SERVICE_TIER_UNSET
from chatlane.stores import Store, open_store
from chatlane.testing import GatewayHarness
from chatlane.types import Attachment, AttachmentKind, ModelChoice, OutboundKind
from tests.keys import chat_key
from tests.ports import free_port

TOKEN = "upstream-token"
ENDPOINT_FAILED = failure_text(EndpointFailed())
"""The one answer a chat gets when a model endpoint cannot be used, whatever the cause."""


@dataclass
class Recorded:
    """One chat-completions request as the upstream received it."""

    headers: dict[str, str]
    body: bytearray = field(default_factory=bytearray)

    def json(self) -> Any:
        return json.loads(self.body)


class Recorder:
    """ASGI middleware that keeps every chat-completions request it passes on."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.requests: list[Recorded] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("/chat/completions"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        record = Recorded(headers)
        self.requests.append(record)

        async def recording() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                record.body += message.get("body", b"")
            return message

        await self.app(scope, recording, send)


@dataclass
class Upstream:
    port: int
    adapter: ApiAdapter
    recorder: Recorder
    hub: Hub

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


@contextlib.asynccontextmanager
async def upstream(tmp_path: Path, busy: str = "queue") -> AsyncIterator[Upstream]:
    """A chatlane gateway running the demo agent behind its API adapter, with a token."""
    token_file = tmp_path / "upstream-token"
    token_file.write_text(TOKEN)
    config = Config(
        server=ServerConfig(token=Secret(file=str(token_file))),
        runtime=RuntimeSettings(busy=BusySettings(BusyPolicy(busy))),
        api=ApiConfig(models=["upstream-model", "other-model", "m"]),  # the names asked for here
    )
    hub = Hub(config, await open_store("memory://"), DemoAgent())
    adapter = ApiAdapter(config)
    hub.add(adapter)
    recorder = Recorder(build_app(hub))
    server = uvicorn.Server(
        uvicorn.Config(recorder, host="127.0.0.1", port=0, lifespan="on", log_level="warning")
    )
    task = asyncio.create_task(server.serve())
    await eventually(lambda: server.started)
    try:
        yield Upstream(server.servers[0].sockets[0].getsockname()[1], adapter, recorder, hub)
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def downstream(
    up: Upstream,
    tmp_path: Path,
    busy: str = "queue",
    allowed: Sequence[str] = (),
    base_url: str | None = None,
    api_key: str = TOKEN,
    **settings: Any,
) -> AsyncIterator[tuple[GatewayHarness, OpenAIAgent]]:
    """A second gateway whose agent is the OpenAI agent pointed at ``up`` (or at
    ``base_url``), with ``api_key``."""
    key_file = tmp_path / "api-key"
    key_file.write_text(api_key)
    config = OpenAIConfig(
        base_url=up.base_url if base_url is None else base_url,
        model="upstream-model",
        api_key=Secret(file=str(key_file)),
        allowed_base_urls=list(allowed),
    )
    own_store = "store" not in settings
    store: Store = settings.pop("store") if not own_store else await open_store("memory://")
    agent = OpenAIAgent(config, store=store)
    try:
        async with GatewayHarness(agent, busy=busy, store=store, **settings) as h:
            yield h, agent
    finally:
        await agent.aclose()
        if own_store:
            await store.close()


async def test_a_turn_goes_through_the_whole_chain(tmp_path: Path) -> None:
    async with upstream(tmp_path) as up, downstream(up, tmp_path) as (h, _):
        await h.send("hello", chat_id="c")
        assert await h.replies(chat_id="c", count=1, timeout=20) == ["echo: hello"]
        chunks = [o.text for o in h.delivered(chat_id="c") if o.kind is OutboundKind.CHUNK]
        assert "".join(chunks) == "echo: hello"
        assert len(chunks) >= 2
        [request] = up.recorder.requests
        assert request.headers["authorization"] == f"Bearer {TOKEN}"
        key = h.session_key(chat_id="c")
        assert request.headers["x-chatlane-session"] == upstream_session(key)
        body = request.json()
        assert body["model"] == "upstream-model"
        assert body["stream"] is True
        assert body["messages"] == [{"role": "user", "content": "hello"}]
        assert "reasoning_effort" not in body
        assert "service_tier" not in body


async def test_history_is_sent(tmp_path: Path) -> None:
    async with upstream(tmp_path) as up, downstream(up, tmp_path) as (h, _):
        for count, text in enumerate(("one", "two", "three"), start=1):
            await h.send(text, chat_id="c")
            await h.replies(chat_id="c", count=count, timeout=20)
        assert up.recorder.requests[-1].json()["messages"] == [
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "echo: one"},
            {"role": "user", "content": "two"},
            {"role": "assistant", "content": "echo: two"},
            {"role": "user", "content": "three"},
        ]
        await h.send("whoami", chat_id="other")
        [line] = await h.replies(chat_id="other", count=1, timeout=20)
        assert f"key=main:api:dm:{upstream_session(h.session_key(chat_id='other'))} " in line
        assert up.recorder.requests[-1].json()["messages"] == [
            {"role": "user", "content": "whoami"}
        ]


PHOTO_URL = "https://files.example/cat.png"
PHOTO = Attachment(AttachmentKind.IMAGE, PHOTO_URL, "image/png", 2048, "cat.png")
TG_PHOTO = Attachment(AttachmentKind.IMAGE, "AgACAgI", "image/jpeg", 12_345)
DOCUMENT = Attachment(AttachmentKind.DOCUMENT, "https://files.example/r.pdf", "application/pdf")
SLACK_PHOTO = Attachment(
    AttachmentKind.IMAGE, "https://files.slack.com/p.png", "image/png", 10, "p.png", private=True
)


def test_an_image_only_the_platforms_token_opens_is_described_never_sent() -> None:
    assert user_input("see", [SLACK_PHOTO]) == {
        "role": "user",
        "content": "see\n[1 attachment: p.png image/png 10 bytes]",
    }
    assert user_input("see", [PHOTO])["content"][1] == {  # type: ignore[index]
        "type": "image_url",
        "image_url": {"url": PHOTO_URL},
    }


async def test_attachments_are_described_and_url_images_sent_as_parts(tmp_path: Path) -> None:
    async with upstream(tmp_path) as up, downstream(up, tmp_path) as (h, _):
        await h.send("what is this?", chat_id="c", attachments=(PHOTO, TG_PHOTO, DOCUMENT))
        [reply] = await h.replies(chat_id="c", count=1, timeout=20)
        described = (
            "[3 attachments: cat.png image/png 2 KB; image image/jpeg 12 KB; "
            "document application/pdf]"
        )
        assert reply == f"echo: what is this?\n{described}"  # the upstream reads text parts
        [user] = up.recorder.requests[-1].json()["messages"]
        assert user["content"] == [
            {"type": "text", "text": f"what is this?\n{described}"},
            {"type": "image_url", "image_url": {"url": PHOTO_URL}},
        ]
        await h.send("", chat_id="c", attachments=(TG_PHOTO,))
        await h.replies(chat_id="c", count=2, timeout=20)
        history = up.recorder.requests[-1].json()["messages"]
        assert history[0] == {"role": "user", "content": f"what is this?\n{described}"}
        assert history[-1] == {"role": "user", "content": "[1 attachment: image image/jpeg 12 KB]"}


async def test_model_names_the_configured_model_as_the_default(tmp_path: Path) -> None:
    async with upstream(tmp_path) as up, downstream(up, tmp_path) as (h, _):
        await h.send("/model", chat_id="c")
        assert await h.replies(chat_id="c", count=1) == ["Model: upstream-model (the default)"]


async def test_overrides_reach_the_upstream(tmp_path: Path) -> None:
    async with upstream(tmp_path) as up, downstream(up, tmp_path) as (h, _):
        for command in ("/model other-model", "/reasoning high", "/fast on", "hi", "/fast off"):
            await h.send(command, chat_id="c")
        await h.send("again", chat_id="c")
        await h.settle()
        first, second = (r.json() for r in up.recorder.requests)
        assert (first["model"], first["reasoning_effort"], first["service_tier"]) == (
            "other-model",
            "high",
            "priority",
        )
        assert second["service_tier"] == "default"


async def test_the_key_goes_only_to_the_configured_endpoint(tmp_path: Path) -> None:
    async with upstream(tmp_path) as up:
        elsewhere = f"http://localhost:{up.port}/v1"
        async with downstream(up, tmp_path, allowed=[elsewhere]) as (h, _):
            await h.send(f"/model m --base-url {elsewhere}", chat_id="c")
            await h.send("hi", chat_id="c")
            replies = await h.replies(chat_id="c", count=2, timeout=20)
            assert replies[1] == ENDPOINT_FAILED  # the upstream said 401
            assert up.recorder.requests[-1].headers["authorization"] == "Bearer none"
            await h.send(f"/model m --base-url {up.base_url}/", chat_id="c")
            await h.send("hi", chat_id="c")
            assert (await h.replies(chat_id="c", count=4, timeout=20))[3] == "echo: hi"


@dataclass
class Bystander:
    """A plain HTTP server inside the gateway's network that nobody allowed a chat to reach."""

    port: int
    request_lines: list[bytes]


@contextlib.asynccontextmanager
async def bystander() -> AsyncIterator[Bystander]:
    """Records each request line and answers an empty 200."""
    lines: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lines.append((await reader.readline()).strip())
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield Bystander(server.sockets[0].getsockname()[1], lines)
    finally:
        server.close()
        await server.wait_closed()


async def test_a_chat_cannot_send_the_gateway_to_an_unlisted_url(tmp_path: Path) -> None:
    async with upstream(tmp_path) as up, bystander() as inside, downstream(up, tmp_path) as (h, _):
        target = f"http://127.0.0.1:{inside.port}/internal/admin?x="
        await h.send(f"/model m --base-url {target}", chat_id="c")
        await h.send("hi", chat_id="c")
        refused, answered = await h.replies(chat_id="c", count=2, timeout=20)
        assert refused.startswith(NOT_ALLOWED)
        assert str(inside.port) not in refused
        assert answered == "echo: hi"  # the configured endpoint, as before
        assert inside.request_lines == []
        assert up.recorder.requests[-1].json()["model"] == "upstream-model"


@contextlib.asynccontextmanager
async def redirecting_to(location: str) -> AsyncIterator[int]:
    """A server that answers every request with a 307 to ``location``; its port."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        head = f"HTTP/1.1 307 Temporary Redirect\r\nlocation: {location}\r\n"
        writer.write(f"{head}content-length: 0\r\nconnection: close\r\n\r\n".encode())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


async def test_a_listed_endpoints_redirect_is_not_followed(tmp_path: Path) -> None:
    """A listed endpoint that answers 307 cannot send the gateway to an unlisted address
    (and its answer back to the chat)."""
    async with upstream(tmp_path) as up, bystander() as inside:
        unlisted = f"http://127.0.0.1:{inside.port}/internal/secret"
        async with redirecting_to(unlisted) as port:
            listed = f"http://127.0.0.1:{port}/v1"
            async with downstream(up, tmp_path, allowed=[listed]) as (h, _):
                await h.send(f"/model m --base-url {listed}", chat_id="c")
                await h.send("hi", chat_id="c")
                replies = await h.replies(chat_id="c", count=2, timeout=20)
        assert replies[1] == ENDPOINT_FAILED
        assert inside.request_lines == []


async def test_a_stored_endpoint_no_longer_allowed_is_not_called(tmp_path: Path) -> None:
    async with upstream(tmp_path) as up, bystander() as inside:
        chosen = f"http://127.0.0.1:{inside.port}/v1"
        store = await open_store("memory://")
        async with downstream(up, tmp_path, allowed=[chosen], store=store) as (h, _):
            await h.send(f"/model m --base-url {chosen}", chat_id="c")
            await h.replies(chat_id="c", count=1, timeout=20)
        async with downstream(up, tmp_path, store=store) as (h, _):  # the operator took it out
            await h.send("hi", chat_id="c")
            assert await h.replies(chat_id="c", count=1, timeout=20) == [ENDPOINT_FAILED]
        assert inside.request_lines == []
        await store.close()


async def test_endpoint_errors_read_the_same_whatever_answered(tmp_path: Path) -> None:
    async with upstream(tmp_path) as up, bystander() as inside:
        closed = f"http://127.0.0.1:{free_port()}/v1"
        missing = f"http://127.0.0.1:{up.port}/nothing/here"
        empty = f"http://127.0.0.1:{inside.port}/v1"
        allowed = [closed, missing, empty]
        async with downstream(up, tmp_path, allowed=allowed) as (h, _):
            for index, url in enumerate(allowed):
                await h.send(f"/model m --base-url {url}", chat_id=f"c{index}")
                await h.send("hi", chat_id=f"c{index}")
            answers = {(await h.replies(chat_id=f"c{i}", count=2, timeout=60))[1] for i in range(3)}
        assert answers == {ENDPOINT_FAILED}


@pytest.mark.parametrize(
    ("case", "told", "logged"),
    [
        ("wrong key", "the model endpoint refused the API key", "refused the API key: Authen"),
        ("unknown model", "the model endpoint does not know the model", "know the model: NotFound"),
        ("closed port", "the model endpoint could not be reached", "be reached: APIConnection"),
    ],
)
async def test_the_configured_endpoints_failure_is_told_in_words_and_logged_in_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, case: str, told: str, logged: str
) -> None:
    """The operator's own endpoint: the chat hears what went wrong, the log one line with
    the endpoint's URL and the cause (never the key), no traceback."""
    async with upstream(tmp_path) as up:
        closed = f"http://127.0.0.1:{free_port()}/v1"
        key = "sk-wrong-key" if case == "wrong key" else TOKEN
        url = closed if case == "closed port" else up.base_url
        async with downstream(up, tmp_path, base_url=url, api_key=key) as (h, _):
            if case == "unknown model":
                await h.send("/model no-such-model", chat_id="c")
            await h.send("hi", chat_id="c")
            replies = await h.replies(chat_id="c", count=2 if case == "unknown model" else 1)
    assert replies[-1] == f"Sorry — the agent failed on this message: {told}."
    [record] = [r for r in caplog.records if r.name == "chatlane.runtime"]
    assert record.exc_info is None
    line = record.getMessage()
    assert line.startswith(f"agent failed: the model endpoint {url} ")
    assert logged in line
    assert "\n" not in line
    assert key not in caplog.text


async def test_a_chosen_endpoints_failure_is_logged_with_its_url_and_cause(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    closed = f"http://127.0.0.1:{free_port()}/v1"
    async with upstream(tmp_path) as up, downstream(up, tmp_path, allowed=[closed]) as (h, _):
        await h.send(f"/model m --base-url {closed}", chat_id="c")
        await h.send("hi", chat_id="c")
        assert (await h.replies(chat_id="c", count=2, timeout=20))[1] == ENDPOINT_FAILED
    [record] = [r for r in caplog.records if r.name == "chatlane.runtime"]
    assert record.exc_info is None
    assert record.getMessage().startswith(
        f"agent failed: the model endpoint {closed} (chosen in the chat) could not be reached: "
    )


async def test_the_http_clients_request_log_is_redacted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="httpx")
    async with upstream(tmp_path) as up, downstream(up, tmp_path) as (h, _):
        url = f"http://me:hunter2@127.0.0.1:{up.port}/v1/models?token=hunter2"
        async with httpx.AsyncClient() as client:
            await client.get(url)
        await h.send("hi", chat_id="c")
        await h.replies(chat_id="c", count=1, timeout=20)
    requests = [r.getMessage() for r in caplog.records if r.name == "httpx"]
    assert any("/v1/models?token=***" in line for line in requests), requests
    assert not any("hunter2" in line for line in requests)


async def test_stop_closes_the_stream_at_once(tmp_path: Path) -> None:
    async with (
        upstream(tmp_path) as up,
        downstream(up, tmp_path, interrupt_grace=30.0) as (h, _),
    ):
        await h.send("sleep 30", chat_id="c")
        await eventually(lambda: up.adapter.waiting == 1)
        await h.send("/stop", chat_id="c")
        async with asyncio.timeout(10):
            await h.settle()
        await eventually(lambda: up.adapter.waiting == 0)
        key = chat_key(upstream_session(h.session_key(chat_id="c")), "api")
        assert up.hub.gateway.engine.running_turn(key) is not None, "the upstream still sleeps"
        replies = await h.replies(chat_id="c", count=1)
        assert replies == ["Stopped the running turn. Dropped 0 queued messages."]


async def test_interrupt_runs_the_newer_message(tmp_path: Path) -> None:
    async with (
        upstream(tmp_path, busy="interrupt") as up,
        downstream(up, tmp_path, busy="interrupt") as (h, _),
    ):
        await h.send("sleep 30", chat_id="c")
        await eventually(lambda: up.adapter.waiting == 1)
        await h.send("hello", chat_id="c")
        replies = await h.replies(chat_id="c", count=2, timeout=20)
        assert replies == ["Interrupting the current task", "echo: hello"]
        await h.settle()
        await eventually(lambda: up.adapter.waiting == 0)


def test_request_options() -> None:
    assert request_options(TurnOverrides()) == {}
    assert request_options(TurnOverrides(reasoning="low", service_tier=None)) == {
        "reasoning_effort": "low",
        "service_tier": "default",
    }
    tier = TurnOverrides(model=ModelChoice("m"), service_tier="priority")
    assert request_options(tier) == {"service_tier": "priority"}
    assert request_options(TurnOverrides(service_tier=SERVICE_TIER_UNSET)) == {}


def test_the_key_stays_out_of_repr(tmp_path: Path) -> None:
    agent = OpenAIAgent(OpenAIConfig(api_key=Secret(env="K")), api_key="sk-very-secret")
    assert "sk-very-secret" not in repr(agent)
    assert "sk-very-secret" not in repr(agent.config)


async def eventually(predicate: Callable[[], bool]) -> None:
    async with asyncio.timeout(10):
        while True:
            if predicate():
                return
            await asyncio.sleep(0.02)
