"""Idempotency keys and stored completions, through the real ``openai`` client.

A retry with the same ``Idempotency-Key`` gets the same completion and never
runs the agent a second time — sent again later, sent while the first request
still waits, or sent to another gateway process sharing the store. A
completion is named before its answer (a header, a stream's first event) and
can be fetched by its id from any process, by its own client only.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessageParam

from chatlane.adapters.api_ids import completion_id, keyed_message_id, message_of, new_message_id
from chatlane.agents.demo import DemoAgent
from chatlane.identity import ChatType, SessionSource, build_session_key
from chatlane.runtime import pending
from chatlane.runtime.engine import CANCELLED
from chatlane.runtime.turn import Turn
from chatlane.stores import WriteBatch, open_store
from chatlane.testing import GatewayHarness
from chatlane.types import InboundMessage
from tests.adapters.test_api import TOKEN, Served, eventually, make_config, serve
from tests.adapters.test_limits import clients_config

HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
API_ALICE = SessionSource("api", chat_id="alice", user_id="alice", chat_type=ChatType.DM)


class CountingAgent:
    """Answers ``run <n>: <text>``, counting its runs; holds each run until ``release`` is set."""

    def __init__(self, *, held: bool = False) -> None:
        self.runs = 0
        self.release = asyncio.Event()
        if not held:
            self.release.set()

    async def __call__(self, turn: Turn) -> str:
        self.runs += 1
        await self.release.wait()
        return f"run {self.runs}: {turn.text}"


async def ask(s: Served, key: str, session: str = "alice") -> ChatCompletion:
    return await s.client.chat.completions.create(
        model="chatlane", messages=HELLO, user=session, extra_headers={"Idempotency-Key": key}
    )


def same_completion(one: ChatCompletion, other: ChatCompletion) -> bool:
    """Whether two responses hold one completion: all but ``created``, each response's
    own second (docs/api.md), which two responses may straddle."""
    return one.model_dump(exclude={"created"}) == other.model_dump(exclude={"created"})


async def ask_streaming(s: Served, key: str) -> list[ChatCompletionChunk]:
    stream = await s.client.chat.completions.create(
        model="chatlane",
        messages=HELLO,
        user="alice",
        stream=True,
        extra_headers={"Idempotency-Key": key},
    )
    async with stream:
        return [event async for event in stream]


async def test_a_retry_gets_the_same_completion_without_a_second_run(tmp_path: Path) -> None:
    agent = CountingAgent()
    async with serve(make_config(tmp_path), agent) as s:
        first = await ask(s, "order-42")
        again = await ask(s, "order-42")
        other = await ask(s, "order-43")
    assert same_completion(again, first)  # same id, same answer, not run again
    assert first.choices[0].message.content == "run 1: hello"
    assert other.choices[0].message.content == "run 2: hello"
    assert other.id != first.id
    assert agent.runs == 2


async def test_retries_sent_while_the_first_waits_share_its_turn(tmp_path: Path) -> None:
    agent = CountingAgent(held=True)
    async with serve(make_config(tmp_path), agent) as s:
        first = asyncio.create_task(ask(s, "k"))
        await eventually(lambda: agent.runs == 1)
        plain_retry = asyncio.create_task(ask(s, "k"))
        streamed_retry = asyncio.create_task(ask_streaming(s, "k"))
        await eventually(lambda: s.adapter.waiting == 3)
        agent.release.set()
        answer, plain, streamed = await asyncio.gather(first, plain_retry, streamed_retry)
        assert s.adapter.waiting == 0
    assert same_completion(plain, answer)
    text = "".join(e.choices[0].delta.content or "" for e in streamed)
    assert text == "run 1: hello"
    assert {e.id for e in streamed} == {answer.id}
    assert agent.runs == 1


async def test_a_streaming_retry_beside_a_whole_reply_request_gets_the_answer_at_the_end(
    tmp_path: Path,
) -> None:
    """The first request asked for its reply whole, so its turn sends no chunk out: the
    streaming retry beside it gets the whole answer as one chunk, as from a plain agent."""
    release = asyncio.Event()
    runs: list[str] = []

    async def agent(turn: Turn) -> AsyncIterator[str]:
        runs.append(turn.text)
        await release.wait()
        for word in ("run ", "1: ", turn.text):
            yield word

    async with serve(make_config(tmp_path), agent) as s:
        first = asyncio.create_task(ask(s, "k"))
        await eventually(lambda: len(runs) == 1)
        streamed_retry = asyncio.create_task(ask_streaming(s, "k"))
        await eventually(lambda: s.adapter.waiting == 2)
        release.set()
        answer, streamed = await asyncio.gather(first, streamed_retry)
    assert answer.choices[0].message.content == "run 1: hello"
    contents = [e.choices[0].delta.content for e in streamed if e.choices[0].delta.content]
    assert contents == ["run 1: hello"]
    assert runs == ["hello"]


async def test_retries_whose_first_request_left_wait_once_in_the_queue(tmp_path: Path) -> None:
    """Each retry comes after the request before it gave up (its client gone): the message
    is queued once, however many times it is sent, and runs once."""
    agent = CountingAgent(held=True)
    async with serve(make_config(tmp_path), agent) as s:
        blocking = asyncio.create_task(s.ask("block", "alice"))
        await eventually(lambda: agent.runs == 1)
        for _ in range(3):
            gave_up = asyncio.create_task(ask(s, "pay-once"))
            await eventually(lambda: s.adapter.waiting == 2)
            gave_up.cancel()
            await eventually(lambda: s.adapter.waiting == 1)  # the server saw it go
        state = s.hub.gateway.engine.registry.get(build_session_key(API_ALICE))
        assert pending.pending_count(state) == 1
        last = asyncio.create_task(ask(s, "pay-once"))
        await eventually(lambda: s.adapter.waiting == 2)
        agent.release.set()
        answer = await last
        await blocking
    assert answer.choices[0].message.content == "run 2: hello"
    assert agent.runs == 2


async def test_a_retried_command_gets_its_first_reply_without_running_again(
    tmp_path: Path,
) -> None:
    """A ``/stop`` retried under its key must not stop the turn that started since."""
    agent = CountingAgent(held=True)
    stop: list[ChatCompletionMessageParam] = [{"role": "user", "content": "/stop"}]
    async with serve(make_config(tmp_path), agent) as s:

        async def ask_stop() -> ChatCompletion:
            return await s.client.chat.completions.create(
                model="chatlane",
                messages=stop,
                user="alice",
                extra_headers={"Idempotency-Key": "s1"},
            )

        first = await ask_stop()
        working = asyncio.create_task(s.ask("work", "alice"))
        await eventually(lambda: agent.runs == 1)
        again = await ask_stop()
        agent.release.set()
        answer = await working
    assert same_completion(again, first)
    assert answer == "run 1: work"  # not stopped


async def test_a_retry_of_a_cancelled_request_is_cancelled_too(tmp_path: Path) -> None:
    """One key names one message: cancelled, it stays cancelled, however it is sent again."""
    agent = CountingAgent(held=True)
    async with serve(make_config(tmp_path), agent) as s:
        blocking = asyncio.create_task(s.ask("block", "alice"))
        await eventually(lambda: agent.runs == 1)
        waiting = asyncio.create_task(ask(s, "k1"))
        await eventually(lambda: s.adapter.waiting == 2)
        key = build_session_key(API_ALICE)
        [(_, queued)] = pending.queued(s.hub.gateway.engine.registry.get(key))
        async with httpx.AsyncClient(base_url=s.base_url) as http:
            path = f"/chat/completions/{completion_id(queued.id)}/cancel"
            headers = {"Authorization": f"Bearer {TOKEN}"}
            assert (await http.post(path, headers=headers)).status_code == 200
        cancelled = await waiting
        again = await ask(s, "k1")
        agent.release.set()
        await blocking
    assert again.choices[0].message.content == CANCELLED
    assert (cancelled.choices[0].message.content or "").startswith(CANCELLED)
    assert agent.runs == 1  # "k1" never ran


async def test_a_key_is_one_clients_for_one_session(tmp_path: Path) -> None:
    agent = CountingAgent()
    async with serve(make_config(tmp_path), agent) as s:
        alice = await ask(s, "k", session="alice")
        bob = await ask(s, "k", session="bob")
    assert alice.id != bob.id
    assert agent.runs == 2
    assert keyed_message_id("alice", "s", "k") != keyed_message_id("bob", "s", "k")
    assert keyed_message_id("", "s", "k") == keyed_message_id("", "s", "k")


@pytest.mark.parametrize("key", ["has space", "tab\tinside", "x" * 256, "naïve"])
async def test_a_malformed_key_is_a_400(tmp_path: Path, key: str) -> None:
    async with serve(make_config(tmp_path)) as s, httpx.AsyncClient() as http:
        response = await http.post(
            f"{s.base_url}/chat/completions",
            json={"messages": HELLO, "user": "alice"},
            headers=[
                (b"Authorization", f"Bearer {TOKEN}".encode()),
                (b"Idempotency-Key", key.encode()),
            ],
        )
    assert response.status_code == 400
    assert "Idempotency-Key" in response.json()["error"]["message"]


async def test_the_completion_id_comes_in_a_header_and_the_first_event(tmp_path: Path) -> None:
    async with serve(make_config(tmp_path)) as s:
        raw = await s.client.chat.completions.with_raw_response.create(
            model="chatlane", messages=HELLO, user="alice"
        )
        assert raw.headers["x-chatlane-completion-id"] == raw.parse().id
        async with s.client.chat.completions.with_streaming_response.create(
            model="chatlane", messages=HELLO, user="alice", stream=True
        ) as streamed:
            named = streamed.headers["x-chatlane-completion-id"]
            events = [event async for event in await streamed.parse()]
    assert events[0].id == named
    assert named.startswith("chatcmpl-")


async def test_a_stored_completion_is_fetched_by_its_id(tmp_path: Path) -> None:
    async with serve(make_config(tmp_path)) as s:
        made = await s.client.chat.completions.create(
            model="chatlane", messages=HELLO, user="alice"
        )
        fetched = await s.client.chat.completions.retrieve(made.id)
        assert fetched.id == made.id
        assert fetched.object == "chat.completion"
        assert fetched.choices[0].message.content == "echo: hello"
        unknown = made.id[:-4] + ("0000" if not made.id.endswith("0000") else "1111")
        for missing in (unknown, "chatcmpl-nothing", "not-an-id", "chatcmpl-"):
            with pytest.raises(openai.NotFoundError) as caught:
                await s.client.chat.completions.retrieve(missing)
            assert caught.value.code == "completion_not_found"


async def test_only_its_own_client_may_fetch_a_completion(tmp_path: Path) -> None:
    async with serve(clients_config(tmp_path)) as s:
        alice = s.client.with_options(api_key="alice-token")
        bob = s.client.with_options(api_key="bob-token")
        made = await alice.chat.completions.create(model="chatlane", messages=HELLO, user="alice:x")
        assert (await alice.chat.completions.retrieve(made.id)).id == made.id
        with pytest.raises(openai.NotFoundError):
            await bob.chat.completions.retrieve(made.id)
        with pytest.raises(openai.AuthenticationError):
            await s.client.with_options(api_key="nobody").chat.completions.retrieve(made.id)
    assert message_of(made.id, "alice") is not None
    assert message_of(made.id, "bob") is None
    assert message_of(new_message_id("bob").replace("api-", "chatcmpl-"), "alice") is None


def test_a_fresh_message_id_sorts_after_those_made_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its moment comes first: a store's index of message ids grows at its end."""
    made = []
    for moment_ms in (1_700_000_000_000, 1_700_000_000_000, 1_700_000_000_001, 2**47):
        monkeypatch.setattr("time.time_ns", lambda ms=moment_ms: ms * 1_000_000 + 999_999)
        made.append(new_message_id("alice"))
    assert made[1] != made[0]  # the same moment: the random bits tell them apart
    assert made[2] > max(made[:2])
    assert made[3] > made[2]
    owner, rest = made[2].removeprefix("api-").split("-")
    assert (len(owner), len(rest)) == (12, 36)
    assert rest.startswith(f"{1_700_000_000_001:012x}")
    assert all(c in "0123456789abcdef" for c in rest)
    assert message_of(made[2].replace("api-", "chatcmpl-"), "alice") == made[2]


async def test_a_request_that_timed_out_is_fetched_once_answered(tmp_path: Path) -> None:
    agent = CountingAgent(held=True)
    async with serve(make_config(tmp_path), agent, wait_timeout=0.2, tick=0.05) as s:
        with pytest.raises(openai.InternalServerError) as caught:
            await s.client.chat.completions.create(model="chatlane", messages=HELLO, user="alice")
        assert caught.value.status_code == 504
        named = caught.value.response.headers["x-chatlane-completion-id"]
        with pytest.raises(openai.NotFoundError):
            await s.client.chat.completions.retrieve(named)  # not answered yet
        agent.release.set()
        await eventually(lambda: s.hub.gateway.engine.is_idle())
        fetched = await s.client.chat.completions.retrieve(named)
    assert fetched.choices[0].message.content == "run 1: hello"


async def test_another_process_serves_the_retry_and_the_stored_completion(
    tmp_path: Path,
) -> None:
    store = f"sqlite:///{tmp_path / 'shared.db'}"
    first, second = CountingAgent(), CountingAgent()
    async with (
        serve(make_config(tmp_path), first, store=store) as a,
        serve(make_config(tmp_path), second, store=store) as b,
    ):
        made = await ask(a, "shared-key")
        retried = await ask(b, "shared-key")
        fetched = await b.client.chat.completions.retrieve(made.id)
    assert same_completion(retried, made)
    assert fetched.choices[0].message.content == "run 1: hello"
    assert (first.runs, second.runs) == (1, 0)


async def test_a_turn_replays_an_answer_committed_before_it_took_the_lease() -> None:
    """The race a retry can lose: answered elsewhere after the adapter asked, before it ran."""
    agent = CountingAgent()
    store = await open_store("memory://")
    async with GatewayHarness(agent, store=store) as h:
        source = SessionSource("test", chat_id="c", user_id="u1")
        message = InboundMessage(source, "hello", id="api-x-1", idempotent=True)
        key = h.gateway.session_key(message)
        await store.commit(key, None, WriteBatch(answered=[message.id], answer="from before"))
        await h.gateway.dispatch(message)
        assert await h.replies(chat_id="c", count=1) == ["from before"]
        assert await store.pending(key) == []
    assert agent.runs == 0


async def test_without_a_key_the_same_text_runs_again(tmp_path: Path) -> None:
    async with serve(make_config(tmp_path), DemoAgent()) as s:
        one = await s.client.chat.completions.create(model="chatlane", messages=HELLO, user="alice")
        two = await s.client.chat.completions.create(model="chatlane", messages=HELLO, user="alice")
    assert one.id != two.id
