"""The Slack adapter end to end: signed requests to the gateway's real HTTP routes, slack-sdk
talking to a local Web API stand-in, a real hub with the demo agent behind it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import uvicorn
from starlette.responses import Response

from chatlane.adapters import slack, slack_events
from chatlane.adapters.slack import REFUSAL_INTERVAL, SlackAdapter
from chatlane.adapters.slack_delivery import classify
from chatlane.adapters.slack_format import MESSAGE_LIMIT, to_mrkdwn
from chatlane.adapters.slack_wire import message_id
from chatlane.adapters.splitting import EMPTY_REPLY
from chatlane.adapters.waits import SEND_ROOM
from chatlane.approvals import HOW_TO_ANSWER, UNBREAKABLE_BACKTICK, markdown_prompt
from chatlane.config import AgentConfig, Config, Secret, SlackConfig, StoreConfig
from chatlane.delivery import Attempt, DeliverySettings
from chatlane.delivery.ledger import RESENT_LABEL
from chatlane.errors import (
    ConfigError,
    PermanentDelivery,
    PlatformUnavailable,
    RateLimited,
    StoreError,
    TransientDelivery,
)
from chatlane.gateway import DispatchResult
from chatlane.hub import Hub, build_app, open_hub, shutdown
from chatlane.identity import ChatType, SessionSource, build_session_key
from chatlane.stores.base import DEAD, DELIVERED
from chatlane.types import Asks, InboundMessage, Outbound, OutboundKind, SessionKey, Target
from tests.adapters.blank_agent import AGENT as BLANK_AGENT
from tests.adapters.slackapi import (
    BOT_ID,
    BOT_USER,
    Message,
    SlackApi,
    SlackRequests,
    message_event,
)
from tests.adapters.test_api import eventually as eventually_true
from tests.clock import Clock
from tests.delivery.waits import dead, delivered, eventually
from tests.keys import chat_key
from tests.ports import free_port
from tests.serving import serve_once

SIGNING_SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
ALICE, BOB, CAROL = "UALICE01", "UBOB0001", "UCAROL01"
ALICE_DM, BOB_DM = "DALICE01", "DBOB0001"
GENERAL, RANDOM = "CGENERAL", "CRANDOM1"
MENTION = f"<@{BOT_USER}>"
NOT_ALLOWED = "Sorry, you are not allowed to use this assistant."
WAIT = 20.0
QUICK_DELIVERY = DeliverySettings(
    poll_interval=0.05, first_retry=0.05, max_retry=0.2, unavailable_first=0.05, unavailable_max=0.2
)
"""The delivery ledger's retries, quick enough for tests."""
NO_DRAFTS = 3600.0
"""An edit interval no stream lasts: replies are posted once, whole."""


@pytest.fixture
async def api() -> AsyncIterator[SlackApi]:
    async with SlackApi() as api:
        yield api
    assert api.unknown == [], f"the adapter called methods the stand-in lacks: {api.unknown}"


def slack_config(api: SlackApi, tmp_path: Path, token: str | None = None, **slack: Any) -> Config:
    """Slack enabled against ``api``, its secrets in files, the ledger's retries quick."""
    token_file, secret_file = tmp_path / "slack-bot-token", tmp_path / "slack-signing-secret"
    token_file.write_text(api.token if token is None else token)
    secret_file.write_text(SIGNING_SECRET + "\n")
    settings = SlackConfig(
        enabled=True,
        bot_token=Secret(file=str(token_file)),
        signing_secret=Secret(file=str(secret_file)),
        api_url=api.url,
        **slack,
    )
    return Config(slack=settings, delivery=QUICK_DELIVERY, store=StoreConfig(url="memory://"))


class Server(uvicorn.Server):
    """uvicorn, saying when its start-up (the gateway's lifespan) is over."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.up = asyncio.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.up.set()


@dataclass
class Served:
    hub: Hub
    adapter: SlackAdapter
    slack: SlackRequests


@contextlib.asynccontextmanager
async def served(
    config: Config, edit_interval: float = NO_DRAFTS, **options: Any
) -> AsyncIterator[Served]:
    """A hub with the demo agent and the Slack adapter, its app served on a free port."""
    hub = await open_hub(config)
    adapter = SlackAdapter(config, edit_interval=edit_interval, **options)
    hub.add(adapter)
    listening = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    port = listening.getsockname()[1]
    server = Server(uvicorn.Config(build_app(hub), lifespan="on", log_level="warning"))
    task = asyncio.create_task(server.serve(sockets=[listening]))
    slack = SlackRequests(f"http://127.0.0.1:{port}", SIGNING_SECRET)
    try:
        async with asyncio.timeout(WAIT):
            await server.up.wait()
        if hub.startup_error is not None:
            raise hub.startup_error
        yield Served(hub, adapter, slack)
    finally:
        await slack.aclose()
        server.should_exit = True
        await task


@pytest.fixture
async def gateway(api: SlackApi, tmp_path: Path) -> AsyncIterator[Served]:
    async with served(slack_config(api, tmp_path)) as s:
        yield s


def key_of(whoami: str) -> str:
    return whoami.split(" key=")[1].split(" ")[0]


def record_submissions(hub: Hub, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ids of the messages the adapter hands to ``hub`` from now on."""
    submitted: list[str] = []
    submit = hub.submit

    async def recording(message: InboundMessage) -> DispatchResult:
        submitted.append(message.id)
        return await submit(message)

    monkeypatch.setattr(hub, "submit", recording)
    return submitted


# -- conversations -------------------------------------------------------------------


async def test_a_dm_is_answered_in_the_dm(api: SlackApi, gateway: Served) -> None:
    await gateway.slack.message(ALICE_DM, ALICE, "hello there")
    [reply] = await api.wait_for_messages(ALICE_DM)
    assert reply.text == "echo: hello there"
    assert reply.thread_ts is None
    assert api.calls[0] == "auth.test"


async def test_an_event_is_answered_once_chatlane_holds_its_message(
    api: SlackApi, gateway: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slack_events, "ANSWER_WITHIN", 60.0)  # a loaded machine: no cut-off
    order: list[str] = []
    submit = gateway.hub.submit

    async def accepting(message: InboundMessage) -> DispatchResult:
        result = await submit(message)
        order.append("accepted")
        return result

    def answering(*args: Any, **kwargs: Any) -> Response:
        order.append("answered")  # the 200 is made once the request's job is done
        return Response(*args, **kwargs)

    monkeypatch.setattr(gateway.hub, "submit", accepting)
    monkeypatch.setattr(slack_events, "Response", answering)
    ts = await gateway.slack.message(ALICE_DM, ALICE, "sleep 30")
    assert order == ["accepted", "answered"]
    source = SessionSource("slack", chat_id=ALICE_DM, chat_type=ChatType.DM, user_id=ALICE)
    key = build_session_key(source)
    held = gateway.hub.gateway.engine.unanswered(key)  # no drain of the adapter first
    assert [m.id for m in held] == [message_id(ALICE_DM, ts, ALICE)]
    assert [r.message_id for r in await gateway.hub.store.pending(key)] == [held[0].id]


async def test_a_session_is_keyed_by_user_ids(api: SlackApi, gateway: Served) -> None:
    await gateway.slack.message(ALICE_DM, ALICE, "whoami")
    [reply] = await api.wait_for_messages(ALICE_DM)
    assert f"platform=slack chat={ALICE_DM} thread= user={ALICE} " in reply.text
    assert key_of(reply.text) == f"main:slack:dm:{ALICE_DM}"


async def test_in_a_channel_only_a_mention_is_answered(api: SlackApi, gateway: Served) -> None:
    for text in ("whoami", f"hello {BOT_USER}", f"<@{ALICE}> whoami"):
        await gateway.slack.message(GENERAL, ALICE, text, channel_type="channel")
    await gateway.slack.message(GENERAL, ALICE, f"{MENTION} whoami", channel_type="channel")
    [reply] = await api.wait_for_messages(GENERAL)
    await gateway.hub.gateway.engine.wait_idle()
    assert api.texts(GENERAL) == [reply.text]
    assert reply.thread_ts is None
    assert key_of(reply.text) == f"main:slack:group:{GENERAL}::{ALICE}"


async def test_the_mention_is_taken_out_and_escapes_undone(api: SlackApi, gateway: Served) -> None:
    text = f"{MENTION} a &lt; b &amp;&amp; c &gt; d <@{BOT_USER}|chatlane>"
    await gateway.slack.message(GENERAL, ALICE, text, channel_type="group")
    [reply] = await api.wait_for_messages(GENERAL)
    assert reply.text == "echo: a &lt; b &amp;&amp; c &gt; d"  # the agent read "a < b && c > d"


async def test_private_channels_and_group_dms_need_a_mention_too(
    api: SlackApi, gateway: Served
) -> None:
    for channel_type in ("group", "mpim"):
        await gateway.slack.message(GENERAL, ALICE, "hello", channel_type=channel_type)
    await gateway.slack.message(GENERAL, ALICE, f"{MENTION} hello", channel_type="mpim")
    await api.wait_for_messages(GENERAL)
    await gateway.hub.gateway.engine.wait_idle()
    assert api.texts(GENERAL) == ["echo: hello"]


async def test_without_require_mention_a_channel_is_answered(api: SlackApi, tmp_path: Path) -> None:
    async with served(slack_config(api, tmp_path, require_mention=False)) as s:
        await s.slack.message(GENERAL, ALICE, "hello", channel_type="channel")
        [reply] = await api.wait_for_messages(GENERAL)
    assert reply.text == "echo: hello"


async def test_a_mention_event_and_a_message_event_name_one_session(
    api: SlackApi, gateway: Served
) -> None:
    ts = gateway.slack.next_ts()
    mention = {"type": "app_mention", "channel": GENERAL, "user": ALICE, "ts": ts}
    await gateway.slack.event({**mention, "text": f"{MENTION} whoami", "event_ts": ts})
    await gateway.slack.message(GENERAL, ALICE, f"{MENTION} whoami", channel_type="group")
    first, second = await api.wait_for_messages(GENERAL, 2)
    assert key_of(first.text) == key_of(second.text) == f"main:slack:group:{GENERAL}::{ALICE}"


async def test_a_thread_reply_lands_in_the_thread_and_the_bot_stays_in_it(
    api: SlackApi, gateway: Served
) -> None:
    slack = gateway.slack
    thread = await slack.message(GENERAL, BOB, "a question for everyone", channel_type="channel")
    await slack.message(
        GENERAL, ALICE, f"{MENTION} whoami", channel_type="channel", thread_ts=thread
    )
    [reply] = await api.wait_for_messages(GENERAL)
    assert reply.thread_ts == thread
    assert key_of(reply.text) == f"main:slack:group:{GENERAL}:{thread}"
    other = slack.next_ts()
    await slack.message(GENERAL, BOB, "not for the bot", channel_type="channel", thread_ts=other)
    await slack.message(GENERAL, BOB, "whoami", channel_type="channel", thread_ts=thread)
    replies = await api.wait_for_messages(GENERAL, 2)
    await gateway.hub.gateway.engine.wait_idle()
    assert [r.thread_ts for r in api.messages(GENERAL)] == [thread, thread]
    assert key_of(replies[1].text) == key_of(reply.text)  # a thread is one session
    assert f"user={BOB} " in replies[1].text


async def test_a_thread_the_bot_answered_in_needs_no_mention_in_another_process(
    api: SlackApi, tmp_path: Path
) -> None:
    shared = StoreConfig(url=f"sqlite:///{tmp_path / 'shared.db'}")
    config = msgspec.structs.replace(slack_config(api, tmp_path), store=shared)
    async with served(config) as first, served(config) as second:
        thread = await first.slack.message(GENERAL, BOB, "a question", channel_type="channel")
        await first.slack.message(
            GENERAL, ALICE, f"{MENTION} hello", channel_type="channel", thread_ts=thread
        )
        await api.wait_for_messages(GENERAL)
        other = second.slack.next_ts()
        await second.slack.message(
            GENERAL, BOB, "elsewhere", channel_type="channel", thread_ts=other
        )
        await second.slack.message(
            GENERAL, BOB, "and more", channel_type="channel", thread_ts=thread
        )
        replies = await api.wait_for_messages(GENERAL, 2)
        await second.hub.gateway.engine.wait_idle()
        assert (replies[1].text, replies[1].thread_ts) == ("echo: and more", thread)
        assert len(api.messages(GENERAL)) == 2  # nothing for the thread the bot is not in


async def test_a_command_answered_in_a_thread_does_not_make_it_the_bots(
    api: SlackApi, tmp_path: Path
) -> None:
    """Only a turn makes a thread one the bot is in (as every process sees it from the
    store): after a command's reply there, unmentioned messages are still not for it."""
    shared = StoreConfig(url=f"sqlite:///{tmp_path / 'shared.db'}")
    config = msgspec.structs.replace(slack_config(api, tmp_path), store=shared)
    async with served(config) as first, served(config) as second:
        thread = await first.slack.message(GENERAL, BOB, "a question", channel_type="channel")
        await first.slack.message(
            GENERAL, ALICE, f"{MENTION} /status", channel_type="channel", thread_ts=thread
        )
        await api.wait_for_messages(GENERAL)
        for process in (first, second):
            await process.slack.message(
                GENERAL, BOB, "not for the bot", channel_type="channel", thread_ts=thread
            )
        await first.slack.message(GENERAL, ALICE, f"{MENTION} hello", channel_type="channel")
        replies = await api.wait_for_messages(GENERAL, 2)
        for process in (first, second):
            await process.hub.gateway.engine.wait_idle()
        assert replies[1].text == "echo: hello"
        assert len(api.messages(GENERAL)) == 2  # nothing for Bob's messages


async def test_a_thread_message_is_not_dropped_when_the_store_cannot_say_whose_thread_it_is(
    api: SlackApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unknown is not no: the sender alone hears the message could not be handled."""
    shared = StoreConfig(url=f"sqlite:///{tmp_path / 'shared.db'}")
    config = msgspec.structs.replace(slack_config(api, tmp_path), store=shared)
    async with served(config) as first, served(config) as second:
        thread = await first.slack.message(GENERAL, BOB, "a question", channel_type="channel")
        await first.slack.message(
            GENERAL, ALICE, f"{MENTION} hello", channel_type="channel", thread_ts=thread
        )
        await api.wait_for_messages(GENERAL)
        store = second.hub.gateway.engine.store
        generation = store.generation

        async def once_failing(key: SessionKey) -> int:
            monkeypatch.setattr(store, "generation", generation)
            raise StoreError("the store timed out")

        monkeypatch.setattr(store, "generation", once_failing)
        await second.slack.message(
            GENERAL, BOB, "and more", channel_type="channel", thread_ts=thread
        )
        await second.adapter.handled()
        [told] = api.ephemerals
        assert (told.channel, told.user, told.thread_ts) == (GENERAL, BOB, thread)
        assert told.text == "Sorry — your message could not be handled right now; please try again."
        assert len(api.messages(GENERAL)) == 1  # told privately: it may not have been for the bot
        await second.slack.message(
            GENERAL, BOB, "and again", channel_type="channel", thread_ts=thread
        )
        replies = await api.wait_for_messages(GENERAL, 2)
    assert (replies[1].text, replies[1].thread_ts) == ("echo: and again", thread)


async def test_a_thread_under_the_bots_own_message_needs_no_mention(
    api: SlackApi, gateway: Served
) -> None:
    await gateway.slack.message(GENERAL, ALICE, f"{MENTION} hello", channel_type="channel")
    [answer] = await api.wait_for_messages(GENERAL)
    await gateway.slack.message(
        GENERAL,
        ALICE,
        "and more",
        channel_type="channel",
        thread_ts=answer.ts,
        parent_user_id=BOT_USER,
    )
    replies = await api.wait_for_messages(GENERAL, 2)
    assert (replies[1].text, replies[1].thread_ts) == ("echo: and more", answer.ts)


@pytest.mark.parametrize(
    "fields",
    [
        {"bot_id": "BOTHER01"},
        {"subtype": "bot_message", "bot_id": "BOTHER01"},
        {"user": BOT_USER, "bot_id": BOT_ID},
        {"subtype": "message_changed"},
        {"subtype": "message_deleted"},
        {"subtype": "channel_join"},
    ],
)
async def test_bots_the_bot_itself_edits_and_other_subtypes_are_ignored(
    api: SlackApi, gateway: Served, fields: dict[str, str]
) -> None:
    slack = gateway.slack
    event = {"type": "message", "channel": ALICE_DM, "channel_type": "im", "user": ALICE}
    await slack.event({**event, "text": "echo me", "ts": slack.next_ts(), **fields})
    await slack.message(ALICE_DM, ALICE, "and this")
    await api.wait_for_messages(ALICE_DM)
    await gateway.hub.gateway.engine.wait_idle()
    assert api.texts(ALICE_DM) == ["echo: and this"]


async def test_a_thread_broadcast_is_read(api: SlackApi, gateway: Served) -> None:
    thread = gateway.slack.next_ts()
    await gateway.slack.message(ALICE_DM, ALICE, "hi", thread_ts=thread, subtype="thread_broadcast")
    [reply] = await api.wait_for_messages(ALICE_DM)
    assert (reply.text, reply.thread_ts) == ("echo: hi", thread)


async def test_a_message_the_hub_cannot_take_gets_a_notice(
    api: SlackApi, gateway: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def failing(message: InboundMessage) -> DispatchResult:
        raise StoreError("the store is down")

    monkeypatch.setattr(gateway.hub, "submit", failing)
    thread = gateway.slack.next_ts()
    await gateway.slack.message(
        GENERAL, ALICE, f"{MENTION} hi", channel_type="channel", thread_ts=thread
    )
    [notice] = await api.wait_for_messages(GENERAL)
    assert notice.text == "Sorry — your message could not be handled right now; please try again."
    assert notice.thread_ts == thread


# -- requests Slack signs ------------------------------------------------------------


async def test_url_verification_answers_the_challenge(gateway: Served) -> None:
    body = json.dumps({"token": "t", "challenge": "3eZbrw1aB", "type": "url_verification"})
    response = await gateway.slack.post("/slack/events", body.encode())
    assert response.status_code == 200
    assert response.json() == {"challenge": "3eZbrw1aB"}


@pytest.mark.parametrize(
    "tampering",
    [
        {"secret": "not-the-signing-secret"},
        {"age": 6 * 60},  # older than five minutes: a replay
        {"headers": {"X-Slack-Signature": ""}},
        {"headers": {"X-Slack-Request-Timestamp": "yesterday"}},
        {"headers": {"X-Slack-Signature": b"v0=\xff\xfe"}},  # no ASCII: no digest to compare
    ],
)
async def test_bad_and_stale_signatures_are_refused(
    api: SlackApi, gateway: Served, tampering: dict[str, Any]
) -> None:
    slack = gateway.slack
    event = {"type": "message", "channel": ALICE_DM, "user": ALICE, "text": "forged"}
    body = json.dumps(slack.envelope({**event, "ts": slack.next_ts(), "channel_type": "im"}))
    for path in ("/slack/events", "/slack/interactions"):
        response = await slack.post(path, body.encode(), **tampering)
        assert response.status_code == 401
        assert response.text == "invalid or stale Slack signature"
    unsigned = await slack.http.post("/slack/events", content=body)
    assert unsigned.status_code == 401
    await slack.message(ALICE_DM, ALICE, "real")
    await api.wait_for_messages(ALICE_DM)
    await gateway.hub.gateway.engine.wait_idle()
    assert api.texts(ALICE_DM) == ["echo: real"]


async def test_unreadable_and_oversized_bodies_are_refused(gateway: Served) -> None:
    slack = gateway.slack
    assert (await slack.post("/slack/events", b"[1, 2]")).status_code == 400
    assert (await slack.post("/slack/events", b"\xff\xfe")).status_code == 401  # not UTF-8
    form = "application/x-www-form-urlencoded"
    response = await slack.post("/slack/interactions", b"payload=%7Bnot", content_type=form)
    assert response.status_code == 400
    assert (await slack.post("/slack/events", b" " * (1 << 20) + b"{}")).status_code == 413
    deep = b"[" * 100_000 + b"]" * 100_000  # past the JSON parser's depth, within the size
    assert (await slack.post("/slack/events", deep)).status_code == 400
    nested = b"payload=" + b"%5B" * 50_000 + b"%5D" * 50_000
    assert (await slack.post("/slack/interactions", nested, content_type=form)).status_code == 400


async def test_a_retried_or_repeated_event_is_handled_once(
    api: SlackApi, gateway: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    submitted = record_submissions(gateway.hub, monkeypatch)
    slack = gateway.slack
    ts = slack.next_ts()
    event = {"type": "message", "channel": GENERAL, "user": ALICE, "ts": ts}
    event |= {"text": f"{MENTION} hello", "channel_type": "channel"}
    await slack.event(event, event_id="Ev0001")
    retry = {"X-Slack-Retry-Num": "1", "X-Slack-Retry-Reason": "http_timeout"}
    await slack.event(event, event_id="Ev0001", headers=retry)
    await slack.event({**event, "type": "app_mention"}, event_id="Ev0002")  # the same message
    await slack.message(GENERAL, ALICE, f"{MENTION} next", channel_type="channel")
    await api.wait_for(lambda: api.texts(GENERAL) == ["echo: hello", "echo: next"])
    await gateway.hub.gateway.engine.wait_idle()
    assert api.texts(GENERAL) == ["echo: hello", "echo: next"]  # no "Queued …" for a copy
    assert len(submitted) == 2
    assert submitted[0] == f"slack-{GENERAL}-{ts}-{ALICE}"


async def test_a_retry_is_answered_only_once_the_first_copy_is_held(
    api: SlackApi, gateway: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slack_events, "ANSWER_WITHIN", 60.0)  # a loaded machine: no cut-off
    order: list[str] = []
    storing, release, retried = asyncio.Event(), asyncio.Event(), asyncio.Event()
    submit, hand_on = gateway.hub.submit, slack_events.Intake.event

    async def slow(message: InboundMessage) -> DispatchResult:
        storing.set()
        await release.wait()  # a store write that takes a while
        result = await submit(message)
        order.append("accepted")
        return result

    def answering(*args: Any, **kwargs: Any) -> Response:
        order.append("answered")
        return Response(*args, **kwargs)

    async def arriving(intake: slack_events.Intake, envelope: Any) -> None:
        if storing.is_set():
            retried.set()
        await hand_on(intake, envelope)

    monkeypatch.setattr(gateway.hub, "submit", slow)
    monkeypatch.setattr(slack_events, "Response", answering)
    monkeypatch.setattr(slack_events.Intake, "event", arriving)
    slack = gateway.slack
    event = {"type": "message", "channel": ALICE_DM, "user": ALICE, "text": "hello"}
    event |= {"ts": slack.next_ts(), "channel_type": "im"}
    first = asyncio.create_task(slack.event(event, event_id="Ev0001"))
    retry = {"X-Slack-Retry-Num": "1", "X-Slack-Retry-Reason": "http_timeout"}
    async with asyncio.timeout(WAIT):
        await storing.wait()
        again = asyncio.create_task(slack.event(event, event_id="Ev0001", headers=retry))
        await retried.wait()
    release.set()
    await asyncio.gather(first, again)
    assert order == ["accepted", "answered", "answered"]
    [reply] = await api.wait_for_messages(ALICE_DM)
    assert reply.text == "echo: hello"


# -- who may talk --------------------------------------------------------------------


async def test_a_stranger_is_told_once_an_hour_in_a_dm_and_privately_in_a_channel(
    api: SlackApi, tmp_path: Path
) -> None:
    clock = Clock()
    config = slack_config(api, tmp_path, allowed_users=[ALICE])
    async with served(config, clock=clock) as s:
        for _ in range(2):
            await s.slack.message(BOB_DM, BOB, "hello")
        await s.slack.message(GENERAL, CAROL, f"{MENTION} hello", channel_type="channel")
        await s.slack.message(ALICE_DM, ALICE, "hello")
        await api.wait_for_messages(ALICE_DM)
        await s.adapter.handled()
        assert api.texts(BOB_DM) == [NOT_ALLOWED]
        [ephemeral] = api.ephemerals
        assert (ephemeral.channel, ephemeral.user, ephemeral.text) == (GENERAL, CAROL, NOT_ALLOWED)
        assert api.messages(GENERAL) == []
        assert s.hub.metrics.senders_refused["slack"] == 3
        clock.now += REFUSAL_INTERVAL
        await s.slack.message(BOB_DM, BOB, "hello")
        await s.adapter.handled()
        assert api.texts(BOB_DM) == [NOT_ALLOWED] * 2


async def test_allowed_channels_limit_where_the_bot_answers(api: SlackApi, tmp_path: Path) -> None:
    config = slack_config(api, tmp_path, allowed_channels=[GENERAL])
    async with served(config) as s:
        await s.slack.message(RANDOM, ALICE, f"{MENTION} hello", channel_type="channel")
        await s.slack.message(GENERAL, ALICE, f"{MENTION} hello", channel_type="channel")
        await s.slack.message(ALICE_DM, ALICE, "hello")
        await api.wait_for_messages(GENERAL)
        await api.wait_for_messages(ALICE_DM)
        await s.adapter.handled()
    assert api.messages(RANDOM) == []
    assert (api.ephemerals[0].channel, api.ephemerals[0].text) == (RANDOM, NOT_ALLOWED)


# -- approvals -----------------------------------------------------------------------


async def test_approval_buttons_count_only_from_the_asker(api: SlackApi, gateway: Served) -> None:
    slack = gateway.slack
    thread = slack.next_ts()
    await slack.message(
        GENERAL, ALICE, f"{MENTION} approve rm -rf build", channel_type="channel", thread_ts=thread
    )
    [prompt] = await api.wait_for_messages(GENERAL)
    shown = to_mrkdwn(markdown_prompt(Asks("rm -rf build", "the demo agent asks")))
    assert prompt.text == shown
    assert prompt.blocks is not None
    assert prompt.blocks[0]["text"] == {"type": "mrkdwn", "text": shown}
    assert prompt.thread_ts == thread
    approve = prompt.button("Approve")
    assert prompt.button("Deny")["value"] == approve["value"]
    assert (await slack.press(BOB, prompt, approve)).status_code == 200
    await api.wait_for(lambda: len(api.ephemerals) == 1)
    assert api.ephemerals[0].user == BOB
    assert api.ephemerals[0].text == f"Only <@{ALICE}> can answer this approval."
    assert api.ephemerals[0].thread_ts == thread
    forged = await slack.press(ALICE, prompt, approve, secret="forged-by-someone")
    assert forged.status_code == 401
    assert (await slack.press(ALICE, prompt, approve)).status_code == 200
    sent = await api.wait_for_messages(GENERAL, 3)
    assert [s.text for s in sent[1:]] == [
        "Approved (once): `rm -rf build`",
        "approved: rm -rf build",
    ]
    assert all(s.thread_ts == thread for s in sent)
    assert len(api.ephemerals) == 1


HIDING_COMMAND = "echo ok```\n*rm -rf ~* _quiet_ ~gone~ [docs](https://e.example) `y`"
"""A command that would end a plain code span or block and show its second half formatted."""


async def test_an_approval_prompt_shows_the_command_whole_in_its_code_block(
    api: SlackApi, gateway: Served
) -> None:
    await gateway.slack.message(ALICE_DM, ALICE, f"approve {HIDING_COMMAND}")
    [prompt] = await api.wait_for_messages(ALICE_DM)
    assert prompt.blocks is not None
    shown = prompt.blocks[0]["text"]["text"]
    head, block, tail = shown.split("```\n")  # one block: nothing in it closes it
    assert head == "Approval needed — the demo agent asks\n"
    assert block.replace(UNBREAKABLE_BACKTICK, "`") == HIDING_COMMAND + "\n"
    assert "```" not in block
    assert tail == HOW_TO_ANSWER
    await gateway.slack.press(ALICE, prompt, prompt.button("Deny"))
    sent = await api.wait_for_messages(ALICE_DM, 3)
    head, block, tail = sent[1].text.split("```\n")  # the decision quotes it the same way
    assert (head, tail) == ("Denied: \n", "")
    assert block.replace(UNBREAKABLE_BACKTICK, "`") == HIDING_COMMAND + "\n"
    assert sent[2].text == to_mrkdwn(f"denied: {HIDING_COMMAND}")


async def test_deny_in_a_dm(api: SlackApi, gateway: Served) -> None:
    await gateway.slack.message(ALICE_DM, ALICE, "approve rm x")
    [prompt] = await api.wait_for_messages(ALICE_DM)
    await gateway.slack.press(ALICE, prompt, prompt.button("Deny"))
    sent = await api.wait_for_messages(ALICE_DM, 3)
    assert [s.text for s in sent[1:]] == ["Denied: `rm x`", "denied: rm x"]


async def test_a_button_that_is_not_ours_is_answered_privately(
    api: SlackApi, gateway: Served
) -> None:
    await gateway.slack.message(ALICE_DM, ALICE, "hi")
    [reply] = await api.wait_for_messages(ALICE_DM)
    for button in ({"action_id": "other_app"}, {"action_id": "chatlane_approve", "value": "x:y"}):
        await gateway.slack.press(ALICE, reply, button)
    await api.wait_for(lambda: len(api.ephemerals) == 2)
    assert {e.text for e in api.ephemerals} == {"This button is no longer active."}
    assert api.texts(ALICE_DM) == ["echo: hi"]


# -- replies -------------------------------------------------------------------------


async def test_a_long_reply_is_split_into_messages(api: SlackApi, gateway: Served) -> None:
    text = ("word " * 19 + "end\n") * 70  # 7,000 characters
    await gateway.slack.message(ALICE_DM, ALICE, text)
    parts = await api.wait_for_messages(ALICE_DM, 3)
    assert all(len(part.text) <= MESSAGE_LIMIT for part in parts)
    assert all(part.text.endswith("\n") for part in parts[:-1])
    assert "".join(part.text for part in parts) == f"echo: {text}".rstrip("\n")


async def test_a_reply_with_nothing_visible_is_sent_as_a_placeholder(
    api: SlackApi, tmp_path: Path
) -> None:
    """Slack posts no blank message: the user still sees the turn ended."""
    config = slack_config(api, tmp_path)
    blank = msgspec.structs.replace(config, agent=AgentConfig(name=BLANK_AGENT))
    async with served(blank) as s:
        await s.slack.message(ALICE_DM, ALICE, "spaces")
        await eventually(s.hub.gateway.delivery, lambda: delivered(s.hub, 1))
        await s.slack.message(ALICE_DM, ALICE, "zero-width")
        await eventually(s.hub.gateway.delivery, lambda: delivered(s.hub, 2))
    assert api.texts(ALICE_DM) == [EMPTY_REPLY, EMPTY_REPLY]


async def test_a_rate_limit_between_parts_is_waited_out_in_place(
    api: SlackApi, gateway: Served
) -> None:
    text = ("word " * 19 + "end\n") * 70
    key, target = chat_key(ALICE_DM, "slack"), Target("slack", ALICE_DM)
    api.fail_next("chat.postMessage", "ratelimited", status=429, retry_after=0, after=1)
    reply = Outbound(OutboundKind.REPLY, key, target, text)
    await gateway.adapter.send(reply, Attempt("d_1", uncertain=False, attempts=0))
    assert "".join(api.texts(ALICE_DM)) == text
    assert api.calls.count("chat.postMessage") == 4


async def test_a_later_part_that_failed_makes_the_reply_maybe_sent(
    api: SlackApi, gateway: Served
) -> None:
    text = ("word " * 19 + "end\n") * 70
    key, target = chat_key(ALICE_DM, "slack"), Target("slack", ALICE_DM)
    api.fail_next("chat.postMessage", "channel_not_found", after=1)
    reply = Outbound(OutboundKind.REPLY, key, target, text)
    with pytest.raises(PermanentDelivery) as refused:
        await gateway.adapter.send(reply, Attempt("d_1", uncertain=False, attempts=0))
    assert refused.value.maybe_sent  # a redelivery of its dead letter is labelled
    api.fail_next("chat.postMessage", "ratelimited", status=429, retry_after=3600, after=1)
    with pytest.raises(TransientDelivery) as failed:
        await gateway.adapter.send(reply, Attempt("d_1", uncertain=False, attempts=1))
    assert failed.value.maybe_sent
    await gateway.adapter.send(reply, Attempt("d_1", uncertain=True, attempts=2))
    assert api.texts(ALICE_DM)[-3].startswith(RESENT_LABEL)


async def test_a_rate_limit_that_would_outlast_the_attempt_is_not_waited_for(
    api: SlackApi, gateway: Served
) -> None:
    """A wait between parts that would end past the worker's deadline fails the attempt at
    once (the first part went out: maybe sent), instead of being cancelled mid-wait."""
    text = ("word " * 19 + "end\n") * 70
    key, target = chat_key(ALICE_DM, "slack"), Target("slack", ALICE_DM)
    api.fail_next("chat.postMessage", "ratelimited", status=429, retry_after=30, after=1)
    reply = Outbound(OutboundKind.REPLY, key, target, text)
    deadline = time.monotonic() + SEND_ROOM + 10
    with pytest.raises(TransientDelivery) as failed:
        await gateway.adapter.send(reply, Attempt("d_1", False, 0, deadline))
    assert failed.value.maybe_sent
    assert time.monotonic() < deadline
    assert api.calls.count("chat.postMessage") == 2


async def test_markdown_is_sent_as_mrkdwn(api: SlackApi, gateway: Served) -> None:
    await gateway.slack.message(
        ALICE_DM, ALICE, "**bold** [site](https://example.com/?a=1&amp;b=2) x &lt;y"
    )
    [reply] = await api.wait_for_messages(ALICE_DM)
    assert reply.text == "echo: *bold* <https://example.com/?a=1&amp;b=2|site> x &lt;y"


async def test_a_stream_is_shown_as_one_message_edited_in_place(
    api: SlackApi, tmp_path: Path
) -> None:
    async with served(slack_config(api, tmp_path), edit_interval=0.05) as s:
        await s.slack.message(ALICE_DM, ALICE, "stream 10")
        final = "".join(f"{n}\n" for n in range(1, 11))
        await api.wait_for(lambda: api.texts(ALICE_DM) == [final])
        await s.hub.gateway.engine.wait_idle()
    [message] = api.messages(ALICE_DM)
    assert "chat.update" in api.calls
    assert message.edits
    assert all(final.startswith(edit) for edit in message.edits)


async def test_a_draft_is_edited_then_replaced_by_the_reply(api: SlackApi, tmp_path: Path) -> None:
    async with served(slack_config(api, tmp_path), edit_interval=0.01) as s:
        key, target = chat_key(ALICE_DM, "slack"), Target("slack", ALICE_DM)
        chunk = Outbound(OutboundKind.CHUNK, key, target, "Hello ", generation=1)
        await s.adapter.deliver(chunk)
        await api.wait_for_call("chat.postMessage")
        await s.adapter.deliver(
            Outbound(OutboundKind.CHUNK, key, target, "**world**", generation=1)
        )
        await api.wait_for_call("chat.update")
        reply = Outbound(OutboundKind.REPLY, key, target, "Hello **world**!", generation=1)
        await s.adapter.send(reply, Attempt("d_1", uncertain=False, attempts=0))
    [message] = api.messages(ALICE_DM)
    assert message.edits == ["Hello ", "Hello *world*"]
    assert message.text == "Hello *world*!"
    assert api.calls.count("chat.postMessage") == 1


async def test_an_acknowledgement_waiting_out_a_rate_limit_holds_up_no_message(
    api: SlackApi, gateway: Served
) -> None:
    """The next message of the conversation is held by chatlane before Slack's answer,
    not after the acknowledgement's wait (a minute at most: Slack's 200 would come first,
    and a process ending meanwhile would lose the message)."""
    key = build_session_key(
        SessionSource("slack", chat_id=ALICE_DM, chat_type=ChatType.DM, user_id=ALICE)
    )
    await gateway.slack.message(ALICE_DM, ALICE, "sleep 30")
    await eventually_true(lambda: gateway.hub.gateway.engine.running_turn(key) is not None)
    api.fail_next("chat.postMessage", "ratelimited", status=429, retry_after=50)
    await gateway.slack.message(ALICE_DM, ALICE, "second")  # "Queued…" meets the limit
    third = message_id(ALICE_DM, await gateway.slack.message(ALICE_DM, ALICE, "third"), ALICE)

    async def held() -> bool:
        return any(third == record.message_id for record in await gateway.hub.store.pending(key))

    await eventually_true(held)  # within seconds; the limit is longer


async def show_draft(
    s: Served, api: SlackApi, text: str, generation: int = 1
) -> tuple[SessionKey, Target, Message]:
    """A stream's first chunk ``text`` in Alice's DM, shown as its draft: the key, the target
    and the draft."""
    key, target = chat_key(ALICE_DM, "slack"), Target("slack", ALICE_DM)
    await s.adapter.deliver(Outbound(OutboundKind.CHUNK, key, target, text, generation=generation))
    [draft] = await api.wait_for_messages(ALICE_DM)
    return key, target, draft


async def test_a_reply_whose_draft_was_deleted_is_posted_anew(
    api: SlackApi, tmp_path: Path
) -> None:
    async with served(slack_config(api, tmp_path), edit_interval=0.01) as s:
        key, target, draft = await show_draft(s, api, "Hel")
        api.delete(draft)  # by its reader, before the reply replaced it
        reply = Outbound(OutboundKind.REPLY, key, target, "Hello!", generation=1)
        await s.adapter.send(reply, Attempt("d_1", uncertain=False, attempts=0))
    assert api.texts(ALICE_DM) == ["Hello!"]
    assert api.calls.count("chat.update") == 1  # tried, refused: message_not_found


async def test_a_reply_sent_again_over_its_draft_labels_the_first_part_it_posts(
    api: SlackApi, tmp_path: Path
) -> None:
    """The draft's edit repeats nothing; the parts posted after it may repeat."""
    text = ("word " * 19 + "end\n") * 40  # two parts
    async with served(slack_config(api, tmp_path), edit_interval=0.01) as s:
        key, target, _ = await show_draft(s, api, "word")
        reply = Outbound(OutboundKind.REPLY, key, target, text, generation=1)
        await s.adapter.send(reply, Attempt("d_1", uncertain=True, attempts=1))
    edited, posted = api.texts(ALICE_DM)
    assert not edited.startswith(RESENT_LABEL)
    assert posted.startswith(RESENT_LABEL)
    assert edited + posted.removeprefix(RESENT_LABEL) == text


async def test_a_reply_is_cut_in_the_same_places_labelled_or_not(gateway: Served) -> None:
    text = ("word " * 19 + "end\n") * 70
    key, target = chat_key(ALICE_DM, "slack"), Target("slack", ALICE_DM)
    reply = Outbound(OutboundKind.REPLY, key, target, text)
    first = await gateway.adapter._parts(reply, uncertain=False)
    again = await gateway.adapter._parts(reply, uncertain=True)
    assert again.parts[0].startswith(RESENT_LABEL)
    assert [part.removeprefix(RESENT_LABEL) for part in again.parts] == first.parts
    assert all(len(part) <= MESSAGE_LIMIT for part in again.parts)


async def test_a_reply_whose_edit_failed_still_replaces_its_draft(
    api: SlackApi, tmp_path: Path
) -> None:
    async with served(slack_config(api, tmp_path), edit_interval=0.01) as s:
        key, target, _ = await show_draft(s, api, "1 ", generation=3)
        ack = Outbound(OutboundKind.ACK, key, target, "Queued for the next turn", generation=3)
        await s.adapter.deliver(ack)
        api.fail_next("chat.update", "ratelimited", status=429, retry_after=0)
        reply = Outbound(OutboundKind.REPLY, key, target, "1 2 3", generation=3)
        with pytest.raises(RateLimited):
            await s.adapter.send(reply, Attempt("d_1", uncertain=False, attempts=0))
        await s.adapter.send(reply, Attempt("d_1", uncertain=True, attempts=0))
    assert api.texts(ALICE_DM) == ["1 2 3", "Queued for the next turn"]


async def test_a_rate_limit_is_waited_out_through_the_ledger(
    api: SlackApi, gateway: Served
) -> None:
    api.fail_next("chat.postMessage", "ratelimited", status=429, retry_after=1)
    await gateway.slack.message(ALICE_DM, ALICE, "first")
    await gateway.slack.message(ALICE_DM, ALICE, "second")
    await api.wait_for_messages(ALICE_DM, 2)
    await eventually(gateway.hub.gateway.delivery, lambda: delivered(gateway.hub, 2))
    done = await gateway.hub.store.deliveries(DELIVERED)
    assert api.texts(ALICE_DM) == ["echo: first", "echo: second"]  # in order, no label: not sent
    assert [d.attempts for d in done] == [0, 0]
    assert api.calls.count("chat.postMessage") == 3


async def test_a_reply_to_a_conversation_that_is_gone_is_dead_lettered(
    api: SlackApi, gateway: Served
) -> None:
    api.fail_next("chat.postMessage", "channel_not_found")
    await gateway.slack.message(ALICE_DM, ALICE, "first")
    await eventually(gateway.hub.gateway.delivery, lambda: dead(gateway.hub, 1))
    await gateway.slack.message(ALICE_DM, ALICE, "second")
    [reply] = await api.wait_for_messages(ALICE_DM)
    [gone] = await gateway.hub.store.deliveries(DEAD)
    assert reply.text == "echo: second"
    assert gone.reason == "slack: channel_not_found"


async def test_a_reply_that_may_have_been_posted_is_resent_with_the_label(
    api: SlackApi, gateway: Served
) -> None:
    api.fail_next("chat.postMessage", "internal_error", status=500)
    await gateway.slack.message(ALICE_DM, ALICE, "first")
    [reply] = await api.wait_for_messages(ALICE_DM)
    await eventually(gateway.hub.gateway.delivery, lambda: delivered(gateway.hub, 1))
    [done] = await gateway.hub.store.deliveries(DELIVERED)
    assert reply.text == RESENT_LABEL + "echo: first"
    assert done.attempts == 1


async def test_a_revoked_token_pauses_the_lane_without_spending_attempts(
    api: SlackApi, gateway: Served
) -> None:
    for _ in range(2):
        api.fail_next("chat.postMessage", "token_revoked")
    await gateway.slack.message(ALICE_DM, ALICE, "first")
    [reply] = await api.wait_for_messages(ALICE_DM)
    await eventually(gateway.hub.gateway.delivery, lambda: delivered(gateway.hub, 1))
    [done] = await gateway.hub.store.deliveries(DELIVERED)
    assert (reply.text, done.attempts) == ("echo: first", 0)


async def test_an_unreachable_api_is_unavailable_and_a_lost_answer_maybe_sent() -> None:
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientConnectorError) as refused:
            await session.post(f"http://127.0.0.1:{free_port()}/api/chat.postMessage")
    assert isinstance(classify(refused.value), PlatformUnavailable)
    later = classify(refused.value, sent_before=True)
    assert isinstance(later, TransientDelivery)
    assert later.maybe_sent
    lost = classify(aiohttp.ServerDisconnectedError())
    assert isinstance(lost, TransientDelivery)
    assert lost.maybe_sent


async def test_without_the_ledger_a_failed_send_is_logged_and_the_adapter_goes_on(
    api: SlackApi, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = slack_config(api, tmp_path)
    config = Config(
        slack=config.slack, delivery=DeliverySettings(enabled=False), store=config.store
    )
    api.fail_next("chat.postMessage", "is_archived")
    async with served(config) as s:
        assert s.hub.gateway.delivery is None
        with caplog.at_level(logging.WARNING, logger="chatlane.adapters.slack"):
            await s.slack.message(ALICE_DM, ALICE, "first")
            await api.wait_for_call("chat.postMessage")
            await s.hub.gateway.engine.wait_idle()  # its turn ended: "second" finds it idle
            await s.slack.message(ALICE_DM, ALICE, "second")
            [reply] = await api.wait_for_messages(ALICE_DM)
    assert reply.text == "echo: second"
    assert f"slack chat.postMessage to {ALICE_DM} failed: slack: is_archived" in caplog.text


async def test_delivery_after_close_is_dropped(api: SlackApi, tmp_path: Path) -> None:
    async with served(slack_config(api, tmp_path)) as s:
        pass
    key = chat_key(ALICE_DM, "slack")
    await s.adapter.deliver(Outbound(OutboundKind.REPLY, key, Target("slack", ALICE_DM), "late"))
    assert api.messages(ALICE_DM) == []
    assert not s.adapter.ready()


# -- stopping ------------------------------------------------------------------------


def on_disk(config: Config, tmp_path: Path) -> Config:
    """``config`` with a SQLite store in ``tmp_path``, which the next start opens again."""
    store = StoreConfig(url=f"sqlite:///{tmp_path / 'chatlane.db'}")
    return msgspec.structs.replace(config, store=store)


async def queued_at_next_start(config: Config, chat_id: str, user: str) -> list[str]:
    """The ids of the messages queued in the DM ``chat_id`` with ``user`` when a hub on
    ``config``'s store starts again."""
    hub = await open_hub(config)
    try:
        source = SessionSource("slack", chat_id=chat_id, chat_type=ChatType.DM, user_id=user)
        pending = await hub.store.pending(build_session_key(source))
    finally:
        await shutdown(hub)
    return [record.message_id for record in pending]


async def test_a_shutdown_refuses_new_events_first_and_stores_the_one_slack_was_answered_for(
    api: SlackApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slack never sends an event again once it was answered (at ANSWER_WITHIN, while the
    store still wrote its message): that write is waited for, not cancelled; an event that
    arrives once the shutdown began is refused with 503, which Slack retries."""
    monkeypatch.setattr(slack_events, "ANSWER_WITHIN", 0.0)  # answered while still storing
    config = on_disk(slack_config(api, tmp_path), tmp_path)
    storing, release, refusing = asyncio.Event(), asyncio.Event(), asyncio.Event()
    close = slack_events.Inbox.close

    def closing(inbox: slack_events.Inbox) -> None:
        close(inbox)
        refusing.set()

    monkeypatch.setattr(slack_events.Inbox, "close", closing)
    async with served(config) as s:
        submit = s.hub.submit

        async def slow(message: InboundMessage) -> DispatchResult:
            storing.set()
            await release.wait()  # a store write that takes a while
            return await submit(message)

        monkeypatch.setattr(s.hub, "submit", slow)
        ts = await s.slack.message(ALICE_DM, ALICE, "sent as the gateway stops")  # 200
        async with asyncio.timeout(WAIT):
            await storing.wait()
            stopping = asyncio.create_task(shutdown(s.hub))
            await refusing.wait()
        late = message_event(ALICE_DM, ALICE, "too late", s.slack.next_ts(), "im", None)
        refused = await s.slack.post("/slack/events", json.dumps(s.slack.envelope(late)).encode())
        release.set()
        await stopping
    assert refused.status_code == 503
    queued = await queued_at_next_start(config, ALICE_DM, ALICE)
    assert queued == [message_id(ALICE_DM, ts, ALICE)]


async def test_a_shutdown_gives_a_store_write_that_never_ends_up(
    api: SlackApi,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(slack_events, "ANSWER_WITHIN", 0.0)
    monkeypatch.setattr(slack, "CLOSE_WAIT", 0.01)
    storing = asyncio.Event()
    async with served(slack_config(api, tmp_path)) as s:

        async def stuck(message: InboundMessage) -> DispatchResult:
            storing.set()
            await asyncio.Event().wait()  # a store that never answers
            raise AssertionError("unreachable")

        monkeypatch.setattr(s.hub, "submit", stuck)
        await s.slack.message(ALICE_DM, ALICE, "hello")
        async with asyncio.timeout(WAIT):
            await storing.wait()
        with caplog.at_level(logging.WARNING, logger="chatlane.adapters"):
            await shutdown(s.hub)  # returns: the write was cancelled after CLOSE_WAIT
    assert not s.adapter.ready()
    assert "1 Slack jobs not done after 0.01s were cancelled" in caplog.text


# -- starting ------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def started(config: Config) -> AsyncIterator[SlackAdapter]:
    """The adapter started on its own, on a hub that is not served."""
    hub = await open_hub(config)
    adapter = SlackAdapter(config)
    try:
        await adapter.start(hub)
        yield adapter
    finally:
        await adapter.aclose()
        await shutdown(hub)


@pytest.mark.parametrize(
    ("secret", "message"),
    [
        ("bot_token", "slack is enabled but has no bot token: set UNSET_IN_TESTS"),
        ("signing_secret", "slack is enabled but has no signing secret: set UNSET_IN_TESTS"),
    ],  # the variable configured, not SLACK_BOT_TOKEN or SLACK_SIGNING_SECRET
)
async def test_a_missing_secret_is_a_config_error(
    api: SlackApi, tmp_path: Path, secret: str, message: str
) -> None:
    config = slack_config(api, tmp_path)
    settings = msgspec.structs.replace(config.slack, **{secret: Secret(env="UNSET_IN_TESTS")})
    with pytest.raises(ConfigError, match=message):
        async with started(Config(slack=settings, store=config.store)):
            pass
    assert api.calls == []


async def test_a_rejected_token_is_a_config_error(api: SlackApi, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"rejected the bot token \(invalid_auth\)") as caught:
        async with started(slack_config(api, tmp_path, token="xoxb-wrong")):
            pass
    assert "xoxb-wrong" not in str(caught.value)


async def test_an_unreachable_api_is_a_config_error(tmp_path: Path) -> None:
    api = SlackApi()  # never started
    api.port = free_port()
    with pytest.raises(ConfigError, match=f"the Slack Web API at {api.url} failed"):
        async with started(slack_config(api, tmp_path)):
            pass


def serve_env(**env: str) -> dict[str, str]:
    """The environment of ``chatlane serve`` with nothing of Slack's but ``env``."""
    names = ("SLACK_BOT_TOKEN", "SLACK_SIGNING_SECRET", "SLACK_APP_TOKEN")
    base = {k: v for k, v in os.environ.items() if not k.startswith("CHATLANE_") and k not in names}
    return {**base, "CHATLANE_SLACK__ENABLED": "true", **env}


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "Error: slack is enabled but has no bot token: set SLACK_BOT_TOKEN"),
        ({"SLACK_BOT_TOKEN": "xoxb-1"}, "slack is enabled but has no signing secret"),
        (
            {"CHATLANE_SLACK__SIGNING_SECRET": '{ file = "/nonexistent/slack-secret" }'},
            "secret file '/nonexistent/slack-secret': No such file or directory",
        ),
        (
            {
                "SLACK_BOT_TOKEN": "xoxb-1",
                "SLACK_SIGNING_SECRET": "s3cret",
                "CHATLANE_SLACK__API_URL": "http://127.0.0.1:9/api",
            },
            "the Slack Web API at http://127.0.0.1:9/api failed",
        ),
    ],
)
def test_serve_with_a_broken_slack_secret_stops_in_one_line(
    tmp_path: Path, env: dict[str, str], message: str
) -> None:
    result = serve_once(tmp_path, serve_env(**env))
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert message in line
    assert "xoxb-1" not in line
    assert "s3cret" not in line
