"""The Slack adapter in Socket Mode end to end: slack-sdk's own Socket Mode client connected
to the stand-in's WebSocket, envelopes in and acknowledgements out, a real hub with the
demo agent behind it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from slack_sdk.socket_mode.aiohttp import SocketModeClient

from chatlane.adapters import slack_events
from chatlane.adapters.slack import SlackAdapter
from chatlane.adapters.slack_wire import message_id
from chatlane.config import Config, Secret, SlackConfig, SlackMode, StoreConfig
from chatlane.errors import ConfigError
from chatlane.gateway import DispatchResult
from chatlane.hub import Hub, shutdown
from chatlane.identity import ChatType, SessionSource, build_session_key
from chatlane.types import InboundMessage
from tests.adapters.slackapi import (
    BOT_USER,
    WAIT,
    SlackApi,
    SlackRequests,
    SlackSocket,
    event_callback,
    message_event,
)
from tests.adapters.test_slack import (
    ALICE,
    ALICE_DM,
    BOB,
    GENERAL,
    MENTION,
    QUICK_DELIVERY,
    key_of,
    on_disk,
    queued_at_next_start,
    record_submissions,
    serve_env,
    served,
    started,
)
from tests.serving import serve_once


@pytest.fixture
async def api() -> AsyncIterator[SlackApi]:
    async with SlackApi() as api:
        yield api
    assert api.unknown == [], f"the adapter called methods the stand-in lacks: {api.unknown}"


def socket_config(api: SlackApi, tmp_path: Path, app_token: str | None = None) -> Config:
    """Slack in Socket Mode against ``api``, its tokens in files, no signing secret at all."""
    bot_file, app_file = tmp_path / "slack-bot-token", tmp_path / "slack-app-token"
    bot_file.write_text(api.token)
    app_file.write_text((api.app_token if app_token is None else app_token) + "\n")
    settings = SlackConfig(
        enabled=True,
        mode=SlackMode.SOCKET,
        bot_token=Secret(file=str(bot_file)),
        app_token=Secret(file=str(app_file)),
        signing_secret=Secret(env="UNSET_IN_TESTS"),
        api_url=api.url,
    )
    return Config(slack=settings, delivery=QUICK_DELIVERY, store=StoreConfig(url="memory://"))


@dataclass
class Socketed:
    hub: Hub
    adapter: SlackAdapter
    slack: SlackSocket
    requests: SlackRequests
    """Requests to the gateway's HTTP routes."""


@contextlib.asynccontextmanager
async def socketed(api: SlackApi, tmp_path: Path) -> AsyncIterator[Socketed]:
    """The gateway served with Slack in Socket Mode, connected to ``api``."""
    async with served(socket_config(api, tmp_path)) as s:
        yield Socketed(s.hub, s.adapter, SlackSocket(api), s.slack)


@pytest.fixture
async def gateway(api: SlackApi, tmp_path: Path) -> AsyncIterator[Socketed]:
    async with socketed(api, tmp_path) as s:
        yield s


# -- conversations -------------------------------------------------------------------


async def test_a_dm_is_answered_in_socket_mode(api: SlackApi, gateway: Socketed) -> None:
    await gateway.slack.message(ALICE_DM, ALICE, "hello there")
    [reply] = await api.wait_for_messages(ALICE_DM)
    assert (reply.text, reply.thread_ts) == ("echo: hello there", None)
    assert api.calls[:2] == ["auth.test", "apps.connections.open"]
    assert api.connections == 1
    assert api.unacknowledged == []


async def test_the_request_urls_are_not_served(gateway: Socketed) -> None:
    for path in ("/slack/events", "/slack/interactions"):
        response = await gateway.requests.post(path, b"{}")
        assert response.status_code == 404


async def test_a_channel_mention_is_answered_in_its_thread(
    api: SlackApi, gateway: Socketed
) -> None:
    slack = gateway.slack
    thread = await slack.message(GENERAL, BOB, "a question for everyone", channel_type="channel")
    await slack.message(GENERAL, ALICE, "not for the bot", channel_type="channel", thread_ts=thread)
    await slack.message(
        GENERAL, ALICE, f"{MENTION} whoami", channel_type="channel", thread_ts=thread
    )
    [reply] = await api.wait_for_messages(GENERAL)
    await gateway.hub.gateway.engine.wait_idle()
    assert api.texts(GENERAL) == [reply.text]
    assert reply.thread_ts == thread
    assert key_of(reply.text) == f"main:slack:group:{GENERAL}:{thread}"


async def test_an_envelope_is_acknowledged_once_chatlane_holds_its_message(
    api: SlackApi, gateway: Socketed, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slack_events, "ANSWER_WITHIN", 60.0)  # a loaded machine: no cut-off
    order: list[str] = []
    submit = gateway.hub.submit
    acknowledge = SocketModeClient.send_socket_mode_response

    async def accepting(message: InboundMessage) -> DispatchResult:
        result = await submit(message)
        order.append("accepted")
        return result

    async def acknowledging(client: SocketModeClient, response: Any) -> None:
        order.append("acknowledged")
        await acknowledge(client, response)

    monkeypatch.setattr(gateway.hub, "submit", accepting)
    monkeypatch.setattr(SocketModeClient, "send_socket_mode_response", acknowledging)
    ts = await gateway.slack.message(ALICE_DM, ALICE, "sleep 30")  # back once acknowledged
    assert order == ["accepted", "acknowledged"]
    source = SessionSource("slack", chat_id=ALICE_DM, chat_type=ChatType.DM, user_id=ALICE)
    held = gateway.hub.gateway.engine.unanswered(build_session_key(source))
    assert [m.id for m in held] == [message_id(ALICE_DM, ts, ALICE)]  # its turn still runs
    assert api.messages(ALICE_DM) == []


async def test_every_envelope_is_acknowledged_whatever_it_carries(
    api: SlackApi, gateway: Socketed
) -> None:
    slack = gateway.slack
    bot = {"type": "message", "channel": ALICE_DM, "user": BOT_USER, "text": "mine"}
    await slack.event({**bot, "ts": slack.next_ts(), "bot_id": "BBOT0001"})
    await slack.event({"type": "reaction_added", "user": ALICE, "reaction": "eyes"})
    slash = {"command": "/chatlane", "text": "status", "user_id": ALICE, "channel_id": GENERAL}
    await api.wait_for_ack(await api.send_envelope("slash_commands", slash))
    await api.wait_for_ack(await api.send_envelope("events_api", {"type": "app_rate_limited"}))
    await slack.message(ALICE_DM, ALICE, "and this")
    await api.wait_for_messages(ALICE_DM)
    await gateway.hub.gateway.engine.wait_idle()
    assert api.texts(ALICE_DM) == ["echo: and this"]
    assert set(api.acks) == set(api.envelopes)


async def test_a_retried_envelope_runs_once(
    api: SlackApi, gateway: Socketed, monkeypatch: pytest.MonkeyPatch
) -> None:
    submitted = record_submissions(gateway.hub, monkeypatch)
    slack = gateway.slack
    event = {"type": "message", "channel": ALICE_DM, "user": ALICE, "text": "once"}
    event |= {"ts": slack.next_ts(), "channel_type": "im"}
    first = await slack.event(event, event_id="Ev0001")
    retry = await slack.event(event, event_id="Ev0001", retry_attempt=1)
    await slack.message(ALICE_DM, ALICE, "next")
    await api.wait_for(lambda: api.texts(ALICE_DM) == ["echo: once", "echo: next"])
    await gateway.hub.gateway.engine.wait_idle()
    assert api.texts(ALICE_DM) == ["echo: once", "echo: next"]
    assert len(submitted) == 2
    assert {first, retry} <= set(api.acks)


# -- approvals -----------------------------------------------------------------------


async def test_approval_buttons_count_only_from_the_asker(api: SlackApi, gateway: Socketed) -> None:
    slack = gateway.slack
    thread = slack.next_ts()
    await slack.message(
        GENERAL, ALICE, f"{MENTION} approve rm -rf build", channel_type="channel", thread_ts=thread
    )
    [prompt] = await api.wait_for_messages(GENERAL)
    approve = prompt.button("Approve")
    await slack.press(BOB, prompt, approve)
    await api.wait_for(lambda: len(api.ephemerals) == 1)
    [refusal] = api.ephemerals
    assert (refusal.user, refusal.thread_ts) == (BOB, thread)
    assert refusal.text == f"Only <@{ALICE}> can answer this approval."
    await slack.press(ALICE, prompt, approve)
    sent = await api.wait_for_messages(GENERAL, 3)
    assert [s.text for s in sent[1:]] == [
        "Approved (once): `rm -rf build`",
        "approved: rm -rf build",
    ]
    assert all(s.thread_ts == thread for s in sent)
    assert len(api.ephemerals) == 1
    assert api.unacknowledged == []


async def test_deny_in_a_dm(api: SlackApi, gateway: Socketed) -> None:
    await gateway.slack.message(ALICE_DM, ALICE, "approve rm x")
    [prompt] = await api.wait_for_messages(ALICE_DM)
    await gateway.slack.press(ALICE, prompt, prompt.button("Deny"))
    sent = await api.wait_for_messages(ALICE_DM, 3)
    assert [s.text for s in sent[1:]] == ["Denied: `rm x`", "denied: rm x"]


# -- the connection ------------------------------------------------------------------


async def test_a_dropped_connection_is_opened_again(api: SlackApi, gateway: Socketed) -> None:
    await gateway.slack.message(ALICE_DM, ALICE, "before")
    await api.drop()
    while_away = asyncio.create_task(gateway.slack.message(ALICE_DM, ALICE, "while away"))
    await api.wait_for_connections(2)
    await while_away
    await gateway.slack.message(ALICE_DM, ALICE, "after")
    await api.wait_for(lambda: len(api.messages(ALICE_DM)) == 3)
    await gateway.hub.gateway.engine.wait_idle()
    assert api.texts(ALICE_DM) == ["echo: before", "echo: while away", "echo: after"]
    assert api.calls.count("apps.connections.open") >= 2


async def test_a_disconnect_envelope_is_followed_by_a_new_connection(
    api: SlackApi, gateway: Socketed, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="chatlane.adapters.slack"):
        await api.disconnect("refresh_requested")
        await api.wait_for_connections(2)
    await gateway.slack.message(ALICE_DM, ALICE, "after")
    [reply] = await api.wait_for_messages(ALICE_DM)
    assert reply.text == "echo: after"
    assert "slack asks for a new Socket Mode connection (refresh_requested)" in caplog.text


async def test_what_slack_kept_while_the_app_was_away_is_answered_at_start(
    api: SlackApi, tmp_path: Path
) -> None:
    socket = SlackSocket(api)
    kept = asyncio.create_task(socket.message(ALICE_DM, ALICE, "are you there"))
    async with socketed(api, tmp_path):
        await kept
        [reply] = await api.wait_for_messages(ALICE_DM)
    assert reply.text == "echo: are you there"


async def test_a_copy_sent_again_after_a_reconnect_waits_for_the_first_to_be_held(
    api: SlackApi, gateway: Socketed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy is not acknowledged while the first copy's message is not held yet: a
    process that died then would have had Slack's last chance to send it."""
    monkeypatch.setattr(slack_events, "ANSWER_WITHIN", 60.0)  # a loaded machine: no cut-off
    order: list[str] = []
    storing, release, copied = asyncio.Event(), asyncio.Event(), asyncio.Event()
    submit, acknowledge = gateway.hub.submit, SocketModeClient.send_socket_mode_response
    hand_on, arrived = slack_events.Intake.event, []

    async def slow(message: InboundMessage) -> DispatchResult:
        storing.set()
        await release.wait()  # a store write that takes a while
        result = await submit(message)
        order.append("accepted")
        return result

    async def acknowledging(client: SocketModeClient, response: Any) -> None:
        order.append("acknowledged")
        await acknowledge(client, response)

    async def arriving(intake: slack_events.Intake, envelope: Any) -> None:
        arrived.append(envelope)
        if len(arrived) == 2:
            copied.set()
        await hand_on(intake, envelope)

    monkeypatch.setattr(gateway.hub, "submit", slow)
    monkeypatch.setattr(SocketModeClient, "send_socket_mode_response", acknowledging)
    monkeypatch.setattr(slack_events.Intake, "event", arriving)
    event = message_event(ALICE_DM, ALICE, "hello", gateway.slack.next_ts(), "im", None)
    envelope = await api.send_envelope("events_api", event_callback(event, "Ev0001"))
    async with asyncio.timeout(WAIT):
        await storing.wait()
        await api.drop()  # Slack sends what it has no acknowledgement for again
        await copied.wait()
    release.set()
    await api.wait_for_ack(envelope)
    await gateway.adapter.handled()
    assert order[0] == "accepted"
    assert api.unacknowledged == []
    await api.wait_for_messages(ALICE_DM)
    await gateway.hub.gateway.engine.wait_idle()
    assert api.texts(ALICE_DM) == ["echo: hello"]


async def test_closing_closes_the_connection(api: SlackApi, tmp_path: Path) -> None:
    async with socketed(api, tmp_path) as s:
        await s.slack.message(ALICE_DM, ALICE, "hi")
        await api.wait_for_messages(ALICE_DM)
        assert api.connected
    await api.wait_for(lambda: not api.connected)
    assert not s.adapter.ready()
    assert api.connections == 1


async def test_a_shutdown_closes_the_connection_first_and_stores_the_message_it_acknowledged(
    api: SlackApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slack never sends an envelope again once it was acknowledged (at ANSWER_WITHIN, while
    the store still wrote its message): that write is waited for, not cancelled, with the
    connection already closed, so Slack sends again whatever was not acknowledged."""
    monkeypatch.setattr(slack_events, "ANSWER_WITHIN", 0.0)  # acknowledged while still storing
    config = on_disk(socket_config(api, tmp_path), tmp_path)
    storing, release = asyncio.Event(), asyncio.Event()
    connected_when_stored: list[bool] = []
    async with served(config) as s:
        submit = s.hub.submit

        async def slow(message: InboundMessage) -> DispatchResult:
            storing.set()
            await release.wait()  # a store write that takes a while
            connected_when_stored.append(api.connected)
            return await submit(message)

        monkeypatch.setattr(s.hub, "submit", slow)
        ts = await SlackSocket(api).message(ALICE_DM, ALICE, "sent as the gateway stops")
        async with asyncio.timeout(WAIT):
            await storing.wait()
        stopping = asyncio.create_task(shutdown(s.hub))
        await api.wait_for(lambda: not api.connected)
        release.set()
        await stopping
    assert connected_when_stored == [False]
    assert api.unacknowledged == []
    queued = await queued_at_next_start(config, ALICE_DM, ALICE)
    assert queued == [message_id(ALICE_DM, ts, ALICE)]


# -- starting ------------------------------------------------------------------------


async def test_a_rejected_app_token_is_a_config_error(api: SlackApi, tmp_path: Path) -> None:
    wrong = "xapp-1-A0001-1-wrong"
    with pytest.raises(ConfigError, match=r"rejected the app token \(invalid_auth\)") as caught:
        async with started(socket_config(api, tmp_path, app_token=wrong)):
            pass
    assert wrong not in str(caught.value)
    assert api.calls == ["auth.test", "apps.connections.open"]
    assert api.connections == 0


async def test_a_malformed_app_token_is_refused_before_slack_is_asked(
    api: SlackApi, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match="slack's app token is not an app-level token"):
        async with started(socket_config(api, tmp_path, app_token=api.token)):
            pass
    assert api.calls == []


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "Error: slack is in socket mode but has no app token: set SLACK_APP_TOKEN"),
        ({"SLACK_APP_TOKEN": "xoxb-2"}, "slack's app token is not an app-level token"),
        ({"SLACK_APP_TOKEN": "xapp-1-wrong"}, "rejected the app token (invalid_auth)"),
    ],
)
async def test_serve_in_socket_mode_with_a_bad_app_token_stops_in_one_line(
    api: SlackApi, tmp_path: Path, env: dict[str, str], message: str
) -> None:
    socket = {"CHATLANE_SLACK__MODE": "socket", "CHATLANE_SLACK__API_URL": api.url}
    environment = serve_env(SLACK_BOT_TOKEN=api.token, **socket, **env)  # no signing secret
    result = await asyncio.to_thread(serve_once, tmp_path, environment)
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert message in line
    assert api.token not in line
    assert "xapp-1-wrong" not in line
