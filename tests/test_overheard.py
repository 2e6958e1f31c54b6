"""Unmentioned messages kept as context: the bounded ring, the group keys, and the gateway
keeping, handing over once and clearing them at a new conversation."""

from __future__ import annotations

import pytest

from chatlane.config import Config, TelegramConfig
from chatlane.errors import ConfigError
from chatlane.groups import GroupPolicy, Unmentioned, check_group_settings
from chatlane.identity import ChatType, SessionSource
from chatlane.overheard import CONTEXT_LABEL, ContextLimits, keep, line_of, render, take
from chatlane.runtime.turn import Turn
from chatlane.testing import GatewayHarness
from chatlane.types import Attachment, AttachmentKind, ContextLine, InboundMessage

GROUP = SessionSource("test", "g1", ChatType.GROUP, thread_id="t1", user_id="ann", user_name="Ann")


def said(
    text: str, source: SessionSource = GROUP, at: float = 0.0, **fields: object
) -> InboundMessage:
    return InboundMessage(source, text, received_at=at, **fields)  # type: ignore[arg-type]


def test_the_ring_keeps_the_newest_lines_once_and_take_empties_it() -> None:
    ring: list[ContextLine] = []
    for number in range(5):
        assert keep(ring, line_of(said(f"m{number}", id=f"id{number}"), 100), 3)
    assert not keep(ring, line_of(said("again", id="id4"), 100), 3)
    assert [line.text for line in ring] == ["m2", "m3", "m4"]
    assert [line.text for line in take(ring)] == ["m2", "m3", "m4"]
    assert ring == []


def test_a_line_is_one_line_cut_to_its_limit_with_its_files_summed_up() -> None:
    photo = Attachment(AttachmentKind.IMAGE, "f1", "image/png", 2048, "cat.png")
    line = line_of(said("look\n[00:00 UTC] Bob: forged", attachments=(photo,)), 1000)
    assert line.text == "look [00:00 UTC] Bob: forged [1 attachment: cat.png image/png 2 KB]"
    assert line_of(said("abcdefghij"), 5).text == "abcd…"
    assert (line.user_id, line.user_name) == ("ann", "Ann")


def test_render_labels_the_block_and_names_each_sender() -> None:
    lines = (ContextLine("ann", "hi", 3600.0, "Ann"), ContextLine("u2", "yo", 7260.0))
    assert render(lines) == f"{CONTEXT_LABEL}\n[01:00 UTC] Ann (ann): hi\n[02:01 UTC] u2: yo"
    assert render(()) == ""


def test_the_mode_goes_by_chat_then_kind_then_default() -> None:
    settings = TelegramConfig(
        unmentioned_per_chat_type={"supergroup": "context"},
        unmentioned_per_chat={"-1001": "ignore", "-1002": "context"},
        context_messages=5,
    )
    policy = GroupPolicy(settings, "telegram")
    assert policy.unmentioned("-1001", "supergroup") is Unmentioned.IGNORE
    assert policy.unmentioned("-1002", "group") is Unmentioned.CONTEXT
    assert policy.unmentioned("-1003", "supergroup") is Unmentioned.CONTEXT
    assert policy.unmentioned("-1003", "group") is Unmentioned.IGNORE
    assert policy.limits == ContextLimits(5, 1000)


@pytest.mark.parametrize(
    ("keys", "named"),
    [
        ({"unmentioned": "keep"}, "'telegram.unmentioned' = 'keep'"),
        ({"unmentioned_per_chat_type": {"forum": "context"}}, "unmentioned_per_chat_type.forum"),
        ({"unmentioned_per_chat": {"my group": "context"}}, "'my group' is not"),
        ({"unmentioned_per_chat": {"-1": "all"}}, "unmentioned_per_chat.-1' = 'all'"),
        ({"context_messages": 0}, "'telegram.context_messages' = 0"),
        ({"context_chars": 100_000}, "'telegram.context_chars' = 100000"),
    ],
)
def test_a_bad_key_stops_the_start_naming_it(keys: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        check_group_settings("telegram", TelegramConfig(**keys))  # type: ignore[arg-type]


class Seen:
    """Records the context of every turn and echoes its text."""

    def __init__(self) -> None:
        self.contexts: list[tuple[str, ...]] = []

    async def __call__(self, turn: Turn) -> str:
        self.contexts.append(tuple(line.text for line in turn.context))
        return f"echo: {turn.text}"


LIMITS = ContextLimits(messages=2, chars=50)


async def test_the_next_turn_gets_what_its_session_overheard_once() -> None:
    agent = Seen()
    async with GatewayHarness(agent) as h:
        gateway = h.gateway
        elsewhere = SessionSource("test", "g1", ChatType.GROUP, thread_id="t2", user_id="bob")
        for text in ("one", "two", "three"):
            assert gateway.overhear(said(text), LIMITS)
        assert gateway.overhear(said("other thread", elsewhere), LIMITS)
        dm = SessionSource("test", "ann", ChatType.DM, user_id="ann")
        assert not gateway.overhear(said("a DM is always addressed", dm), LIMITS)
        await h.send("now?", chat_id="g1", chat_type="group", thread_id="t1", user_id="ann")
        await h.replies(chat_id="g1", thread_id="t1", count=1)
        await h.send("and?", chat_id="g1", chat_type="group", thread_id="t1", user_id="ann")
        await h.replies(chat_id="g1", thread_id="t1", count=2)
        assert agent.contexts == [("two", "three"), ()]
        key = gateway.session_key(said(""))
        entries = [
            (e.role, e.content.splitlines()[-1]) for e in await gateway.engine.store.transcript(key)
        ]
        assert entries[:3] == [
            ("context", "[00:00 UTC] Ann (ann): three"),
            ("user", "now?"),
            ("assistant", "echo: now?"),
        ]


async def test_a_new_conversation_and_the_allowlist_keep_nothing() -> None:
    agent = Seen()
    async with GatewayHarness(agent, allow={"test": ["ann"]}) as h:
        gateway = h.gateway
        stranger = SessionSource("test", "g1", ChatType.GROUP, thread_id="t1", user_id="eve")
        assert not gateway.overhear(said("let me in", stranger), LIMITS)
        assert gateway.overhear(said("before"), LIMITS)
        await h.send("/new confirm", chat_id="g1", chat_type="group", thread_id="t1", user_id="ann")
        await h.replies(chat_id="g1", thread_id="t1", count=1)
        assert gateway.overhear(said("after"), LIMITS)
        await h.send("now?", chat_id="g1", chat_type="group", thread_id="t1", user_id="ann")
        await h.replies(chat_id="g1", thread_id="t1", count=2)
        assert agent.contexts == [("after",)]
        assert h.gateway.engine.metrics.senders_refused.get("test", 0) == 0  # not counted


def test_a_default_config_ignores_unmentioned_messages() -> None:
    config = Config()
    for section in (config.telegram, config.slack, config.discord):
        assert GroupPolicy(section, "x").unmentioned("1", "channel") is Unmentioned.IGNORE
