"""Telegram files: photos, documents, voice, audio and video reach the agent as attachments,
through python-telegram-bot and the local Bot API stand-in, with a real hub, the demo agent
and a real store behind it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from telegram import Update

from chatlane.adapters.telegram_media import attachment_of
from chatlane.config import Config, TelegramConfig, check_config
from chatlane.errors import ConfigError
from chatlane.hub import Hub
from chatlane.types import Attachment, AttachmentKind
from tests.adapters.botapi import BotApi, Sent
from tests.adapters.test_telegram import ALICE, BOB, GROUP, running, telegram_config
from tests.keys import chat_key

ALICE_KEY = chat_key(str(ALICE), "telegram")


@pytest.fixture
async def api() -> AsyncIterator[BotApi]:
    async with BotApi() as api:
        yield api
    assert api.unknown == [], f"the adapter called methods the stand-in lacks: {api.unknown}"


def photo_sizes(stem: str = "p") -> list[dict[str, Any]]:
    """A photo as Telegram sends it: several sizes, the largest last."""
    return [
        {
            "file_id": f"{stem}-s",
            "file_unique_id": "us",
            "width": 90,
            "height": 68,
            "file_size": 900,
        },
        {
            "file_id": f"{stem}-l",
            "file_unique_id": "ul",
            "width": 1280,
            "height": 960,
            "file_size": 12_345,
        },
    ]


def document(name: str, size: int, mime_type: str = "application/pdf") -> dict[str, Any]:
    return {
        "file_id": f"doc-{size}",
        "file_unique_id": f"u{size}",
        "file_name": name,
        "mime_type": mime_type,
        "file_size": size,
    }


VOICE = {
    "file_id": "voice-1",
    "file_unique_id": "uv",
    "duration": 3,
    "mime_type": "audio/ogg",
    "file_size": 4096,
}


def capped(config: Config, cap: int) -> Config:
    """``config`` with files over ``cap`` bytes refused."""
    telegram = msgspec.structs.replace(config.telegram, max_attachment_bytes=cap)
    return msgspec.structs.replace(config, telegram=telegram)


async def stored_files(hub: Hub) -> list[tuple[str, tuple[Attachment, ...]]]:
    """Alice's user entries as the transcript keeps them: text and attachments."""
    entries = await hub.store.transcript(ALICE_KEY)
    return [(e.content, e.attachments) for e in entries if e.role == "user"]


async def next_reply(api: BotApi, chat: int = ALICE) -> Sent:
    before = len(api.sent(chat))
    return (await api.wait_for_sent(chat, before + 1))[before]


async def test_a_photo_with_a_caption_reaches_the_agent_and_is_answered(
    api: BotApi, tmp_path: Path
) -> None:
    async with running(telegram_config(api, tmp_path)) as (hub, _):
        api.push_media(ALICE, ALICE, "photo", photo_sizes(), caption="what is this?")
        [reply] = await api.wait_for_sent(ALICE)
        assert reply.text == "echo: what is this? (1 attachment: image image/jpeg 12 KB)"
        largest = Attachment(AttachmentKind.IMAGE, "p-l", "image/jpeg", 12_345)
        assert await stored_files(hub) == [("what is this?", (largest,))]


async def test_a_document_without_a_caption_is_its_attachment_alone(
    api: BotApi, tmp_path: Path
) -> None:
    async with running(telegram_config(api, tmp_path)) as (hub, _):
        api.push_media(ALICE, ALICE, "document", document("report.pdf", 1_572_864))
        [reply] = await api.wait_for_sent(ALICE)
        assert reply.text == "echo: (1 attachment: report.pdf application/pdf 1.5 MB)"
        [(text, [stored])] = await stored_files(hub)
        assert (text, stored.ref, stored.kind) == ("", "doc-1572864", AttachmentKind.DOCUMENT)


async def test_a_voice_message_audio_and_video_are_taken(api: BotApi, tmp_path: Path) -> None:
    audio = {"file_id": "a1", "file_unique_id": "ua", "duration": 200, "file_name": "song.mp3"}
    audio |= {"mime_type": "audio/mpeg", "file_size": 3_000_000}
    video = {"file_id": "v1", "file_unique_id": "uv", "width": 640, "height": 480}
    video |= {"duration": 5, "mime_type": "video/mp4", "file_size": 2048}
    async with running(telegram_config(api, tmp_path)) as (hub, _):
        api.push_media(ALICE, ALICE, "voice", VOICE)
        assert (await next_reply(api)).text == "echo: (1 attachment: voice audio/ogg 4 KB)"
        api.push_media(ALICE, ALICE, "audio", audio, caption="listen")
        assert (await next_reply(api)).text == (
            "echo: listen (1 attachment: song.mp3 audio/mpeg 2.9 MB)"
        )
        api.push_media(ALICE, ALICE, "video", video)
        assert (await next_reply(api)).text == "echo: (1 attachment: video video/mp4 2 KB)"
        kinds = [files[0].kind for _, files in await stored_files(hub)]
        assert kinds == [AttachmentKind.VOICE, AttachmentKind.AUDIO, AttachmentKind.VIDEO]


async def test_an_oversized_document_is_refused_with_a_notice(api: BotApi, tmp_path: Path) -> None:
    async with running(capped(telegram_config(api, tmp_path), 1024 * 1024)) as (hub, _):
        api.push_media(ALICE, ALICE, "document", document("big.iso", 25 * 1024 * 1024), "keep")
        [notice] = await api.wait_for_sent(ALICE)
        assert notice.text == (
            "Sorry — “big.iso” is 25 MB; I can take files of up to 1 MB. "
            "It was not read: please send a smaller one."
        )
        api.push_media(ALICE, ALICE, "photo", photo_sizes())  # 12 KB: under the cap
        assert (await next_reply(api)).text == "echo: (1 attachment: image image/jpeg 12 KB)"
        assert [text for text, _ in await stored_files(hub)] == [""]  # the refused one never ran


async def test_an_oversized_file_from_a_stranger_gets_only_the_strangers_answer(
    api: BotApi, tmp_path: Path
) -> None:
    config = capped(telegram_config(api, tmp_path, groups={"allowed_users": [str(ALICE)]}), 10)
    async with running(config):
        api.push_media(BOB, BOB, "voice", VOICE)
        [notice] = await api.wait_for_sent(BOB)
        assert notice.text == "Sorry, you are not allowed to use this assistant."


async def test_an_odd_file_name_is_stored_on_one_line_and_cut(api: BotApi, tmp_path: Path) -> None:
    name = "../../etc/pass\nwd " + "ü" * 300 + ".txt"
    async with running(telegram_config(api, tmp_path)) as (hub, _):
        api.push_media(ALICE, ALICE, "document", document(name, 10, "Text/Plain"))
        [reply] = await api.wait_for_sent(ALICE)
        [(_, [stored])] = await stored_files(hub)
        assert stored.name.startswith("../../etc/pass wd üü")
        assert stored.name.endswith("….txt")
        assert len(stored.name) == 255
        assert stored.mime_type == "text/plain"
        assert reply.text == f"echo: (1 attachment: {stored.name} text/plain 10 bytes)"


async def test_in_a_group_a_file_needs_a_mention_in_its_caption_or_a_reply(
    api: BotApi, tmp_path: Path
) -> None:
    async with running(telegram_config(api, tmp_path, groups={})):
        api.push_media(GROUP, ALICE, "photo", photo_sizes("a"), chat_type="supergroup")
        api.push_media(GROUP, ALICE, "voice", VOICE, "for everyone", chat_type="supergroup")
        api.push_media(
            GROUP, ALICE, "photo", photo_sizes("b"), "@chatlane_bot look", chat_type="supergroup"
        )
        [first] = await api.wait_for_sent(GROUP)  # updates run in order: the others were ignored
        assert first.text == "echo: look (1 attachment: image image/jpeg 12 KB)"
        api.push_message(
            GROUP,
            ALICE,
            {"voice": VOICE, "reply_to_message": api._message(first, api._chats[GROUP])},
            chat_type="supergroup",
        )
        assert (await next_reply(api, GROUP)).text == "echo: (1 attachment: voice audio/ogg 4 KB)"


async def test_attachments_survive_a_restart_in_the_durable_queue(
    api: BotApi, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'chatlane.db'}"
    config = telegram_config(api, tmp_path)
    async with running(config, store_url=url):
        api.push_text(ALICE, ALICE, "approve deploy")  # holds the turn until answered
        await api.wait_for(lambda: any(s.reply_markup for s in api.sent(ALICE)))
        api.push_media(ALICE, ALICE, "photo", photo_sizes(), caption="after restart")
        await api.wait_for(lambda: api.sent(ALICE)[-1].text.startswith("Queued for the next"))
    async with running(config, store_url=url) as (hub, _):  # both messages are adopted
        prompts = sum(1 for s in api.sent(ALICE) if s.reply_markup)
        await api.wait_for(lambda: sum(1 for s in api.sent(ALICE) if s.reply_markup) > prompts)
        api.push_text(ALICE, ALICE, "/deny")
        expected = "echo: after restart (1 attachment: image image/jpeg 12 KB)"
        await api.wait_for(lambda: api.sent(ALICE)[-1].text == expected)
        largest = Attachment(AttachmentKind.IMAGE, "p-l", "image/jpeg", 12_345)
        assert (await stored_files(hub))[-1] == ("after restart", (largest,))


def media_update(fields: dict[str, Any]) -> Update:
    """A private message from Alice carrying ``fields``, parsed as polling parses it."""
    chat = {"id": ALICE, "type": "private", "first_name": "Alice"}
    message = {"message_id": 9, "date": 0, "chat": chat, **fields}
    return Update.de_json({"update_id": 1, "message": message}, None)


def test_a_video_note_and_an_animation_are_videos() -> None:
    note = {"file_id": "n1", "file_unique_id": "un", "length": 240, "duration": 2}
    gif = {"file_id": "g1", "file_unique_id": "ug", "width": 1, "height": 1, "duration": 1}
    gif |= {"file_name": "fun.mp4", "mime_type": "video/mp4", "file_size": 50}
    as_document = document("fun.mp4", 50, "video/mp4")
    found = [
        attachment_of(media_update(fields).effective_message)  # type: ignore[arg-type]
        for fields in ({"video_note": note}, {"animation": gif, "document": as_document})
    ]
    assert found == [
        Attachment(AttachmentKind.VIDEO, "n1", "video/mp4"),
        Attachment(AttachmentKind.VIDEO, "g1", "video/mp4", 50, "fun.mp4"),
    ]


def test_a_sticker_or_a_text_has_no_attachment() -> None:
    sticker = {"file_id": "s1", "file_unique_id": "u1", "type": "regular", "width": 1}
    sticker |= {"height": 1, "is_animated": False, "is_video": False}
    for fields in ({"sticker": sticker}, {"text": "hi"}):
        assert attachment_of(media_update(fields).effective_message) is None  # type: ignore[arg-type]


def test_the_cap_must_be_a_positive_number_of_bytes() -> None:
    with pytest.raises(ConfigError, match=r"'telegram\.max_attachment_bytes' = 0"):
        check_config(Config(telegram=TelegramConfig(max_attachment_bytes=0)))
    assert TelegramConfig().max_attachment_bytes == 20 * 1024 * 1024
