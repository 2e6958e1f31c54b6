"""The OpenAI-compatible API, driven by the official ``openai`` client against a real server."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from openai import AsyncOpenAI
from starlette.requests import Request

from chatlane.adapters.api import ApiAdapter
from chatlane.adapters.api_waiters import INTERRUPTED_TEXT, NOT_RUN_TEXT, STOPPED_TEXT
from chatlane.adapters.api_wire import ApiRequestError, ChunkEvents, check_origin, chunk, sse_data
from chatlane.agents.demo import DemoAgent
from chatlane.config import AgentConfig, ApiConfig, Config, Secret, ServerConfig
from chatlane.hub import Hub, build_app
from chatlane.runtime.aside import SIDE_MARK
from chatlane.runtime.busy import BusyPolicy, BusySettings
from chatlane.runtime.capacity import CapacitySettings
from chatlane.runtime.engine import CANCELLED
from chatlane.runtime.output import CUT_SHORT
from chatlane.runtime.settings import RuntimeSettings
from chatlane.runtime.turn import Turn
from chatlane.secrets import Secrets
from chatlane.stores import Admission, Store, open_store
from chatlane.stores.codec import decode_message
from chatlane.types import Agent, Outbound, OutboundKind, SessionKey
from tests.keys import chat_key

TOKEN = "s3cret-token"


@dataclass
class Served:
    """A running gateway with the API adapter, and a client for it."""

    port: int
    hub: Hub
    adapter: ApiAdapter
    client: AsyncOpenAI

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def ask(self, text: str, session: str, **kwargs: Any) -> str:
        reply = await self.client.chat.completions.create(
            model="chatlane", messages=[{"role": "user", "content": text}], user=session, **kwargs
        )
        return reply.choices[0].message.content or ""

    async def ask_streaming(self, text: str, session: str) -> list[str]:
        stream = await self.client.chat.completions.create(
            model="chatlane",
            messages=[{"role": "user", "content": text}],
            user=session,
            stream=True,
        )
        parts: list[str] = []
        async with stream:
            async for event in stream:
                parts.append(event.choices[0].delta.content or "")
        return parts

    async def queued(self, session: str, count: int) -> bool:
        """Whether ``count`` messages wait in ``session``'s queue (asked with ``/status``)."""
        return f"queued: {count}\n" in await self.ask("/status", session)

    async def generation(self, session: str) -> int:
        """``session``'s generation (asked with ``/status``); ``/new`` raises it."""
        status = await self.ask("/status", session)
        return int(status.split("generation: ")[1].split("\n")[0])

    async def running(self, session: str) -> Turn:
        """Wait until ``session``'s turn holds its lease."""
        key = chat_key(session, "api")
        async with asyncio.timeout(10):
            while True:
                turn = self.hub.gateway.engine.running_turn(key)
                if turn is not None and turn.lease is not None:
                    return turn
                await asyncio.sleep(0.02)


def make_config(
    tmp_path: Path,
    *,
    busy: str = "queue",
    queue_cap: int = 32,
    capacity: CapacitySettings | None = None,
    **fields: Any,
) -> Config:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    server = ServerConfig(token=Secret(file=str(token_file)))
    runtime = RuntimeSettings(
        busy=BusySettings(BusyPolicy(busy)),
        queue_cap=queue_cap,
        capacity=capacity or CapacitySettings(),
    )
    return Config(server=server, runtime=runtime, **fields)


@contextlib.asynccontextmanager
async def serve(
    config: Config,
    agent: Agent | None = None,
    *,
    store: str | Store = "memory://",
    **adapter_options: Any,
) -> AsyncIterator[Served]:
    opened = await open_store(store) if isinstance(store, str) else store
    hub = Hub(config, opened, agent or DemoAgent())
    adapter = ApiAdapter(config, **adapter_options)
    hub.add(adapter)
    server = uvicorn.Server(
        uvicorn.Config(build_app(hub), host="127.0.0.1", port=0, lifespan="on", log_level="warning")
    )
    task = asyncio.create_task(server.serve())
    await eventually(lambda: server.started)
    port = server.servers[0].sockets[0].getsockname()[1]
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=TOKEN, max_retries=0)
    try:
        async with client:
            yield Served(port, hub, adapter, client)
    finally:
        server.should_exit = True
        await task


async def test_non_streaming_completion(tmp_path: Path) -> None:
    async with serve(make_config(tmp_path)) as s:
        reply = await s.client.chat.completions.create(
            model="chatlane",
            messages=[
                {"role": "system", "content": "ignored: the gateway keeps history"},
                {"role": "user", "content": "hello"},
            ],
            user="alice",
        )
        assert reply.object == "chat.completion"
        assert reply.choices[0].message.content == "echo: hello"
        assert reply.choices[0].finish_reason == "stop"
        assert reply.model == "chatlane"
        assert s.adapter.waiting == 0


async def test_streaming_completion(tmp_path: Path) -> None:
    async with serve(make_config(tmp_path)) as s:
        parts = await s.ask_streaming("hello there", "alice")
        assert "".join(parts) == "echo: hello there"
        assert len([p for p in parts if p]) >= 3
        stream = await s.client.chat.completions.create(
            model="chatlane",
            messages=[{"role": "user", "content": "whoami"}],
            user="bob",
            stream=True,
        )
        async with stream:
            events = [event async for event in stream]
        assert events[-1].choices[0].finish_reason == "stop"
        text = "".join(e.choices[0].delta.content or "" for e in events)
        assert "key=main:api:dm:bob " in text


async def test_only_a_streaming_request_has_its_chunks_sent_out(tmp_path: Path) -> None:
    """A request without ``stream`` takes the reply whole: its turn sends no chunk out,
    and the message stored for it says so, for whichever process runs it."""
    kinds: dict[str, list[OutboundKind]] = {}
    queued: dict[str, bool] = {}
    store = await open_store("memory://")
    enqueue = store.enqueue_and_acquire

    async def recorded(key: SessionKey, message_id: str, *args: Any, **kw: Any) -> Admission:
        queued[key] = decode_message(args[1]).whole_reply
        return await enqueue(key, message_id, *args, **kw)

    def keep(outbound: Outbound) -> bool:
        kinds.setdefault(outbound.target.chat_id or "", []).append(outbound.kind)
        return True

    store.enqueue_and_acquire = recorded  # type: ignore[method-assign]
    async with serve(make_config(tmp_path), store=store) as s:
        s.hub.gateway.add_outbound_filter(keep)
        assert await s.ask("hello there", "whole") == "echo: hello there"
        assert "".join(await s.ask_streaming("hello there", "streamed")) == "echo: hello there"
    assert kinds["whole"] == [OutboundKind.REPLY]
    assert kinds["streamed"].count(OutboundKind.CHUNK) >= 3
    assert queued == {chat_key("whole", "api"): True, chat_key("streamed", "api"): False}


async def test_content_parts_and_the_session_header(tmp_path: Path) -> None:
    async with serve(make_config(tmp_path)) as s:
        reply = await s.client.chat.completions.create(
            model="chatlane",
            messages=[
                {"role": "user", "content": "earlier"},
                {"role": "assistant", "content": "echo: earlier"},
                {"role": "user", "content": [{"type": "text", "text": "whoami"}]},
            ],
            user="ignored-when-the-header-is-set",
            extra_headers={"X-Chatlane-Session": "from-header"},
        )
        assert "key=main:api:dm:from-header " in (reply.choices[0].message.content or "")


async def test_a_utf8_session_header_names_the_same_session_as_user(tmp_path: Path) -> None:
    async with serve(make_config(tmp_path)) as s, httpx.AsyncClient() as http:
        body = {"messages": [{"role": "user", "content": "whoami"}]}
        auth = f"Bearer {TOKEN}".encode()
        url = f"{s.base_url}/chat/completions"
        named = {b"Authorization": auth, b"X-Chatlane-Session": "ünï 👤".encode()}
        response = await http.post(url, json=body, headers=named)
        assert "key=main:api:dm:ünï 👤 " in response.json()["choices"][0]["message"]["content"]
        assert "key=main:api:dm:ünï 👤 " in await s.ask("whoami", "ünï 👤")
        not_utf8 = {b"Authorization": auth, b"X-Chatlane-Session": b"\xff\xfe"}
        response = await http.post(url, json=body, headers=not_utf8)
        assert response.status_code == 400
        assert "not UTF-8" in response.json()["error"]["message"]


async def test_fifty_sessions_each_get_their_own_answer(tmp_path: Path) -> None:
    async with serve(make_config(tmp_path)) as s:
        names = [f"s{i}" for i in range(50)]
        answers = await asyncio.gather(*(s.ask("whoami", name) for name in names))
        for name, answer in zip(names, answers, strict=True):
            assert f" user={name} key=main:api:dm:{name} gen=1" in answer


async def test_reject_answers_409_while_the_session_is_busy(tmp_path: Path) -> None:
    async with serve(make_config(tmp_path, busy="reject")) as s:
        first = asyncio.create_task(s.ask("sleep 2", "busy"))
        await s.running("busy")
        with pytest.raises(openai.ConflictError) as caught:
            await s.ask("hello", "busy")
        assert caught.value.code == "session_busy"
        assert caught.value.type == "session_busy"
        assert await first == "slept 2"
        assert await s.ask("hello", "busy") == "echo: hello"


async def test_reject_answers_409_when_another_process_runs_the_session(tmp_path: Path) -> None:
    config = make_config(tmp_path, busy="reject")
    shared = f"sqlite:///{tmp_path / 'shared.db'}"
    async with serve(config, store=shared) as runner, serve(config, store=shared) as other:
        first = asyncio.create_task(runner.ask("sleep 2", "busy"))
        await runner.running("busy")
        with pytest.raises(openai.ConflictError) as caught:
            await other.ask("hello", "busy")
        assert caught.value.code == "session_busy"
        with pytest.raises(openai.APIError, match="busy policy is reject"):
            await other.ask_streaming("and this", "busy")
        assert other.adapter.waiting == 0
        assert await first == "slept 2"
        assert await other.ask("hello", "busy") == "echo: hello"


async def test_a_request_can_ask_for_its_own_busy_policy(tmp_path: Path) -> None:
    async with serve(make_config(tmp_path)) as s:  # the session queues
        first = asyncio.create_task(s.ask("sleep 30", "own"))
        await s.running("own")
        with pytest.raises(openai.ConflictError) as caught:
            await s.ask("not now", "own", extra_headers={"X-Chatlane-Busy": "Reject"})
        assert caught.value.code == "session_busy"
        urgent = await s.ask("urgent", "own", extra_headers={"X-Chatlane-Busy": "interrupt"})
        assert urgent == "echo: urgent"
        assert (await first).startswith("Interrupted")


async def test_a_request_can_redirect_the_running_one(tmp_path: Path) -> None:
    async with serve(make_config(tmp_path)) as s:  # the session queues
        first = asyncio.create_task(s.ask("stream 50", "redirected"))
        await s.running("redirected")
        headers = {"X-Chatlane-Busy": "redirect"}
        assert await s.ask("hello", "redirected", extra_headers=headers) == "echo: hello"
        assert (await first).endswith(CUT_SHORT)  # what it streamed so far, kept and marked


async def test_a_side_question_is_answered_while_the_turn_runs(tmp_path: Path) -> None:
    async with serve(make_config(tmp_path)) as s:
        first = asyncio.create_task(s.ask("sleep 30", "aside"))
        await s.running("aside")
        assert await s.ask("/btw hello", "aside") == f"{SIDE_MARK}echo: hello"
        assert not first.done()
        await s.ask("/stop", "aside")
        assert await first == STOPPED_TEXT


async def cancel(s: Served, completion: str, token: str = TOKEN) -> httpx.Response:
    async with httpx.AsyncClient(base_url=s.base_url) as http:
        headers = {"Authorization": f"Bearer {token}"}
        return await http.post(f"/chat/completions/{completion}/cancel", headers=headers)


async def test_a_waiting_request_is_cancelled_by_its_completion_id(tmp_path: Path) -> None:
    async with serve(make_config(tmp_path)) as s:  # the session queues
        first = asyncio.create_task(s.ask("sleep 30", "cancelled"))
        running = await s.running("cancelled")
        stream = await s.client.chat.completions.create(
            model="chatlane",
            messages=[{"role": "user", "content": "never mind this one"}],
            user="cancelled",
            stream=True,
        )
        chunks = aiter(stream)
        completion = (await anext(chunks)).id  # sent before its turn runs, with its id
        assert (await cancel(s, completion, token="not-the-token")).status_code == 401
        answer = await cancel(s, completion)
        assert answer.status_code == 200
        assert answer.json() == {"id": completion, "object": "chat.completion.cancellation"}
        told = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
        assert told.startswith(CANCELLED)
        again = await cancel(s, completion)  # it waits no more
        assert (again.status_code, again.json()["error"]["code"]) == (404, "completion_not_found")
        key = running.session_key
        assert [r.message_id for r in await s.hub.store.pending(key)] == [running.messages[0].id]
        await s.ask("/stop", "cancelled")
        assert await first == STOPPED_TEXT


async def test_a_running_request_is_not_cancelled(tmp_path: Path) -> None:
    async with serve(make_config(tmp_path)) as s:
        stream = await s.client.chat.completions.create(
            model="chatlane",
            messages=[{"role": "user", "content": "stream 50"}],
            user="runs",
            stream=True,
        )
        chunks = aiter(stream)
        completion = (await anext(chunks)).id
        await s.running("runs")
        answer = await cancel(s, completion)
        assert (answer.status_code, answer.json()["error"]["code"]) == (409, "completion_running")
        unknown = await cancel(s, "chatcmpl-nothing-here")
        assert unknown.status_code == 404
        await stream.close()


@pytest.mark.parametrize("value", ["later", "now", ""])
async def test_an_unknown_busy_header_is_a_400_naming_the_choices(
    tmp_path: Path, value: str
) -> None:
    async with serve(make_config(tmp_path)) as s:
        with pytest.raises(openai.BadRequestError, match="X-Chatlane-Busy header must be one of"):
            await s.ask("hello", "bad", extra_headers={"X-Chatlane-Busy": value})


async def test_a_full_queue_answers_429(tmp_path: Path) -> None:
    async with serve(make_config(tmp_path, queue_cap=1)) as s:
        first = asyncio.create_task(s.ask("sleep 1", "full"))
        await s.running("full")
        second = asyncio.create_task(s.ask("second", "full"))
        await eventually(lambda: s.queued("full", 1))
        with pytest.raises(openai.RateLimitError) as caught:
            await s.ask("third", "full")
        assert caught.value.code == "queue_full"
        with pytest.raises(openai.RateLimitError) as caught:
            await s.ask("/queue fourth", "full")  # /queue over the cap is refused the same way
        assert caught.value.code == "queue_full"
        assert (await first, await second) == ("slept 1", "echo: second")


async def test_queue_waits_for_its_turn(tmp_path: Path) -> None:
    async with serve(make_config(tmp_path)) as s:
        first = asyncio.create_task(s.ask("sleep 1", "q"))
        await s.running("q")
        second = await s.ask_streaming("after", "q")
        assert first.done()
        assert await first == "slept 1"
        assert "".join(second) == "echo: after"


async def test_a_slash_command_is_answered_by_its_reply(tmp_path: Path) -> None:
    async with serve(make_config(tmp_path)) as s:
        status = await s.ask("/status", "cmd")
        assert status.startswith("Status: idle")
        assert "busy policy: queue" in status
        streamed = "".join(await s.ask_streaming("/busy reject", "cmd"))
        assert "reject" in streamed
        assert "busy policy: reject (session)" in await s.ask("/status", "cmd")


async def test_interrupted_request_is_answered_with_a_notice(tmp_path: Path) -> None:
    async with serve(make_config(tmp_path, busy="interrupt")) as s:
        first = asyncio.create_task(s.ask_streaming("sleep 20", "i"))
        await s.running("i")
        assert await s.ask("hello", "i") == "echo: hello"
        assert "".join(await first) == INTERRUPTED_TEXT


async def test_stop_answers_the_stopped_and_the_dropped_requests(tmp_path: Path) -> None:
    async with serve(make_config(tmp_path)) as s:
        running = asyncio.create_task(s.ask("sleep 20", "st"))
        await s.running("st")
        queued = asyncio.create_task(s.ask_streaming("never", "st"))
        await eventually(lambda: s.queued("st", 1))
        reply = await s.ask("/stop", "st")
        assert reply == "Stopped the running turn. Dropped 1 queued message."
        assert await running == STOPPED_TEXT
        assert "".join(await queued) == NOT_RUN_TEXT


async def test_a_failing_agent_answers_with_its_notice(tmp_path: Path) -> None:
    async def failing(turn: Turn) -> str:
        raise RuntimeError("boom")

    async with serve(make_config(tmp_path), agent=failing) as s:
        answer = await s.ask("hi", "f")
        assert answer.startswith("Sorry — the agent failed")
        assert "".join(await s.ask_streaming("hi", "f")).startswith("Sorry — the agent failed")


async def test_no_progress_answers_504_which_the_sdk_does_not_send_again(tmp_path: Path) -> None:
    """The SDK's own retry carries no key: sent again, the message would run twice."""
    async with (
        serve(make_config(tmp_path), wait_timeout=0.5) as s,
        AsyncOpenAI(base_url=s.base_url, api_key=TOKEN, max_retries=2) as retrying,
    ):
        with pytest.raises(openai.APIStatusError) as caught:
            await retrying.chat.completions.create(
                model="chatlane",
                messages=[{"role": "user", "content": "approve rm -rf /tmp/x"}],
                user="slow",
            )
        assert caught.value.status_code == 504
        assert caught.value.response.headers["x-should-retry"] == "false"
        assert "queued: 0" in await s.ask("/status", "slow")  # no retry waits behind it
        assert "Denied" in await s.ask("/deny", "slow")


async def test_missing_session_is_400(tmp_path: Path) -> None:
    async with serve(make_config(tmp_path)) as s:
        with pytest.raises(openai.BadRequestError) as caught:
            await s.client.chat.completions.create(
                model="chatlane", messages=[{"role": "user", "content": "hi"}]
            )
        assert "X-Chatlane-Session" in caught.value.message


async def test_bad_token_is_401(tmp_path: Path) -> None:
    async with serve(make_config(tmp_path)) as s:
        async with AsyncOpenAI(base_url=s.base_url, api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                await bad.chat.completions.create(
                    model="chatlane", messages=[{"role": "user", "content": "hi"}], user="x"
                )
            with pytest.raises(openai.AuthenticationError):
                await bad.models.list()
        async with httpx.AsyncClient() as http:
            response = await http.get(f"{s.base_url}/models")
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"


async def test_allowlist_refusal_is_403(tmp_path: Path) -> None:
    config = make_config(tmp_path, allow={"api": ["alice"]})
    async with serve(config) as s:
        with pytest.raises(openai.PermissionDeniedError):
            await s.ask("hello", "mallory")
        assert await s.ask("hello", "alice") == "echo: hello"
        assert s.adapter.waiting == 0


async def test_models_lists_chatlane(tmp_path: Path) -> None:
    async with serve(make_config(tmp_path)) as s:
        models = await s.client.models.list()
        assert [m.id for m in models.data] == ["chatlane"]
        assert (await s.client.models.retrieve("chatlane")).id == "chatlane"
        with pytest.raises(openai.NotFoundError) as missing:
            await s.client.models.retrieve("gpt-none")
        assert missing.value.code == "model_not_found"
        assert missing.value.param == "model"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_model_the_gateway_does_not_list_is_404_as_openai_answers(
    tmp_path: Path, stream: bool
) -> None:
    async with serve(make_config(tmp_path)) as s:
        with pytest.raises(openai.NotFoundError) as missing:
            await s.client.chat.completions.create(
                model="gpt-none",
                messages=[{"role": "user", "content": "hello"}],
                user="alice",
                stream=stream,
            )
        assert missing.value.code == "model_not_found"
        assert missing.value.param == "model"
        assert missing.value.type == "invalid_request_error"
        assert "'gpt-none' does not exist here: this gateway serves 'chatlane'" in (
            missing.value.message
        )
        assert s.adapter.waiting == 0
        assert await s.ask("/status", "alice") == await s.ask("/status", "fresh"), "nothing ran"


async def test_the_openai_agents_model_is_served_too(tmp_path: Path) -> None:
    config = make_config(tmp_path, agent=AgentConfig(name="openai"))
    async with serve(config) as s:
        assert [m.id for m in (await s.client.models.list()).data] == ["chatlane", "gpt-4o-mini"]
        reply = await s.client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "/status"}], user="a"
        )
        assert reply.model == "gpt-4o-mini"
        assert "Status: idle" in (reply.choices[0].message.content or "")


async def test_api_models_names_more_models(tmp_path: Path) -> None:
    config = make_config(tmp_path, api=ApiConfig(models=["gpt-4o", "chatlane", " "]))
    async with serve(config) as s:
        assert [m.id for m in (await s.client.models.list()).data] == ["chatlane", "gpt-4o"]
        reply = await s.client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}], user="a"
        )
        assert (reply.model, reply.choices[0].message.content) == ("gpt-4o", "echo: hi")
        with pytest.raises(openai.NotFoundError):
            await s.client.models.retrieve("gpt-4")


async def test_a_bad_field_is_named_in_param_to_the_sdk(tmp_path: Path) -> None:
    async with serve(make_config(tmp_path)) as s:
        messages: list[Any] = [
            {"role": "system", "content": "be brief"},
            {"role": "assistant", "content": "hi"},
            {"role": "user", "content": [{"type": "text", "text": 5}]},
        ]
        with pytest.raises(openai.BadRequestError) as bad:
            await s.client.chat.completions.create(
                model="chatlane", messages=messages, user="alice"
            )
        assert bad.value.param == "messages[2].content[0].text"
        assert bad.value.code == "invalid_request"


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("GET", "/chat/completions", 405, "method_not_allowed"),
        ("POST", "/models", 405, "method_not_allowed"),
        ("DELETE", "/models/chatlane", 405, "method_not_allowed"),
        ("GET", "/embeddings", 404, "not_found"),
        ("POST", "/nowhere/at/all", 404, "not_found"),
    ],
)
async def test_other_v1_requests_get_openai_shaped_errors(
    tmp_path: Path, method: str, path: str, status: int, code: str
) -> None:
    async with serve(make_config(tmp_path)) as s, httpx.AsyncClient() as http:
        url = f"{s.base_url}{path}"
        assert (await http.request(method, url)).status_code == 401  # the token comes first
        response = await http.request(method, url, headers={"Authorization": f"Bearer {TOKEN}"})
        assert response.status_code == status
        assert response.json()["error"]["code"] == code
        if status == 405:
            assert response.headers["Allow"] in ("GET", "POST")


async def test_an_empty_model_name_means_the_default(tmp_path: Path) -> None:
    async with serve(make_config(tmp_path)) as s, httpx.AsyncClient() as http:
        body = {"user": "u", "model": " ", "messages": [{"role": "user", "content": "hi"}]}
        headers = {"Authorization": f"Bearer {TOKEN}"}
        response = await http.post(f"{s.base_url}/chat/completions", json=body, headers=headers)
        assert response.status_code == 200
        assert response.json()["model"] == "chatlane"


BAD_BODIES = [
    (b"{not json", "not valid JSON", None),
    (b"\xff\xfe", "not valid JSON", None),
    (b"[1, 2]", "JSON object", None),
    (b'{"user": "u", "messages": "hi"}', "non-empty list", "messages"),
    (b'{"user": "u", "messages": []}', "non-empty list", "messages"),
    (b'{"user": "u", "messages": [1]}', "messages[0] must be an object", "messages[0]"),
    (b'{"user": "u", "messages": [{"role": "system", "content": "x"}]}', "role 'user'", "messages"),
    (
        b'{"user": "u", "messages": [{"role": "user", "content": 5}]}',
        "string or a list",
        "messages[0].content",
    ),
    (
        b'{"user": "u", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},'
        b" 3]}]}",
        "messages[0].content must hold objects",
        "messages[0].content[1]",
    ),
    (
        b'{"user": "u", "messages": [{"role": "user", "content": [{"type": "text"}]}]}',
        "'text'",
        "messages[0].content[0].text",
    ),
    (
        b'{"user": "u", "messages": [{"role": "user", "content": "  "}]}',
        "has no text",
        "messages[0].content",
    ),
    (
        b'{"user": "u", "stream": "yes", "messages": [{"role": "user", "content": "x"}]}',
        "stream",
        "stream",
    ),
    (b'{"user": 7, "messages": [{"role": "user", "content": "x"}]}', "'user' must be", "user"),
    (b'{"messages": [{"role": "user", "content": "x"}]}', "name the session", "user"),
    (
        b'{"user": "u", "model": 1, "messages": [{"role": "user", "content": "x"}]}',
        "'model'",
        "model",
    ),
    (
        b'{"user": "u", "model": 0, "messages": [{"role": "user", "content": "x"}]}',
        "'model'",
        "model",
    ),
    (
        b'{"user": "u", "model": false, "messages": [{"role": "user", "content": "x"}]}',
        "'model'",
        "model",
    ),
    (
        b'{"user": "u", "model": [], "messages": [{"role": "user", "content": "x"}]}',
        "'model'",
        "model",
    ),
    (
        b'{"user": "u", "model": {}, "messages": [{"role": "user", "content": "x"}]}',
        "'model'",
        "model",
    ),
    (
        b'{"user": "u", "messages": [{"role": "user", "content": "\\ud800"}]}',
        "Unicode",
        "messages[0].content",
    ),
    (
        b'{"user": "' + b"u" * 300 + b'", "messages": [{"role": "user", "content": "x"}]}',
        "256",
        "user",
    ),
    (b"[" * 200_000 + b"]" * 200_000, "nested too deeply", None),
]


@pytest.mark.parametrize(("body", "expected", "param"), BAD_BODIES)
async def test_malformed_requests_get_400_naming_the_field(
    tmp_path: Path, body: bytes, expected: str, param: str | None
) -> None:
    async with serve(make_config(tmp_path)) as s, httpx.AsyncClient() as http:
        response = await http.post(
            f"{s.base_url}/chat/completions",
            content=body,
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        )
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert expected in error["message"]
        assert error["param"] == param
        assert s.adapter.waiting == 0


async def test_oversized_body_is_413(tmp_path: Path) -> None:
    text = "x" * (1 << 20)
    body = json.dumps({"user": "u", "messages": [{"role": "user", "content": text}]})
    async with serve(make_config(tmp_path)) as s, httpx.AsyncClient() as http:
        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
        response = await http.post(f"{s.base_url}/chat/completions", content=body, headers=headers)
        assert response.status_code == 413

        async def chunked() -> AsyncIterator[bytes]:
            for _ in range(5):
                yield b"x" * (300 * 1024)

        response = await http.post(
            f"{s.base_url}/chat/completions", content=chunked(), headers=headers
        )
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize(
    "text",
    ["héllo wörld", "👋🏽 emoji", "مرحبا", "zero\u200bwidth", "nul\x00byte", "tab\tand\nline"],
)
async def test_odd_unicode_round_trips(tmp_path: Path, text: str) -> None:
    async with serve(make_config(tmp_path)) as s:
        assert await s.ask(text, "ünïcødé 👤") == f"echo: {text}"
        assert "".join(await s.ask_streaming(text, "ünïcødé 👤")) == f"echo: {text}"


async def test_a_disconnected_stream_stops_waiting(tmp_path: Path) -> None:
    async with serve(make_config(tmp_path)) as s:
        stream = await s.client.chat.completions.create(
            model="chatlane",
            messages=[{"role": "user", "content": "sleep 2"}],
            user="gone",
            stream=True,
        )
        await s.running("gone")
        assert s.adapter.waiting == 1
        await stream.close()
        await eventually(lambda: s.adapter.waiting == 0)
        assert await s.ask("hello", "gone") == "echo: hello"


async def test_a_disconnected_plain_request_stops_waiting(tmp_path: Path) -> None:
    async with serve(make_config(tmp_path)) as s:
        async with AsyncOpenAI(
            base_url=s.base_url, api_key=TOKEN, max_retries=0, timeout=0.5
        ) as impatient:
            with pytest.raises(openai.APITimeoutError):
                await impatient.chat.completions.create(
                    model="chatlane", messages=[{"role": "user", "content": "sleep 2"}], user="d"
                )
        await eventually(lambda: s.adapter.waiting == 0)
        assert s.hub.gateway.engine.running_turn(chat_key("d", "api")) is not None


async def test_collected_requests_share_the_merged_reply(tmp_path: Path) -> None:
    async with serve(make_config(tmp_path, busy="collect")) as s:
        first = asyncio.create_task(s.ask("sleep 1", "m"))
        await s.running("m")
        merged = await asyncio.gather(s.ask("a", "m"), s.ask_streaming("b", "m"))
        assert await first == "slept 1"
        assert merged[0] == "".join(merged[1])
        assert merged[0] in ("echo: a\nb", "echo: b\na")


async def test_a_steered_request_is_answered_by_a_later_turn(tmp_path: Path) -> None:
    async with serve(make_config(tmp_path, busy="steer")) as s:
        first = asyncio.create_task(s.ask("sleep 1", "st"))
        await s.running("st")
        assert await s.ask("after", "st") == "echo: after"
        assert await first == "slept 1"


async def test_no_token_configured_means_no_auth(tmp_path: Path) -> None:
    config = Config(server=ServerConfig(token=Secret(env="CHATLANE_TEST_UNSET_TOKEN")))
    async with serve(config, secrets=Secrets()) as s:
        async with httpx.AsyncClient() as http:
            response = await http.post(
                f"{s.base_url}/chat/completions",
                json={"user": "u", "messages": [{"role": "user", "content": "hi"}]},
            )
        assert response.json()["choices"][0]["message"]["content"] == "echo: hi"


NEW_CONFIRM = b'{"user": "alice", "messages": [{"role": "user", "content": "/new confirm"}]}'


def no_token_config() -> Config:
    return Config(server=ServerConfig(token=Secret(env="CHATLANE_TEST_UNSET_TOKEN")))


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "application/jsonp"]
)
async def test_a_body_not_sent_as_json_is_415(tmp_path: Path, content_type: str | None) -> None:
    async with serve(no_token_config(), secrets=Secrets()) as s, httpx.AsyncClient() as http:
        before = await s.generation("alice")
        headers = {} if content_type is None else {"Content-Type": content_type}
        response = await http.post(
            f"{s.base_url}/chat/completions", content=NEW_CONFIRM, headers=headers
        )
        assert response.status_code == 415
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "unsupported_media_type")
        assert await s.generation("alice") == before  # /new confirm never ran


@pytest.mark.parametrize(
    "origin",
    ["https://evil.example", "null", "http://localhost:{port}", "https://127.0.0.1:{port}"],
)
async def test_a_foreign_origin_is_403(tmp_path: Path, origin: str) -> None:
    async with serve(no_token_config(), secrets=Secrets()) as s, httpx.AsyncClient() as http:
        before = await s.generation("alice")
        headers = {"Content-Type": "application/json", "Origin": origin.format(port=s.port)}
        url = f"{s.base_url}/chat/completions"
        response = await http.post(url, content=NEW_CONFIRM, headers=headers)
        assert response.status_code == 403
        assert response.json()["error"]["code"] == "foreign_origin"
        response = await http.get(f"{s.base_url}/models", headers={"Origin": headers["Origin"]})
        assert response.status_code == 403
        for path in ("/nosuch", "/chat/completions"):  # no route, and no such method: still 403
            response = await http.get(f"{s.base_url}{path}", headers={"Origin": headers["Origin"]})
            assert (response.status_code, response.json()["error"]["code"]) == (
                403,
                "foreign_origin",
            )
        assert await s.generation("alice") == before
        assert s.adapter.waiting == 0


async def test_the_gateways_own_origin_and_a_json_charset_are_accepted(tmp_path: Path) -> None:
    async with serve(no_token_config(), secrets=Secrets()) as s, httpx.AsyncClient() as http:
        before = await s.generation("alice")
        headers = {
            "Content-Type": "Application/JSON; charset=utf-8",
            "Origin": f"http://127.0.0.1:{s.port}",
        }
        url = f"{s.base_url}/chat/completions"
        response = await http.post(url, content=NEW_CONFIRM, headers=headers)
        assert response.status_code == 200
        assert await s.generation("alice") == before + 1
        assert await s.ask("hello", "sdk") == "echo: hello"  # the openai SDK sends no Origin


@pytest.mark.parametrize(
    ("origin", "host", "scheme", "allowed"),
    [
        ("http://example.com", "example.com", "http", True),
        ("http://example.com:80", "example.com", "http", True),
        ("https://EXAMPLE.com", "example.com:443", "https", True),
        ("http://[::1]:8080", "[::1]:8080", "http", True),
        ("https://example.com", "example.com", "http", False),
        ("http://example.com:8080", "example.com", "http", False),
        ("http://example.com:99999", "example.com:99999", "http", False),
        ("http://example.com", "", "http", False),
        ("file://", "example.com", "http", False),
    ],
)
def test_check_origin_compares_scheme_host_and_port(
    origin: str, host: str, scheme: str, allowed: bool
) -> None:
    headers = [(b"origin", origin.encode()), (b"host", host.encode())]
    request = Request({"type": "http", "scheme": scheme, "path": "/", "headers": headers})
    if allowed:
        check_origin(request)
    else:
        with pytest.raises(ApiRequestError) as caught:
            check_origin(request)
        assert caught.value.status == 403


@pytest.mark.parametrize("text", ["echo: hi", 'quote " and \\ slash', "ünï\ncødé 👋", "\ud800", ""])
def test_chunk_events_are_the_chunks_json_encodes(text: str) -> None:
    chunks = ChunkEvents("chatcmpl-1", 'model "ü"')
    created = json.loads(chunks.content("")[6:])["created"]

    def expected(delta: dict[str, str], finish_reason: str | None = None) -> bytes:
        value = chunk("chatcmpl-1", 'model "ü"', delta, finish_reason)
        return sse_data({**value, "created": created})

    assert chunks.content(text) == expected({"content": text})
    assert chunks.delta({"role": "assistant", "content": ""}) == expected(
        {"role": "assistant", "content": ""}
    )
    assert chunks.delta({}, "stop") == expected({}, "stop")


async def test_a_quiet_stream_is_kept_alive_with_comments(tmp_path: Path) -> None:
    async with (
        serve(make_config(tmp_path), keepalive=0.1, tick=0.02) as s,
        httpx.AsyncClient(timeout=10) as http,
    ):
        body = {"user": "k", "stream": True, "messages": [{"role": "user", "content": "sleep 1"}]}
        headers = {"Authorization": f"Bearer {TOKEN}"}
        url = f"{s.base_url}/chat/completions"
        async with http.stream("POST", url, json=body, headers=headers) as response:
            text = (await response.aread()).decode()
        assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
        assert text.count(": waiting for the turn\n\n") >= 3
        assert '"content": "slept 1"' in text
        assert text.endswith("data: [DONE]\n\n")
        assert s.adapter.waiting == 0


async def eventually(predicate: Callable[[], bool | Awaitable[bool]]) -> None:
    async with asyncio.timeout(10):
        while True:
            result = predicate()
            if result if isinstance(result, bool) else await result:
                return
            await asyncio.sleep(0.02)
