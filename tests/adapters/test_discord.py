"""The Discord adapter end to end: the real discord.py client against a local stand-in of
Discord's REST API and gateway, a real hub with the demo agent behind it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import discord
import msgspec
import pytest

from chatlane.adapters import discord as discord_adapter
from chatlane.adapters.discord import REFUSAL_INTERVAL, DiscordAdapter
from chatlane.adapters.discord_wire import MESSAGE_LIMIT
from chatlane.adapters.splitting import EMPTY_REPLY
from chatlane.adapters.waits import SEND_ROOM
from chatlane.approvals import HOW_TO_ANSWER, UNBREAKABLE_BACKTICK, markdown_prompt
from chatlane.config import AgentConfig, Config, DiscordConfig, Secret, StoreConfig
from chatlane.delivery import Attempt, DeliverySettings
from chatlane.delivery.ledger import RESENT_LABEL
from chatlane.errors import (
    ConfigError,
    PermanentDelivery,
    RateLimited,
    StoreError,
    TransientDelivery,
)
from chatlane.gateway import DispatchResult
from chatlane.hub import Hub, open_hub, shutdown
from chatlane.identity import ChatType, SessionSource, build_session_key
from chatlane.stores.base import DEAD, DELIVERED
from chatlane.types import Asks, InboundMessage, Outbound, OutboundKind, SessionKey, Target
from tests.adapters.blank_agent import AGENT as BLANK_AGENT
from tests.adapters.discordapi import (
    BOT_ID,
    BOT_USER,
    ELSEWHERE,
    GENERAL,
    GUILD,
    OTHER_GUILD,
    RANDOM,
    THREAD,
    DiscordApi,
    Posted,
    message,
)
from tests.adapters.test_api import eventually as eventually_true
from tests.clock import Clock
from tests.delivery.waits import WAIT, dead, delivered, eventually
from tests.keys import chat_key
from tests.ports import free_port
from tests.serving import serve_once

ALICE, BOB, CAROL = 950000000000000001, 950000000000000002, 950000000000000003
OTHER_BOT = 950000000000000009
MENTION = f"<@{BOT_ID}>"
NOT_ALLOWED = "Sorry, you are not allowed to use this assistant."
QUICK_DELIVERY = DeliverySettings(
    poll_interval=0.05, first_retry=0.05, max_retry=0.2, unavailable_first=0.05, unavailable_max=0.2
)
"""The delivery ledger's retries, quick enough for tests."""
NO_DRAFTS = 3600.0
"""An edit interval no stream lasts: replies are posted once, whole."""


@pytest.fixture
async def api() -> AsyncIterator[DiscordApi]:
    async with DiscordApi() as api:
        yield api
    assert api.unknown == [], f"the adapter called routes the stand-in lacks: {api.unknown}"


def discord_config(
    api: DiscordApi, tmp_path: Path, token: str | None = None, **discord: Any
) -> Config:
    """Discord enabled against ``api``, its token in a file, the ledger's retries quick."""
    token_file = tmp_path / "discord-token"
    token_file.write_text((api.token if token is None else token) + "\n")
    settings = DiscordConfig(
        enabled=True, token=Secret(file=str(token_file)), api_url=api.url, **discord
    )
    return Config(discord=settings, delivery=QUICK_DELIVERY, store=StoreConfig(url="memory://"))


@dataclass
class Running:
    hub: Hub
    adapter: DiscordAdapter

    async def idle(self) -> None:
        """Wait until every event so far was handled and every turn ended."""
        await self.adapter.handled()
        await self.hub.gateway.engine.wait_idle()


@contextlib.asynccontextmanager
async def running(
    config: Config, edit_interval: float = NO_DRAFTS, **options: Any
) -> AsyncIterator[Running]:
    """A hub with the demo agent and the Discord adapter, started."""
    hub = await open_hub(config)
    adapter = DiscordAdapter(config, edit_interval=edit_interval, **options)
    hub.add(adapter)
    try:
        await hub.gateway.start()
        await adapter.start(hub)
        yield Running(hub, adapter)
    finally:
        await shutdown(hub)


@pytest.fixture
async def bot(api: DiscordApi, tmp_path: Path) -> AsyncIterator[Running]:
    async with running(discord_config(api, tmp_path)) as r:
        yield r


def key_of(whoami: str) -> str:
    return whoami.split(" key=")[1].split(" ")[0]


def replying_to_bot(api: DiscordApi, channel: int, shown_id: int) -> dict[str, Any]:
    """The fields of a reply to the bot's message ``shown_id``."""
    guild = api.channels[channel].get("guild_id")
    return {
        "type": 19,
        "message_reference": {"message_id": str(shown_id), "channel_id": str(channel)},
        "referenced_message": message(shown_id, channel, BOT_USER, "earlier", guild and int(guild)),
    }


# -- conversations -------------------------------------------------------------------


async def test_a_dm_is_answered_in_the_dm_and_keyed_by_ids(api: DiscordApi, bot: Running) -> None:
    dm = api.dm_channel(ALICE)
    await api.say(dm, ALICE, "whoami")
    [reply] = await api.wait_for_messages(dm)
    assert f"platform=discord chat={dm} thread= user={ALICE} " in reply.text
    assert key_of(reply.text) == f"main:discord:dm:{dm}"
    assert api.calls[:2] == ["users.me", "gateway.bot"]
    assert api.identified[0]["intents"] & (1 << 15)  # Message Content asked for


async def test_a_message_is_accepted_before_anything_is_sent(
    api: DiscordApi, bot: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str] = []
    accepted = asyncio.Event()
    submit = bot.hub.submit

    async def accepting(message: InboundMessage) -> DispatchResult:
        seen.append(f"submitted after {len(api.calls)} calls")
        result = await submit(message)
        accepted.set()
        return result

    monkeypatch.setattr(bot.hub, "submit", accepting)
    calls = len(api.calls)
    dm = api.dm_channel(ALICE)
    message_id = await api.say(dm, ALICE, "sleep 30")
    async with asyncio.timeout(WAIT):
        await accepted.wait()
    assert seen == [f"submitted after {calls} calls"]
    source = SessionSource("discord", chat_id=str(dm), chat_type=ChatType.DM, user_id=str(ALICE))
    [held] = bot.hub.gateway.engine.unanswered(build_session_key(source))
    assert held.id == f"discord-{message_id}-{ALICE}"


async def test_in_a_channel_only_a_mention_or_a_reply_to_the_bot_is_answered(
    api: DiscordApi, bot: Running
) -> None:
    for text in ("whoami", f"hello {BOT_ID}", f"<@{BOB}> whoami", MENTION):
        await api.say(GENERAL, ALICE, text)
    await api.say(GENERAL, ALICE, f"{MENTION} whoami")
    [reply] = await api.wait_for_messages(GENERAL)
    assert key_of(reply.text) == f"main:discord:group:{GENERAL}::{ALICE}"
    await api.say(GENERAL, ALICE, "and you?", **replying_to_bot(api, GENERAL, reply.id))
    await api.say(GENERAL, ALICE, f"<@!{BOT_ID}>   nickname form  ")
    await api.say(GENERAL, ALICE, f"ask {MENTION} about it")
    await api.wait_for_messages(GENERAL, 4)
    await bot.idle()
    assert api.texts(GENERAL)[1:] == [
        "echo: and you?",
        "echo: nickname form",
        "echo: ask about it",
    ]


async def test_without_require_mention_a_channel_is_answered(
    api: DiscordApi, tmp_path: Path
) -> None:
    async with running(discord_config(api, tmp_path, require_mention=False)):
        await api.say(RANDOM, ALICE, "hello")
        [reply] = await api.wait_for_messages(RANDOM)
    assert reply.text == "echo: hello"


async def test_a_thread_is_its_parent_channel_with_the_thread_as_key(
    api: DiscordApi, bot: Running
) -> None:
    await api.say(THREAD, ALICE, f"{MENTION} whoami")
    [reply] = await api.wait_for_messages(THREAD)
    assert f"chat={GENERAL} thread={THREAD} user={ALICE} " in reply.text
    assert key_of(reply.text) == f"main:discord:group:{GENERAL}:{THREAD}"
    await api.say(THREAD, BOB, f"{MENTION} whoami")
    replies = await api.wait_for_messages(THREAD, 2)
    assert key_of(replies[1].text) == key_of(reply.text)  # a thread is one session
    assert api.messages(GENERAL) == []


@pytest.mark.parametrize("announce", [True, False])
async def test_a_new_thread_is_read_as_a_thread(
    api: DiscordApi, bot: Running, announce: bool
) -> None:
    thread = await api.thread(RANDOM, announce=announce)
    await api.say(thread, ALICE, f"{MENTION} whoami")
    [reply] = await api.wait_for_messages(thread)
    assert key_of(reply.text) == f"main:discord:group:{RANDOM}:{thread}"
    assert ("channels.get" in api.calls) is not announce  # unknown to the cache: looked up


@pytest.mark.parametrize(
    "fields",
    [
        {"bot": True},
        {"webhook_id": "960000000000000001"},
        {"type": 7},  # a member joined
        {"type": 18},  # a thread was created
        {"system": True},  # Discord's own notice, from its system user
    ],
)
async def test_bots_webhooks_and_system_messages_are_ignored(
    api: DiscordApi, bot: Running, fields: dict[str, Any]
) -> None:
    dm = api.dm_channel(ALICE)
    await api.say(dm, OTHER_BOT, "echo me", **fields)
    await api.say(dm, BOT_ID, "my own words")
    await api.say(dm, ALICE, "and this")
    await api.wait_for_messages(dm)
    await bot.idle()
    assert api.texts(dm) == ["echo: and this"]


async def test_allow_bots_reads_other_bots_but_never_itself(
    api: DiscordApi, tmp_path: Path
) -> None:
    async with running(discord_config(api, tmp_path, allow_bots=True)) as r:
        await api.say(GENERAL, BOT_ID, f"{MENTION} my own words", bot=True)
        await api.say(GENERAL, OTHER_BOT, f"{MENTION} from a bot", bot=True)
        await api.wait_for_messages(GENERAL)
        await r.idle()
    assert api.texts(GENERAL) == ["echo: from a bot"]


async def test_messages_in_one_channel_are_answered_in_order(api: DiscordApi, bot: Running) -> None:
    dm = api.dm_channel(ALICE)
    for n in range(5):
        await api.say(dm, ALICE, f"message {n}")
    await api.wait_for_messages(dm, 5)
    await bot.idle()
    assert api.texts(dm) == [f"echo: message {n}" for n in range(5)]


async def test_a_message_the_hub_cannot_take_gets_a_notice(
    api: DiscordApi, bot: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def failing(message: InboundMessage) -> DispatchResult:
        raise StoreError("the store is down")

    monkeypatch.setattr(bot.hub, "submit", failing)
    await api.say(THREAD, ALICE, f"{MENTION} hi")
    [notice] = await api.wait_for_messages(THREAD)
    assert notice.text == "Sorry — your message could not be handled right now; please try again."


async def test_the_channel_shows_the_bot_typing_while_it_works(
    api: DiscordApi, bot: Running
) -> None:
    await api.say(THREAD, ALICE, f"{MENTION} sleep 30")
    await api.wait_for(lambda: "typing" in api.calls)
    assert bot.adapter.typing is not None
    assert bot.adapter.typing.showing() == [Target("discord", str(GENERAL), str(THREAD))]


# -- odd input -----------------------------------------------------------------------


async def test_empty_and_mention_only_messages_are_ignored(api: DiscordApi, bot: Running) -> None:
    dm = api.dm_channel(ALICE)
    await api.say(dm, ALICE, "")
    await api.say(dm, ALICE, "   \n ")
    await api.say(GENERAL, ALICE, f" {MENTION} ")
    await api.say(dm, ALICE, "real")
    await api.wait_for_messages(dm)
    await bot.idle()
    assert api.texts(dm) == ["echo: real"]
    assert api.messages(GENERAL) == []


async def test_odd_unicode_comes_through_and_a_lone_surrogate_is_replaced(
    api: DiscordApi, bot: Running
) -> None:
    dm = api.dm_channel(ALICE)
    text = "👩‍👩‍👧 e\u0301 🇩🇪 \u202eabc \x00 end \ud800!"
    await api.say(dm, ALICE, text)
    [reply] = await api.wait_for_messages(dm)
    assert reply.text == "echo: " + text.replace("\ud800", "\ufffd")


async def test_a_huge_message_gets_a_reply_in_parts_that_fit(api: DiscordApi, bot: Running) -> None:
    dm = api.dm_channel(ALICE)
    text = "🙂" * 2500 + "\n" + "x" * 20_000
    await api.say(dm, ALICE, text)
    await api.wait_for(lambda: "".join(api.texts(dm)) == "echo: " + text)
    parts = api.texts(dm)
    assert len(parts) > 11
    assert all(len(part.encode("utf-16-le")) // 2 <= MESSAGE_LIMIT for part in parts)
    assert parts[0].startswith("echo: 🙂")


async def test_an_event_discord_py_cannot_read_costs_a_reconnect_not_the_bot(
    api: DiscordApi, bot: Running, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="chatlane.adapters.discord"):
        await api.dispatch("INTERACTION_CREATE", {"id": "1", "type": 3})  # no token, no data
        await api.wait_for(lambda: api.sessions == 2)
    assert "an event could not be read; reconnecting" in caplog.text
    dm = api.dm_channel(ALICE)
    await api.say(dm, ALICE, "still here")
    [reply] = await api.wait_for_messages(dm)
    assert reply.text == "echo: still here"


# -- who may talk --------------------------------------------------------------------


async def test_a_stranger_is_told_once_an_hour_in_a_dm_and_never_in_a_server(
    api: DiscordApi, tmp_path: Path
) -> None:
    clock = Clock()
    config = discord_config(api, tmp_path, allowed_users=[str(ALICE)])
    async with running(config, clock=clock) as r:
        bob_dm, alice_dm = api.dm_channel(BOB), api.dm_channel(ALICE)
        for _ in range(2):
            await api.say(bob_dm, BOB, "hello")
        await api.say(GENERAL, CAROL, f"{MENTION} hello")
        await api.say(alice_dm, ALICE, "hello")
        await api.wait_for_messages(alice_dm)
        await r.idle()
        assert api.texts(bob_dm) == [NOT_ALLOWED]
        assert api.messages(GENERAL) == []
        assert r.hub.metrics.senders_refused["discord"] == 3
        clock.now += REFUSAL_INTERVAL
        await api.say(bob_dm, BOB, "hello")
        await api.wait_for_messages(bob_dm, 2)
    assert api.texts(bob_dm) == [NOT_ALLOWED] * 2


async def test_allowed_channels_and_guilds_limit_where_the_bot_answers(
    api: DiscordApi, tmp_path: Path
) -> None:
    config = discord_config(
        api, tmp_path, allowed_channels=[str(GENERAL)], allowed_guilds=[str(GUILD)]
    )
    async with running(config) as r:
        await api.say(RANDOM, ALICE, f"{MENTION} not here")
        await api.say(ELSEWHERE, ALICE, f"{MENTION} another server")
        await api.say(THREAD, ALICE, f"{MENTION} in a thread of general")
        dm = api.dm_channel(ALICE)
        await api.say(dm, ALICE, "hello")
        await api.wait_for_messages(THREAD)
        await api.wait_for_messages(dm)
        await r.idle()
        assert r.hub.metrics.senders_refused["discord"] == 1  # RANDOM; ELSEWHERE is ignored
    assert api.messages(RANDOM) == api.messages(ELSEWHERE) == []


async def test_a_server_not_in_the_cache_is_read_as_that_server_not_as_a_dm(
    api: DiscordApi, tmp_path: Path
) -> None:
    """A server whose ``GUILD_CREATE`` has not come (made after the bot connected)."""
    config = discord_config(api, tmp_path, allowed_guilds=[str(GUILD)])
    async with running(config) as r:
        unseen = api.unannounced_channel(OTHER_GUILD + 1, "unseen")
        await api.say(unseen, ALICE, f"{MENTION} whoami")  # a server not allowed
        await r.idle()
    assert api.messages(unseen) == []
    async with running(discord_config(api, tmp_path)) as r:
        unseen = api.unannounced_channel(OTHER_GUILD + 2, "unseen too")
        await api.say(unseen, ALICE, "whoami")  # a server's message names the bot
        await api.say(unseen, BOB, f"{MENTION} whoami")
        [reply] = await api.wait_for_messages(unseen)
        await r.idle()
    assert key_of(reply.text) == f"main:discord:group:{unseen}::{BOB}"  # a server channel's
    assert f"user={BOB} " in reply.text
    assert len(api.messages(unseen)) == 1


# -- approvals -----------------------------------------------------------------------


async def test_approval_buttons_count_only_from_the_asker(api: DiscordApi, bot: Running) -> None:
    await api.say(THREAD, ALICE, f"{MENTION} approve rm -rf build")
    [prompt] = await api.wait_for_messages(THREAD)
    asks = Asks("rm -rf build", "the demo agent asks")
    assert prompt.text == markdown_prompt(asks, discord.utils.escape_markdown)
    approve = prompt.button("Approve")
    assert approve["custom_id"].endswith(f":{ALICE}")
    foreign = await api.press(BOB, prompt, approve)
    await api.wait_for(lambda: len(api.answers) == 1)
    assert api.answers[0][0] == foreign
    assert api.answers[0][1]["type"] == 4
    assert api.answers[0][1]["data"]["content"] == f"Only <@{ALICE}> can answer this approval."
    assert api.answers[0][1]["data"]["flags"] == 64  # ephemeral
    await api.press(ALICE, prompt, approve)
    sent = await api.wait_for_messages(THREAD, 3)
    assert [s.text for s in sent[1:]] == [
        "Approved (once): `rm -rf build`",
        "approved: rm -rf build",
    ]
    assert api.answers[1][1] == {"type": 6}


async def test_a_press_is_answered_at_once_and_its_answer_sent_in_order(
    api: DiscordApi, bot: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Discord wants a press answered within three seconds: the answer does not wait for
    the channel's messages before it; the /approve it sends still comes after them."""
    dm = api.dm_channel(ALICE)
    await api.say(dm, ALICE, "approve rm x")
    [prompt] = await api.wait_for_messages(dm)
    storing, release = asyncio.Event(), asyncio.Event()
    submitted: list[str] = []
    submit = bot.hub.submit

    async def slow(message: InboundMessage) -> DispatchResult:
        submitted.append(message.text)
        if message.text == "later":
            storing.set()
            await release.wait()  # a store write that takes a while
        return await submit(message)

    monkeypatch.setattr(bot.hub, "submit", slow)
    await api.say(dm, ALICE, "later")
    async with asyncio.timeout(WAIT):
        await storing.wait()
    await api.press(ALICE, prompt, prompt.button("Approve"))
    await api.wait_for(lambda: len(api.answers) == 1)  # while "later" is still being stored
    assert api.answers[0][1] == {"type": 6}
    assert submitted == ["later"]
    release.set()
    await api.wait_for(lambda: "approved: rm x" in api.texts(dm))
    await bot.idle()
    assert [text.split(" #")[0] for text in submitted] == ["later", "/approve"]


SPOILING_COMMAND = "echo ok```\n||rm -rf ~|| [docs](https://e.example) **x** `y`"
"""A command that would end a plain code span or block and hide its second half."""


async def test_an_approval_prompt_shows_the_command_whole_in_its_code_block(
    api: DiscordApi, bot: Running
) -> None:
    dm = api.dm_channel(ALICE)
    await api.say(dm, ALICE, f"approve {SPOILING_COMMAND}")
    [prompt] = await api.wait_for_messages(dm)
    head, block, tail = prompt.text.split("```\n")  # one block: nothing in it closes it
    assert head == "Approval needed — the demo agent asks\n"
    assert block.replace(UNBREAKABLE_BACKTICK, "`") == SPOILING_COMMAND + "\n"
    assert "```" not in block
    assert tail == HOW_TO_ANSWER
    await api.press(ALICE, prompt, prompt.button("Deny"))
    sent = await api.wait_for_messages(dm, 3)
    head, block, tail = sent[1].text.split("```\n")  # the decision quotes it the same way
    assert (head, tail) == ("Denied: \n", "")
    assert block.replace(UNBREAKABLE_BACKTICK, "`") == SPOILING_COMMAND + "\n"
    assert sent[2].text == f"denied: {SPOILING_COMMAND}"


async def test_deny_in_a_dm(api: DiscordApi, bot: Running) -> None:
    dm = api.dm_channel(ALICE)
    await api.say(dm, ALICE, "approve rm x")
    [prompt] = await api.wait_for_messages(dm)
    await api.press(ALICE, prompt, prompt.button("Deny"))
    sent = await api.wait_for_messages(dm, 3)
    assert [s.text for s in sent[1:]] == ["Denied: `rm x`", "denied: rm x"]


@pytest.mark.parametrize(
    "custom_id",
    [
        "other-app:button",
        "chatlane:approve:x:1",
        "chatlane:approve:a1b2:not-a-user",
        "chatlane:approve:a1b2:1:2",
        "chatlane:nuke:a1b2:",
        ":::",
    ],
)
async def test_a_forged_or_unknown_button_is_answered_privately(
    api: DiscordApi, bot: Running, custom_id: str
) -> None:
    dm = api.dm_channel(ALICE)
    await api.say(dm, ALICE, "hi")
    [reply] = await api.wait_for_messages(dm)
    await api.press(ALICE, reply, {"custom_id": custom_id})
    await api.wait_for(lambda: len(api.answers) == 1)
    assert api.answers[0][1]["data"]["content"] == "This button is no longer active."
    await bot.idle()
    assert api.texts(dm) == ["echo: hi"]


async def test_a_press_by_a_stranger_is_refused_privately(api: DiscordApi, tmp_path: Path) -> None:
    async with running(discord_config(api, tmp_path, allowed_users=[str(ALICE)])) as r:
        await api.say(GENERAL, ALICE, f"{MENTION} approve ls")
        [prompt] = await api.wait_for_messages(GENERAL)
        button = {"custom_id": prompt.button("Approve")["custom_id"].rsplit(":", 1)[0] + ":"}
        await api.press(BOB, prompt, button)  # a prompt that names no asker
        await api.wait_for(lambda: len(api.answers) == 1)
        await r.adapter.handled()
    assert api.answers[0][1]["data"]["content"] == NOT_ALLOWED
    assert api.texts(GENERAL) == [prompt.text]


# -- replies -------------------------------------------------------------------------


async def test_a_long_reply_is_split_at_2000_with_code_fences_balanced(
    api: DiscordApi, bot: Running
) -> None:
    code = "".join(f"line {n} of the code\n" for n in range(300))
    dm = api.dm_channel(ALICE)
    await api.say(dm, ALICE, f"look:\n```python\n{code}```\ndone")
    parts = await api.wait_for_messages(dm, 4)
    await bot.idle()
    parts = api.messages(dm)
    assert all(len(p.text) <= MESSAGE_LIMIT for p in parts)
    assert all(p.text.count("```") % 2 == 0 for p in parts)
    assert parts[1].text.startswith("```\n")


async def test_nothing_sent_pings_anyone(api: DiscordApi, bot: Running) -> None:
    dm = api.dm_channel(ALICE)
    await api.say(dm, ALICE, "@everyone <@950000000000000002>")
    [reply] = await api.wait_for_messages(dm)
    assert reply.text == "echo: @everyone <@950000000000000002>"
    assert reply.allowed_mentions is not None
    assert reply.allowed_mentions["parse"] == []


async def test_a_stream_is_shown_as_one_message_edited_in_place(
    api: DiscordApi, tmp_path: Path
) -> None:
    async with running(discord_config(api, tmp_path), edit_interval=0.05) as r:
        dm = api.dm_channel(ALICE)
        await api.say(dm, ALICE, "stream 10")
        final = "".join(f"{n}\n" for n in range(1, 11))
        await api.wait_for(lambda: api.texts(dm) == [final])
        await r.idle()
    [shown] = api.messages(dm)
    assert "messages.edit" in api.calls
    assert shown.edits
    assert all(final.startswith(edit.removesuffix(" …")) for edit in shown.edits)


async def show_draft(
    r: Running, api: DiscordApi, text: str
) -> tuple[int, SessionKey, Target, Posted]:
    """A stream's first chunk ``text`` in Alice's DM, shown as its draft: the DM's channel,
    the key, the target and the draft."""
    dm = api.dm_channel(ALICE)
    key, target = chat_key(str(dm), "discord"), Target("discord", str(dm))
    await r.adapter.deliver(Outbound(OutboundKind.CHUNK, key, target, text, generation=1))
    [draft] = await api.wait_for_messages(dm)
    return dm, key, target, draft


async def test_a_draft_is_edited_then_replaced_by_the_reply(
    api: DiscordApi, tmp_path: Path
) -> None:
    async with running(discord_config(api, tmp_path), edit_interval=0.01) as r:
        dm, key, target, _ = await show_draft(r, api, "Hello ")
        await r.adapter.deliver(Outbound(OutboundKind.CHUNK, key, target, "world", generation=1))
        await api.wait_for(lambda: "messages.edit" in api.calls)
        reply = Outbound(OutboundKind.REPLY, key, target, "Hello world!", generation=1)
        await r.adapter.send(reply, Attempt("d_1", uncertain=False, attempts=0))
    [shown] = api.messages(dm)
    assert shown.edits == ["Hello ", "Hello world"]
    assert shown.text == "Hello world!"


async def test_an_acknowledgement_waiting_out_a_rate_limit_holds_up_no_message(
    api: DiscordApi, bot: Running
) -> None:
    """The channel's next message is held by chatlane at once, not after the
    acknowledgement's wait (Discord never sends an event again: a process ending
    meanwhile would lose it)."""
    dm = api.dm_channel(ALICE)
    source = SessionSource("discord", chat_id=str(dm), chat_type=ChatType.DM, user_id=str(ALICE))
    key = build_session_key(source)
    await api.say(dm, ALICE, "sleep 30")
    await eventually_true(lambda: bot.hub.gateway.engine.running_turn(key) is not None)
    api.fail_next("messages.create", 429, text="You are being rate limited.", retry_after=50)
    await api.say(dm, ALICE, "second")  # "Queued…" meets the limit
    third = str(await api.say(dm, ALICE, "third"))

    async def held() -> bool:
        return any(third in record.message_id for record in await bot.hub.store.pending(key))

    await eventually_true(held)  # within seconds; the limit is longer


async def test_a_reply_whose_draft_was_deleted_is_posted_anew(
    api: DiscordApi, tmp_path: Path
) -> None:
    async with running(discord_config(api, tmp_path), edit_interval=0.01) as r:
        dm, key, target, draft = await show_draft(r, api, "Hel")
        api.delete(draft)  # by a moderator, before the reply replaced it
        reply = Outbound(OutboundKind.REPLY, key, target, "Hello!", generation=1)
        await r.adapter.send(reply, Attempt("d_1", uncertain=False, attempts=0))
    assert api.texts(dm) == ["Hello!"]
    assert api.calls.count("messages.edit") == 1  # tried, refused: Unknown Message


async def test_a_reply_is_cut_in_the_same_places_labelled_or_not(bot: Running) -> None:
    """A part sent before is the same part again, which its nonce deduplicates: no part
    overlaps the next when a retry is labelled."""
    dm = 960000000000000001
    text = "".join(f"line {n:03}\n" for n in range(400))
    key, target = chat_key(str(dm), "discord"), Target("discord", str(dm))
    reply = Outbound(OutboundKind.REPLY, key, target, text)
    first = await bot.adapter._parts(reply, uncertain=False, nonce="d_1")
    again = await bot.adapter._parts(reply, uncertain=True, nonce="d_1")
    assert len(first.parts) > 1
    assert again.parts[0].startswith(RESENT_LABEL)
    assert [part.removeprefix(RESENT_LABEL) for part in again.parts] == first.parts
    assert all(len(part) <= MESSAGE_LIMIT for part in again.parts)


async def test_a_reply_with_nothing_visible_is_sent_as_a_placeholder(
    api: DiscordApi, tmp_path: Path
) -> None:
    """Discord posts no blank message: the user still sees the turn ended."""
    config = discord_config(api, tmp_path)
    blank = msgspec.structs.replace(config, agent=AgentConfig(name=BLANK_AGENT))
    dm = api.dm_channel(ALICE)
    async with running(blank) as r:
        await api.say(dm, ALICE, "spaces")
        await eventually(r.hub.gateway.delivery, lambda: delivered(r.hub, 1))
        await api.say(dm, ALICE, "zero-width")
        await eventually(r.hub.gateway.delivery, lambda: delivered(r.hub, 2))
    assert api.texts(dm) == [EMPTY_REPLY, EMPTY_REPLY]


# -- the delivery ledger -------------------------------------------------------------


async def test_a_short_rate_limit_is_waited_out_in_place(api: DiscordApi, bot: Running) -> None:
    api.fail_next("messages.create", 429, text="You are being rate limited.", retry_after=0.01)
    dm = api.dm_channel(ALICE)
    await api.say(dm, ALICE, "first")
    await api.say(dm, ALICE, "second")
    await api.wait_for_messages(dm, 2)
    await eventually(bot.hub.gateway.delivery, lambda: delivered(bot.hub, 2))
    done = await bot.hub.store.deliveries(DELIVERED)
    assert api.texts(dm) == ["echo: first", "echo: second"]  # in order, no label: not sent
    assert [d.attempts for d in done] == [0, 0]


async def test_a_rate_limit_that_would_outlast_the_attempt_is_not_waited_for(
    api: DiscordApi, bot: Running
) -> None:
    """A wait between parts that would end past the worker's deadline fails the attempt at
    once (the first part went out: maybe sent), instead of being cancelled mid-wait."""
    dm = api.dm_channel(ALICE)
    key, target = chat_key(str(dm), "discord"), Target("discord", str(dm))
    reply = Outbound(OutboundKind.REPLY, key, target, "word " * 1000)  # three parts
    api.fail_next(
        "messages.create", 429, text="You are being rate limited.", retry_after=45, after=1
    )
    deadline = time.monotonic() + SEND_ROOM + 10
    with pytest.raises(TransientDelivery) as failed:
        await bot.adapter.send(reply, Attempt("d_1", False, 0, deadline))
    assert failed.value.maybe_sent
    assert time.monotonic() < deadline
    assert len(api.messages(dm)) == 1


async def test_a_long_rate_limit_is_the_ledgers_to_wait(api: DiscordApi, bot: Running) -> None:
    api.fail_next("messages.create", 429, text="You are being rate limited.", retry_after=3600)
    dm = api.dm_channel(ALICE)
    key, target = chat_key(str(dm), "discord"), Target("discord", str(dm))
    reply = Outbound(OutboundKind.REPLY, key, target, "hello")
    with pytest.raises(RateLimited) as limited:
        await bot.adapter.send(reply, Attempt("d_1", uncertain=False, attempts=0))
    assert limited.value.retry_after == pytest.approx(3600, abs=5)
    assert api.messages(dm) == []


@pytest.mark.parametrize(
    ("status", "code", "text"),
    [(404, 10003, "Unknown Channel"), (403, 50001, "Missing Access")],
)
async def test_a_reply_to_a_channel_the_bot_cannot_post_in_is_dead_lettered(
    api: DiscordApi, bot: Running, status: int, code: int, text: str
) -> None:
    api.fail_next("messages.create", status, code, text)
    dm = api.dm_channel(ALICE)
    await api.say(dm, ALICE, "first")
    await eventually(bot.hub.gateway.delivery, lambda: dead(bot.hub, 1))
    await api.say(dm, ALICE, "second")
    [reply] = await api.wait_for_messages(dm)
    [gone] = await bot.hub.store.deliveries(DEAD)
    assert reply.text == "echo: second"
    assert gone.reason.startswith(f"discord: {status} ")
    assert text in gone.reason


async def test_a_later_part_refused_makes_the_dead_letter_maybe_sent(
    api: DiscordApi, bot: Running
) -> None:
    """Part 1 went out before part 2 was refused: a redelivery of the dead letter is
    labelled (past the nonce window, Discord would post part 1 again)."""
    dm = api.dm_channel(ALICE)
    key, target = chat_key(str(dm), "discord"), Target("discord", str(dm))
    reply = Outbound(OutboundKind.REPLY, key, target, "word " * 1000)  # three parts
    api.fail_next("messages.create", 403, 50013, "Missing Permissions", after=1)
    with pytest.raises(PermanentDelivery) as refused:
        await bot.adapter.send(reply, Attempt("d_1", uncertain=False, attempts=0))
    assert refused.value.maybe_sent
    assert len(api.messages(dm)) == 1


async def test_a_server_error_is_retried_with_the_label(api: DiscordApi, bot: Running) -> None:
    api.fail_next("messages.create", 503, text="Service Unavailable")
    dm = api.dm_channel(ALICE)
    await api.say(dm, ALICE, "first")
    [reply] = await api.wait_for_messages(dm)
    await eventually(bot.hub.gateway.delivery, lambda: delivered(bot.hub, 1))
    [done] = await bot.hub.store.deliveries(DELIVERED)
    assert reply.text == RESENT_LABEL + "echo: first"
    assert done.attempts == 1


async def test_a_resend_with_the_same_nonce_posts_nothing_twice(
    api: DiscordApi, bot: Running
) -> None:
    dm = api.dm_channel(ALICE)
    key, target = chat_key(str(dm), "discord"), Target("discord", str(dm))
    reply = Outbound(OutboundKind.REPLY, key, target, "only once")
    await bot.adapter.send(reply, Attempt("d_1", uncertain=False, attempts=0))
    await bot.adapter.send(reply, Attempt("d_1", uncertain=True, attempts=1))  # a lost answer
    assert api.texts(dm) == ["only once"]


async def test_a_rejected_token_pauses_the_lane_without_spending_attempts(
    api: DiscordApi, bot: Running
) -> None:
    for _ in range(2):
        api.fail_next("messages.create", 401, text="401: Unauthorized")
    dm = api.dm_channel(ALICE)
    await api.say(dm, ALICE, "first")
    [reply] = await api.wait_for_messages(dm)
    await eventually(bot.hub.gateway.delivery, lambda: delivered(bot.hub, 1))
    [done] = await bot.hub.store.deliveries(DELIVERED)
    assert (reply.text, done.attempts) == ("echo: first", 0)


async def test_without_the_ledger_a_failed_send_is_logged_and_the_bot_goes_on(
    api: DiscordApi, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = discord_config(api, tmp_path)
    config = msgspec.structs.replace(config, delivery=DeliverySettings(enabled=False))
    api.fail_next("messages.create", 403, 50001, "Missing Access")
    async with running(config) as r:
        assert r.hub.gateway.delivery is None
        dm = api.dm_channel(ALICE)
        with caplog.at_level(logging.WARNING, logger="chatlane.adapters.discord"):
            await api.say(dm, ALICE, "first")
            await api.wait_for(lambda: "messages.create" in api.calls)
            await r.hub.gateway.engine.wait_idle()  # its turn ended: "second" finds it idle
            await api.say(dm, ALICE, "second")
            [reply] = await api.wait_for_messages(dm)
    assert reply.text == "echo: second"
    assert f"discord send to {dm} failed: discord: 403 Forbidden" in caplog.text


# -- the gateway ---------------------------------------------------------------------


async def test_a_dropped_gateway_is_resumed_and_nothing_dispatched_meanwhile_is_lost(
    api: DiscordApi, bot: Running
) -> None:
    dm = api.dm_channel(ALICE)
    await api.drop()
    await api.say(dm, ALICE, "while you were away")  # dispatched with no connection open
    await api.wait_for(lambda: api.resumed == 1)
    await api.say(dm, ALICE, "after the resume")
    await api.wait_for_messages(dm, 2)
    assert api.texts(dm) == ["echo: while you were away", "echo: after the resume"]
    assert api.sessions == 1  # resumed, not identified again
    assert bot.adapter.ready()


async def test_an_invalidated_session_identifies_again(api: DiscordApi, bot: Running) -> None:
    dm = api.dm_channel(ALICE)
    api.refuse_resume = True
    await api.drop()
    await api.wait_for(lambda: api.sessions == 2)
    await api.say(dm, ALICE, "still here")
    [reply] = await api.wait_for_messages(dm)
    assert reply.text == "echo: still here"


async def test_a_shutdown_closes_the_gateway_first_and_stores_the_message_it_brought(
    api: DiscordApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Discord sends nothing more once the gateway is closed, and never sends again what it
    sent: the message whose store write is under way is stored, not cancelled."""
    store = StoreConfig(url=f"sqlite:///{tmp_path / 'chatlane.db'}")
    config = msgspec.structs.replace(discord_config(api, tmp_path), store=store)
    dm = api.dm_channel(ALICE)
    storing, release = asyncio.Event(), asyncio.Event()
    connected_when_stored: list[bool] = []
    async with running(config) as r:
        submit = r.hub.submit

        async def slow(message: InboundMessage) -> DispatchResult:
            storing.set()
            await release.wait()  # a store write that takes a while
            connected_when_stored.append(api.connected)
            return await submit(message)

        monkeypatch.setattr(r.hub, "submit", slow)
        said = await api.say(dm, ALICE, "sent as the gateway stops")
        async with asyncio.timeout(WAIT):
            await storing.wait()
        closing = asyncio.create_task(shutdown(r.hub))
        await api.wait_for(lambda: not api.connected)
        release.set()
        await closing
    assert connected_when_stored == [False]
    hub = await open_hub(config)  # the next start
    try:
        source = SessionSource(
            "discord", chat_id=str(dm), chat_type=ChatType.DM, user_id=str(ALICE)
        )
        pending = await hub.store.pending(build_session_key(source))
    finally:
        await shutdown(hub)
    assert [record.message_id for record in pending] == [f"discord-{said}-{ALICE}"]


async def test_a_shutdown_gives_a_store_write_that_never_ends_up(
    api: DiscordApi,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(discord_adapter, "CLOSE_WAIT", 0.01)
    storing = asyncio.Event()
    async with running(discord_config(api, tmp_path)) as r:

        async def stuck(message: InboundMessage) -> DispatchResult:
            storing.set()
            await asyncio.Event().wait()  # a store that never answers
            raise AssertionError("unreachable")

        monkeypatch.setattr(r.hub, "submit", stuck)
        await api.say(api.dm_channel(ALICE), ALICE, "hello")
        async with asyncio.timeout(WAIT):
            await storing.wait()
        with caplog.at_level(logging.WARNING, logger="chatlane.adapters"):
            await shutdown(r.hub)  # returns: the write was cancelled after CLOSE_WAIT
    assert not r.adapter.ready()
    assert "1 Discord jobs not done after 0.01s were cancelled" in caplog.text


# -- starting ------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def started(config: Config) -> AsyncIterator[DiscordAdapter]:
    """The adapter started on its own, on a hub that is not served."""
    hub = await open_hub(config)
    adapter = DiscordAdapter(config)
    try:
        await adapter.start(hub)
        yield adapter
    finally:
        await adapter.aclose()
        await shutdown(hub)


async def test_a_missing_token_is_a_config_error(api: DiscordApi, tmp_path: Path) -> None:
    config = discord_config(api, tmp_path)
    settings = msgspec.structs.replace(config.discord, token=Secret(env="UNSET_IN_TESTS"))
    with pytest.raises(ConfigError, match="discord is enabled but has no bot token"):
        async with started(msgspec.structs.replace(config, discord=settings)):
            pass
    assert api.calls == []


async def test_a_rejected_token_is_a_config_error(api: DiscordApi, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="rejected the bot token") as caught:
        async with started(discord_config(api, tmp_path, token="wrong.token")):
            pass
    assert "wrong.token" not in str(caught.value)


async def test_an_unreachable_api_is_a_config_error(tmp_path: Path) -> None:
    api = DiscordApi()  # never started
    api.port = free_port()
    with pytest.raises(ConfigError, match=f"the Discord API at {api.url} failed"):
        async with started(discord_config(api, tmp_path)):
            pass


async def test_a_refused_message_content_intent_is_a_config_error(tmp_path: Path) -> None:
    async with DiscordApi(privileged=False) as api:
        with pytest.raises(ConfigError, match="Message Content intent"):
            async with started(discord_config(api, tmp_path)):
                pass


async def test_without_message_content_the_bot_still_answers_mentions(tmp_path: Path) -> None:
    async with DiscordApi(privileged=False) as api:
        async with running(discord_config(api, tmp_path, message_content=False)):
            await api.say(GENERAL, ALICE, f"{MENTION} hello")
            [reply] = await api.wait_for_messages(GENERAL)
        assert not api.identified[0]["intents"] & (1 << 15)
    assert reply.text == "echo: hello"


def serve_env(**env: str) -> dict[str, str]:
    """The environment of ``chatlane serve`` with nothing of Discord's but ``env``."""
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("CHATLANE_") and k != "DISCORD_BOT_TOKEN"
    }
    return {**base, "CHATLANE_DISCORD__ENABLED": "true", **env}


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "Error: discord is enabled but has no bot token: set DISCORD_BOT_TOKEN"),
        (
            {"CHATLANE_DISCORD__TOKEN": '{ file = "/nonexistent/discord-token" }'},
            "secret file '/nonexistent/discord-token': No such file or directory",
        ),
        (
            {"DISCORD_BOT_TOKEN": "s3cret", "CHATLANE_DISCORD__API_URL": "http://127.0.0.1:9/api"},
            "the Discord API at http://127.0.0.1:9/api failed",
        ),
        (
            {"DISCORD_BOT_TOKEN": "s3cret", "CHATLANE_DISCORD__API_URL": "discord.com"},
            "configuration key 'discord.api_url' = 'discord.com': expected an http(s) URL",
        ),
        (
            {"DISCORD_BOT_TOKEN": "s3cret", "CHATLANE_DISCORD__APP_TOKEN": "x"},
            "unknown configuration key 'discord.app_token'",
        ),
        (
            {"DISCORD_BOT_TOKEN": "s3cret", "CHATLANE_DISCORD__ALLOWED_USERS": '["12:34"]'},
            "configuration key 'discord.allowed_users' = ['12:34']: expected a list of Discord ids",
        ),
        (
            {"DISCORD_BOT_TOKEN": "s3cret", "CHATLANE_DISCORD__REQUIRE_MENTION": "sometimes"},
            "configuration key 'discord.require_mention'",
        ),
    ],
)
def test_serve_with_a_broken_discord_configuration_stops_in_one_line(
    tmp_path: Path, env: dict[str, str], message: str
) -> None:
    result = serve_once(tmp_path, serve_env(**env))
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[-1]  # after discord.py's "logging in …", if any
    assert message in line
    assert "Traceback" not in result.stderr
    assert "s3cret" not in result.stderr
