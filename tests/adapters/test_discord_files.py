"""Discord files: a message's attachments reach the agent as chatlane attachments, through
the real discord.py client and the gateway and REST stand-in, with a real hub, the demo
agent and a store behind it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from chatlane.config import Config, DiscordConfig, check_config
from chatlane.errors import ConfigError
from chatlane.hub import Hub
from chatlane.identity import ChatType, SessionKey, SessionSource, build_session_key
from chatlane.types import Attachment, AttachmentKind
from tests.adapters.discordapi import GENERAL, DiscordApi, attachment, voice_note
from tests.adapters.test_discord import (
    ALICE,
    BOB,
    MENTION,
    NOT_ALLOWED,
    Running,
    discord_config,
    running,
)
from tests.keys import chat_key

MB = 1024 * 1024


@pytest.fixture
async def api() -> AsyncIterator[DiscordApi]:
    async with DiscordApi() as api:
        yield api
    assert api.unknown == [], f"the adapter called routes the stand-in lacks: {api.unknown}"


@pytest.fixture
async def bot(api: DiscordApi, tmp_path: Path) -> AsyncIterator[Running]:
    async with running(discord_config(api, tmp_path)) as r:
        yield r


async def stored_files(hub: Hub, key: SessionKey) -> list[tuple[str, tuple[Attachment, ...]]]:
    """The user entries of session ``key`` as the transcript keeps them: text and files."""
    entries = await hub.store.transcript(key)
    return [(e.content, e.attachments) for e in entries if e.role == "user"]


def dm_key(dm: int) -> SessionKey:
    return chat_key(str(dm), "discord")


async def test_an_image_with_a_mention_in_a_server_channel_reaches_the_agent(
    api: DiscordApi, bot: Running
) -> None:
    cat = attachment(GENERAL, "cat.png", 12_288, "image/png", width=640, height=480)
    await api.say(GENERAL, ALICE, f"{MENTION} what is it?", attachments=[cat])
    [reply] = await api.wait_for_messages(GENERAL)
    assert reply.text == "echo: what is it? (1 attachment: cat.png image/png 12 KB)"
    source = SessionSource(
        "discord", chat_id=str(GENERAL), chat_type=ChatType.GROUP, user_id=str(ALICE)
    )
    [(text, [stored])] = await stored_files(bot.hub, build_session_key(source))
    assert text == "what is it?"
    assert stored == Attachment(AttachmentKind.IMAGE, cat["url"], "image/png", 12_288, "cat.png")
    assert stored.is_url


async def test_in_a_server_a_file_without_a_mention_is_not_for_the_bot(
    api: DiscordApi, bot: Running
) -> None:
    await api.say(GENERAL, ALICE, "", attachments=[attachment(GENERAL, "a.png", 10, "image/png")])
    mentioned = [attachment(GENERAL, "b.png", 10, "image/png")]
    await api.say(GENERAL, ALICE, MENTION, attachments=mentioned)
    [reply] = await api.wait_for_messages(GENERAL)
    await bot.idle()
    assert api.texts(GENERAL) == [reply.text] == ["echo: (1 attachment: b.png image/png 10 bytes)"]


async def test_a_dm_with_a_document_and_no_text_is_its_attachment_alone(
    api: DiscordApi, bot: Running
) -> None:
    dm = api.dm_channel(ALICE)
    report = attachment(dm, "report.pdf", 1_572_864, "application/pdf")
    await api.say(dm, ALICE, "", attachments=[report])
    [reply] = await api.wait_for_messages(dm)
    assert reply.text == "echo: (1 attachment: report.pdf application/pdf 1.5 MB)"
    [(text, [stored])] = await stored_files(bot.hub, dm_key(dm))
    assert (text, stored.kind, stored.ref) == ("", AttachmentKind.DOCUMENT, report["url"])


async def test_a_voice_message_is_voice_and_other_files_keep_their_kinds(
    api: DiscordApi, bot: Running
) -> None:
    dm = api.dm_channel(ALICE)
    await api.say(dm, ALICE, "", **voice_note(dm, 4096))
    [reply] = await api.wait_for_messages(dm)
    assert reply.text == "echo: (1 attachment: voice-message.ogg audio/ogg 4 KB)"
    files = [
        attachment(dm, "song.mp3", 3_000_000, "audio/mpeg"),
        attachment(dm, "clip.mp4", 2048, "video/mp4"),
        attachment(dm, "data", 5),  # no content type: a document
    ]
    await api.say(dm, ALICE, "and these", attachments=files)
    replies = await api.wait_for_messages(dm, 2)
    assert replies[1].text == (
        "echo: and these (3 attachments: song.mp3 audio/mpeg 2.9 MB; "
        "clip.mp4 video/mp4 2 KB; data 5 bytes)"
    )
    stored = [files for _, files in await stored_files(bot.hub, dm_key(dm))]
    kinds = [[f.kind for f in message] for message in stored]
    assert kinds == [
        [AttachmentKind.VOICE],
        [AttachmentKind.AUDIO, AttachmentKind.VIDEO, AttachmentKind.DOCUMENT],
    ]


async def test_an_oversized_file_is_refused_with_a_notice(api: DiscordApi, tmp_path: Path) -> None:
    async with running(discord_config(api, tmp_path, max_attachment_bytes=MB)) as r:
        dm = api.dm_channel(ALICE)
        big = attachment(dm, "backup.tar", 25 * MB, "application/x-tar")
        small = attachment(dm, "notes.txt", 5, "text/plain; charset=utf-8")
        await api.say(dm, ALICE, "keep both", attachments=[small, big])
        [notice] = await api.wait_for_messages(dm)
        assert notice.text == (
            "Sorry — “backup.tar” is 25 MB; I can take files of up to 1 MB. "
            "It was not read: please send a smaller one."
        )
        await api.say(dm, ALICE, "", attachments=[small])
        replies = await api.wait_for_messages(dm, 2)
        assert replies[1].text == (
            "echo: (1 attachment: notes.txt text/plain; charset=utf-8 5 bytes)"
        )
        assert [text for text, _ in await stored_files(r.hub, dm_key(dm))] == [""]


async def test_an_oversized_file_from_a_stranger_gets_only_the_strangers_answer(
    api: DiscordApi, tmp_path: Path
) -> None:
    config = discord_config(api, tmp_path, max_attachment_bytes=10, allowed_users=[str(ALICE)])
    async with running(config) as r:
        dm = api.dm_channel(BOB)
        await api.say(dm, BOB, "", **voice_note(dm, 4096))
        await api.wait_for_messages(dm)
        await r.idle()
        assert api.texts(dm) == [NOT_ALLOWED]


async def test_an_odd_file_name_is_stored_on_one_line_and_cut(
    api: DiscordApi, bot: Running
) -> None:
    dm = api.dm_channel(ALICE)
    name = "../../etc/pass\nwd " + "ü" * 300 + ".txt"
    await api.say(dm, ALICE, "", attachments=[attachment(dm, name, 10, "Text/Plain")])
    [reply] = await api.wait_for_messages(dm)
    [(_, [stored])] = await stored_files(bot.hub, dm_key(dm))
    assert stored.name.startswith("../../etc/pass wd üü")
    assert stored.name.endswith("….txt")
    assert (len(stored.name), stored.mime_type) == (255, "text/plain")
    assert reply.text == f"echo: (1 attachment: {stored.name} text/plain 10 bytes)"


def test_the_cap_must_be_a_positive_number_of_bytes() -> None:
    with pytest.raises(ConfigError, match=r"'discord\.max_attachment_bytes' = -1"):
        check_config(Config(discord=DiscordConfig(max_attachment_bytes=-1)))
    assert DiscordConfig().max_attachment_bytes == 25 * MB
