"""Slack files: a message's files reach the agent as attachments, through signed events to
the gateway's real routes, slack-sdk and the Web API stand-in, with a real hub, the demo
agent and a store behind it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from chatlane.adapters.slack_files import files_of
from chatlane.config import Config, SlackConfig, check_config
from chatlane.errors import ConfigError
from chatlane.hub import Hub
from chatlane.identity import ChatType, SessionKey, SessionSource, build_session_key
from chatlane.types import Attachment, AttachmentKind
from tests.adapters.slackapi import SlackApi
from tests.adapters.test_slack import (
    ALICE,
    ALICE_DM,
    BOB,
    BOB_DM,
    GENERAL,
    MENTION,
    NOT_ALLOWED,
    Served,
    served,
    slack_config,
)
from tests.keys import chat_key

ALICE_KEY = chat_key(ALICE_DM, "slack")
TOO_LARGE = (
    "Sorry — “backup.tar” is 25 MB; I can take files of up to 1 MB. "
    "It was not read: please send a smaller one."
)


@pytest.fixture
async def api() -> AsyncIterator[SlackApi]:
    async with SlackApi() as api:
        yield api
    assert api.unknown == [], f"the adapter called methods the stand-in lacks: {api.unknown}"


@pytest.fixture
async def gateway(api: SlackApi, tmp_path: Path) -> AsyncIterator[Served]:
    async with served(slack_config(api, tmp_path)) as s:
        yield s


async def share(s: Served, channel: str, user: str, text: str, *files: Any, **fields: Any) -> str:
    """``user`` shares ``files`` in ``channel`` with ``text``, as Slack sends it; its ts."""
    return await s.slack.message(
        channel, user, text, subtype="file_share", files=list(files), **fields
    )


async def stored_files(
    hub: Hub, key: SessionKey = ALICE_KEY
) -> list[tuple[str, tuple[Attachment, ...]]]:
    """The user entries of session ``key`` as the transcript keeps them: text and files."""
    entries = await hub.store.transcript(key)
    return [(e.content, e.attachments) for e in entries if e.role == "user"]


async def test_a_file_shared_in_a_dm_reaches_the_agent_and_can_be_fetched_with_the_token(
    api: SlackApi, gateway: Served
) -> None:
    report = api.share("report.pdf", "application/pdf", b"%PDF-1.7 " * 200_000)
    await share(gateway, ALICE_DM, ALICE, "", report)
    [reply] = await api.wait_for_messages(ALICE_DM)
    assert reply.text == "echo: (1 attachment: report.pdf application/pdf 1.7 MB)"
    [(text, [stored])] = await stored_files(gateway.hub)
    assert (text, stored.kind, stored.ref) == ("", AttachmentKind.DOCUMENT, report["url_private"])
    async with httpx.AsyncClient() as http:  # as an agent fetches it
        fetched = await http.get(stored.ref, headers={"Authorization": f"Bearer {api.token}"})
        anonymous = await http.get(stored.ref)
    assert (fetched.status_code, fetched.content) == (200, b"%PDF-1.7 " * 200_000)
    assert (anonymous.status_code, anonymous.content) == (403, b"not signed in")


async def test_an_image_with_text_in_a_channel_thread_is_answered_in_the_thread(
    api: SlackApi, gateway: Served
) -> None:
    thread = await gateway.slack.message(GENERAL, BOB, "look at this", channel_type="channel")
    shot = api.share("shot.png", "image/png", b"\x89PNG" + bytes(12_284))
    text = f"{MENTION} what is it?"
    await share(gateway, GENERAL, ALICE, text, shot, channel_type="channel", thread_ts=thread)
    [reply] = await api.wait_for_messages(GENERAL)
    assert (reply.text, reply.thread_ts) == (
        "echo: what is it? (1 attachment: shot.png image/png 12 KB)",
        thread,
    )
    source = SessionSource("slack", chat_id=GENERAL, chat_type=ChatType.GROUP, thread_id=thread)
    [(text, [stored])] = await stored_files(gateway.hub, build_session_key(source))
    assert (text, stored.kind, stored.size) == ("what is it?", AttachmentKind.IMAGE, 12_288)


async def test_in_a_channel_a_file_without_a_mention_is_not_for_the_bot(
    api: SlackApi, gateway: Served
) -> None:
    await share(
        gateway, GENERAL, ALICE, "", api.share("a.png", "image/png"), channel_type="channel"
    )
    b = api.share("b.png", "image/png", b"png")
    await share(gateway, GENERAL, ALICE, MENTION, b, channel_type="channel")
    [reply] = await api.wait_for_messages(GENERAL)
    await gateway.hub.gateway.engine.wait_idle()
    assert api.texts(GENERAL) == [reply.text] == ["echo: (1 attachment: b.png image/png 3 bytes)"]


async def test_several_files_a_voice_clip_and_a_video_are_taken_in_order(
    api: SlackApi, gateway: Served
) -> None:
    clip = api.share("audio_message.webm", "video/webm", b"clip", subtype="slack_audio")
    song = api.share("song.mp3", "audio/mpeg", b"song")
    video = api.share("demo.mp4", "video/mp4", b"mp4", size=0)
    await share(gateway, ALICE_DM, ALICE, "listen", clip, song, video)
    [reply] = await api.wait_for_messages(ALICE_DM)
    assert reply.text == (
        "echo: listen (3 attachments: audio_message.webm video/webm 4 bytes; "
        "song.mp3 audio/mpeg 4 bytes; demo.mp4 video/mp4)"
    )
    [(_, files)] = await stored_files(gateway.hub)
    kinds = [AttachmentKind.VOICE, AttachmentKind.AUDIO, AttachmentKind.VIDEO]
    assert [f.kind for f in files] == kinds


async def test_an_oversized_file_is_refused_with_a_notice(api: SlackApi, tmp_path: Path) -> None:
    async with served(slack_config(api, tmp_path, max_attachment_bytes=1024 * 1024)) as s:
        small = api.share("notes.txt", "text/plain", b"notes")
        large = api.share("backup.tar", "application/x-tar", size=25 * 1024 * 1024)
        await share(s, ALICE_DM, ALICE, "keep both", small, large)
        [notice] = await api.wait_for_messages(ALICE_DM)
        assert notice.text == TOO_LARGE
        await share(s, ALICE_DM, ALICE, "", small)
        replies = await api.wait_for_messages(ALICE_DM, 2)
        assert replies[1].text == "echo: (1 attachment: notes.txt text/plain 5 bytes)"
        assert [text for text, _ in await stored_files(s.hub)] == [""]  # the refused one never ran


async def test_an_oversized_file_from_a_stranger_gets_only_the_strangers_answer(
    api: SlackApi, tmp_path: Path
) -> None:
    config = slack_config(api, tmp_path, max_attachment_bytes=10, allowed_users=[ALICE])
    async with served(config) as s:
        await share(s, BOB_DM, BOB, "", api.share("backup.tar", "application/x-tar", bytes(99)))
        [answer] = await api.wait_for_messages(BOB_DM)
        assert answer.text == NOT_ALLOWED


async def test_an_odd_file_name_is_stored_on_one_line_and_cut(
    api: SlackApi, gateway: Served
) -> None:
    name = "../../etc/pass\nwd " + "ü" * 300 + ".txt"
    await share(gateway, ALICE_DM, ALICE, "", api.share(name, "Text/Plain", b"0123456789"))
    [reply] = await api.wait_for_messages(ALICE_DM)
    [(_, [stored])] = await stored_files(gateway.hub)
    assert stored.name.startswith("../../etc/pass wd üü")
    assert stored.name.endswith("….txt")
    assert (len(stored.name), stored.mime_type) == (255, "text/plain")
    assert reply.text == f"echo: (1 attachment: {stored.name} text/plain 10 bytes)"


def test_what_a_file_object_gives() -> None:
    hidden = {"id": "F0HIDDEN", "file_access": "check_file_info", "created": 1}
    deleted = {"id": "F0GONE", "mode": "tombstone"}
    odd = {"url_private": "https://files.slack.com/x", "size": True, "mimetype": 3, "title": "t"}
    event = {"files": [hidden, deleted, "not a file", odd, {}]}
    assert files_of(event) == (
        Attachment(AttachmentKind.DOCUMENT, "F0HIDDEN"),
        Attachment(AttachmentKind.DOCUMENT, "https://files.slack.com/x", name="t", private=True),
    )
    assert files_of({"files": "none"}) == files_of({}) == ()


def test_the_cap_must_be_a_positive_number_of_bytes() -> None:
    with pytest.raises(ConfigError, match=r"'slack\.max_attachment_bytes' = 0"):
        check_config(Config(slack=SlackConfig(max_attachment_bytes=0)))
    assert SlackConfig().max_attachment_bytes == 20 * 1024 * 1024
