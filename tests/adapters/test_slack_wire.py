"""Slack's payloads and texts, without a network: events and presses read, mrkdwn, splitting,
drafts, configuration."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chatlane.adapters.slack_format import MESSAGE_LIMIT, split_message, to_mrkdwn
from chatlane.adapters.slack_stream import Draft, draft_text
from chatlane.adapters.slack_wire import (
    APPROVE_ACTION,
    DENY_ACTION,
    Recent,
    approval_blocks,
    author_of,
    check_secrets,
    message_id,
    read_interaction,
    read_posted,
    read_press,
)
from chatlane.config import Config, SlackConfig, SlackMode, load_config
from chatlane.errors import ConfigError, PlatformUnavailable
from chatlane.identity import ChatType, SessionSource, build_session_key
from chatlane.secrets import resolve_secrets

BOT = "UBOT0001"


def event(**fields: Any) -> dict[str, Any]:
    base = {"type": "message", "channel": "C1", "user": "U1", "text": "hi", "ts": "1.000001"}
    return {**base, **fields}


# -- events --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("channel", "channel_type", "chat_type"),
    [
        ("D1", "im", ChatType.DM),
        ("C1", "channel", ChatType.GROUP),
        ("C2", "group", ChatType.GROUP),
        ("G1", "mpim", ChatType.GROUP),
        ("G2", None, ChatType.GROUP),  # app_mention: no channel_type
    ],
)
def test_a_conversation_maps_to_a_chat_type_by_its_id(
    channel: str, channel_type: str | None, chat_type: ChatType
) -> None:
    posted = read_posted(event(channel=channel, channel_type=channel_type), BOT)
    assert posted is not None
    assert posted.chat_type is chat_type


def test_one_message_has_one_key_whichever_event_brings_it() -> None:
    fields = {"channel": "C9", "text": f"<@{BOT}> hi"}
    message = read_posted(event(**fields, channel_type="group"), BOT)
    mention = read_posted(event(**fields, type="app_mention"), BOT)
    assert message is not None
    assert mention is not None
    assert message.id == mention.id == "slack-C9-1.000001-U1"
    keys = {build_session_key(p.inbound().source) for p in (message, mention)}
    assert keys == {"main:slack:group:C9::U1"}


@pytest.mark.parametrize(
    "fields",
    [
        {"bot_id": "B1"},
        {"subtype": "bot_message"},
        {"user": BOT},
        {"subtype": "message_changed"},
        {"subtype": "message_deleted"},
        {"user": None},
        {"text": None},
        {"text": f"<@{BOT}>  "},
        {"type": "reaction_added"},
        {"subtype": ["thread_broadcast"]},  # shapes only a broken sender makes
        {"subtype": {"name": "file_share"}},
        {"type": ["message"]},
    ],
)
def test_no_message_is_read_from(fields: dict[str, Any]) -> None:
    assert read_posted(event(**fields), BOT) is None


def test_the_bots_mentions_go_and_escapes_are_undone() -> None:
    text = f"<@{BOT}> is 1 &lt; 2 &amp;&amp; <@{BOT}|bot> <@U7> &gt; x"
    posted = read_posted(event(text=text), BOT)
    assert posted is not None
    assert posted.mentions_bot
    assert posted.text == "is 1 < 2 &&  <@U7> > x"


def test_a_thread_is_the_thread_ts_unless_it_is_the_message_itself() -> None:
    reply = read_posted(event(thread_ts="0.5", parent_user_id=BOT), BOT)
    top = read_posted(event(thread_ts="1.000001"), BOT)
    assert reply is not None
    assert top is not None
    assert (reply.thread_ts, reply.parent_user) == ("0.5", BOT)
    assert top.thread_ts is None
    assert reply.inbound().source.thread_id == "0.5"


def test_the_author_of_a_turn_is_read_from_its_message_ids() -> None:
    one, two = message_id("C1", "1.1", "U1"), message_id("C1", "press1.2", "U1")
    assert author_of((one, two)) == "U1"
    assert author_of((one, message_id("C1", "1.3", "U2"))) is None
    assert author_of(("m-abc-1",)) is None
    assert author_of(()) is None


# -- presses -------------------------------------------------------------------------


def press_payload(action_id: str, value: str, **message: Any) -> dict[str, Any]:
    action = {"action_id": action_id, "value": value, "action_ts": "9.9"}
    return {
        "type": "block_actions",
        "user": {"id": "U2"},
        "channel": {"id": "C1"},
        "message": {"ts": "5.5", **message},
        "actions": [action],
    }


def test_a_press_names_its_request_its_asker_and_its_thread() -> None:
    press = read_press(press_payload(APPROVE_ACTION, "a1b2c3d4:U1", thread_ts="4.4"))
    assert press is not None
    assert (press.command, press.asker, press.thread_ts) == ("/approve #a1b2c3d4", "U1", "4.4")
    inbound = press.inbound()
    assert (inbound.text, inbound.source.user_id, inbound.id) == (
        "/approve #a1b2c3d4",
        "U2",
        "slack-C1-press9.9-U2",
    )
    deny = read_press(press_payload(DENY_ACTION, "a1:", thread_ts="5.5"))
    assert deny is not None
    assert (deny.command, deny.asker, deny.thread_ts) == ("/deny #a1", None, None)


@pytest.mark.parametrize(
    ("action_id", "value"), [("other", "a1:U1"), (APPROVE_ACTION, "rm -rf:U1"), (DENY_ACTION, "7")]
)
def test_a_button_not_ours_sends_no_command(action_id: str, value: str) -> None:
    press = read_press(press_payload(action_id, value))
    assert press is not None
    assert press.command == ""


def test_other_interactions_are_no_press() -> None:
    assert read_press({"type": "view_submission"}) is None
    assert read_press({**press_payload(APPROVE_ACTION, "a1:"), "user": "U2"}) is None
    assert read_press({**press_payload(APPROVE_ACTION, "a1:"), "actions": []}) is None


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"payload=%5B%5D",
        b"other=1",
        b"payload=%7Bx",
        b"\xff",
        b"payload=" + b"%5B" * 50_000 + b"%5D" * 50_000,  # nested past the parser's depth
    ],
)
def test_an_unreadable_interaction_is_a_value_error(body: bytes) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 (json, form and UTF-8 errors alike)
        read_interaction(body)


def test_approval_blocks_carry_the_prompt_and_two_buttons() -> None:
    section, actions = approval_blocks("Approval needed", "a1", "U1")
    assert section["text"] == {"type": "mrkdwn", "text": "Approval needed"}
    labels = [(b["text"]["text"], b["action_id"], b["value"]) for b in actions["elements"]]
    assert labels == [("Approve", APPROVE_ACTION, "a1:U1"), ("Deny", DENY_ACTION, "a1:U1")]


def test_recent_forgets_the_oldest_first() -> None:
    recent = Recent(2)
    assert recent.note("a")
    assert recent.note("b", 5.0)
    assert not recent.note("a")  # seen: now the newest
    assert recent.note("c")
    assert "b" not in recent
    assert ("a" in recent, recent.get("c")) == (True, 0.0)


# -- mrkdwn --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("markdown", "mrkdwn"),
    [
        ("**bold** and __also__", "*bold* and *also*"),
        ("*it* and _it_ and 2 * 3 * 4", "_it_ and _it_ and 2 * 3 * 4"),
        ("~~gone~~", "~gone~"),
        ("[site](https://e.com/?a=1&b=2)", "<https://e.com/?a=1&amp;b=2|site>"),
        ("[x](javascript:alert(1))", "[x](javascript:alert(1))"),
        ("# Title", "*Title*"),
        ("### **Bold** title ###", "*Bold title*"),
        ("- one\n  * two", "• one\n  • two"),
        ("> quoted <b>", "> quoted &lt;b&gt;"),
        ("a < b & c > d <!channel> <@U1>", "a &lt; b &amp; c &gt; d &lt;!channel&gt; &lt;@U1&gt;"),
        ("`**code** <x>` kept", "`**code** &lt;x&gt;` kept"),
        ("```python\nif a < b:\n    **x**\n```", "```\nif a &lt; b:\n    **x**\n```"),
        ("```\nnever closed", "```\nnever closed\n```"),
        ("```\nx\n```not a close\n```", "```\nx\n```not a close\n```"),
        ("```inline``` **b**", "```inline``` *b*"),
    ],
)
def test_markdown_becomes_mrkdwn(markdown: str, mrkdwn: str) -> None:
    assert to_mrkdwn(markdown) == mrkdwn


@given(st.text(alphabet=st.sampled_from("ab &<>*_~`[]()#-\n"), max_size=60))
def test_no_bare_angle_bracket_survives(markdown: str) -> None:
    out = to_mrkdwn(markdown)
    assert "<" not in out
    assert ">" not in out.replace("\n> ", "\n").removeprefix("> ")


def test_short_texts_stay_whole() -> None:
    assert split_message("a" * MESSAGE_LIMIT) == ["a" * MESSAGE_LIMIT]
    assert split_message("") == [""]


def test_a_split_prefers_newlines_then_spaces() -> None:
    text = "a" * 2000 + " " + "b" * 500 + "\n" + "c" * 1000
    assert split_message(text) == ["a" * 2000 + " " + "b" * 500 + "\n", "c" * 1000]
    assert split_message("a" * 2000 + " " + "b" * 2000) == ["a" * 2000 + " ", "b" * 2000]


@pytest.mark.parametrize(
    "token",
    [
        "&amp;",
        "<https://e.com/x|a link with spaces>",
        "👨\u200d👩\u200d👧",
        "e\u0301",
        "\u0915\u093f",  # a spacing mark: Devanagari's vowel sign i
        "\u1100\u1161\u11a8",  # a Hangul syllable of conjoining jamo
    ],
)
def test_a_split_never_cuts_an_escape_a_link_or_a_character(token: str) -> None:
    for lead in range(6):
        text = "x" * lead + token * (2 * MESSAGE_LIMIT // len(token))
        parts = split_message(text)
        assert "".join(parts) == text
        assert all(len(part) <= MESSAGE_LIMIT for part in parts)
        cut = 0
        for part in parts[:-1]:
            cut += len(part)
            assert (cut - lead) % len(token) == 0, f"cut inside {token!r} at {cut}"


def test_a_code_block_split_in_two_is_closed_and_reopened() -> None:
    code = "```\n" + "print(1)\n" * 700 + "```"
    parts = split_message(code)
    assert len(parts) == 3
    assert all(len(part) <= MESSAGE_LIMIT for part in parts)
    assert all(part.startswith("```\n") and part.endswith("```") for part in parts)
    body = "".join(part.removeprefix("```\n").removesuffix("```") for part in parts)
    assert body == "print(1)\n" * 700


def test_a_draft_shows_the_first_messages_worth() -> None:
    assert draft_text("**hi**") == "*hi*"
    long = draft_text("word " * 2000)
    assert len(long) <= MESSAGE_LIMIT
    assert long.endswith(" …")


# -- drafts --------------------------------------------------------------------------


class Shown:
    """What a draft showed, and an event set on every show."""

    def __init__(self, fail: bool = False) -> None:
        self.texts: list[tuple[str | None, str]] = []
        self.changed = asyncio.Event()
        self.fail = fail

    async def __call__(self, ts: str | None, text: str) -> str:
        self.texts.append((ts, text))
        self.changed.set()
        if self.fail:
            raise PlatformUnavailable("slack is down (test)")
        return ts or "1.1"

    async def wait(self, count: int) -> None:
        async with asyncio.timeout(10):
            while len(self.texts) < count:
                self.changed.clear()
                await self.changed.wait()


async def test_a_draft_posts_once_then_edits_and_finishes_with_its_ts() -> None:
    shown = Shown()
    draft = Draft(shown, interval=0.0)
    draft.add("a")
    await shown.wait(1)
    draft.add("b")
    await shown.wait(2)
    assert await draft.finish() == "1.1"
    assert shown.texts == [(None, "a"), ("1.1", "ab")]


async def test_a_quick_reply_finishes_its_draft_before_anything_is_shown() -> None:
    shown = Shown()
    draft = Draft(shown, interval=3600.0)
    draft.add("all of it")
    assert await draft.finish() is None
    assert shown.texts == []


async def test_a_draft_that_cannot_be_shown_stops_quietly() -> None:
    shown = Shown(fail=True)
    draft = Draft(shown, interval=0.0)
    draft.add("a")
    await shown.wait(1)
    draft.add("b")
    assert await draft.finish() is None
    assert shown.texts == [(None, "a")]


# -- configuration -------------------------------------------------------------------


def test_the_slack_section_is_read_with_its_secrets(tmp_path: Path) -> None:
    path = tmp_path / "chatlane.toml"
    path.write_text(
        '[slack]\nenabled = true\nbot_token = { env = "BOT" }\n'
        'allowed_users = ["U1"]\nallowed_channels = ["C1"]\n'
    )
    config = load_config(path, {"CHATLANE_SLACK__REQUIRE_MENTION": "false"})
    assert (config.slack.enabled, config.slack.require_mention) == (True, False)
    secrets = resolve_secrets(config, {"BOT": "xoxb-1", "SLACK_SIGNING_SECRET": "s"})
    assert (secrets.slack_bot_token, secrets.slack_signing_secret) == ("xoxb-1", "s")
    assert "xoxb-1" not in repr(secrets)
    assert resolve_secrets(Config(), {"SLACK_BOT_TOKEN": "x"}).slack_bot_token == ""


def test_slack_allowlists_apply_with_allow_slack(tmp_path: Path) -> None:
    path = tmp_path / "chatlane.toml"
    path.write_text(
        '[allow]\nslack = ["U1", "U2"]\n[slack]\nallowed_users = ["U1", "U3"]\n'
        'allowed_channels = ["C1"]\n'
    )
    config = load_config(path, {})

    def allows(user: str, chat: str, chat_type: ChatType = ChatType.GROUP) -> bool:
        return config.allows(
            SessionSource("slack", chat_id=chat, chat_type=chat_type, user_id=user)
        )

    assert allows("U1", "C1")
    assert not allows("U2", "C1")  # not in slack.allowed_users
    assert not allows("U3", "C1")  # not in allow.slack
    assert not allows("U1", "C2")  # not an allowed channel
    assert allows("U1", "D7", ChatType.DM)  # a DM is not a channel
    assert config.allows(SessionSource("web", chat_id="C2", user_id="anyone"))


def test_an_unknown_slack_key_names_it(tmp_path: Path) -> None:
    path = tmp_path / "chatlane.toml"
    path.write_text("[slack]\nsocket_mode = true\n")
    with pytest.raises(ConfigError, match=r"unknown configuration key 'slack\.socket_mode'"):
        load_config(path, {})


def test_socket_mode_reads_the_app_token_and_not_the_signing_secret(tmp_path: Path) -> None:
    token_file = tmp_path / "app-token"
    token_file.write_text("xapp-1-A0001-2-abc\n")
    path = tmp_path / "chatlane.toml"
    path.write_text(
        f'[slack]\nenabled = true\nmode = "socket"\napp_token = {{ file = "{token_file}" }}\n'
        'signing_secret = { file = "/nonexistent/never-read" }\n'
    )
    config = load_config(path, {})
    assert config.slack.mode is SlackMode.SOCKET
    secrets = resolve_secrets(config, {"SLACK_BOT_TOKEN": "xoxb-1"})
    assert (secrets.slack_app_token, secrets.slack_signing_secret) == ("xapp-1-A0001-2-abc", "")
    assert "xapp-1" not in repr(secrets)
    check_secrets(config.slack, "xoxb-1", "", secrets.slack_app_token)  # no signing secret
    by_env = load_config(
        None, {"CHATLANE_SLACK__ENABLED": "true", "CHATLANE_SLACK__MODE": "socket"}
    )
    assert resolve_secrets(by_env, {"SLACK_APP_TOKEN": "xapp-9"}).slack_app_token == "xapp-9"


def test_the_events_mode_reads_no_app_token() -> None:
    config = load_config(None, {"CHATLANE_SLACK__ENABLED": "true"})
    assert config.slack.mode is SlackMode.EVENTS
    secrets = resolve_secrets(config, {"SLACK_APP_TOKEN": "xapp-1", "SLACK_SIGNING_SECRET": "s"})
    assert (secrets.slack_app_token, secrets.slack_signing_secret) == ("", "s")


def test_an_unknown_mode_names_the_modes(tmp_path: Path) -> None:
    path = tmp_path / "chatlane.toml"
    path.write_text('[slack]\nmode = "websocket"\n')
    with pytest.raises(ConfigError) as raised:
        load_config(path, {})
    assert str(raised.value) == (
        "configuration key 'slack.mode' = 'websocket': expected one of: events, socket"
    )


@pytest.mark.parametrize(
    ("app_token", "message"),
    [
        ("", "slack is in socket mode but has no app token: set SLACK_APP_TOKEN"),
        ("xoxb-1-bot-token", "slack's app token is not an app-level token: expected 'xapp-'"),
        ("xapp-1-A01-2\nabc", "slack's app token is not an app-level token"),
        ("xapp-1/A01", "slack's app token is not an app-level token"),
    ],
)
def test_a_missing_or_malformed_app_token_is_one_line(app_token: str, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        check_secrets(SlackConfig(mode=SlackMode.SOCKET), "xoxb-1", "", app_token)
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)
    if app_token:
        assert app_token not in str(raised.value)
