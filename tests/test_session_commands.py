"""Conversation boundaries and overrides: /new /reset /resume /model /reasoning /fast."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from chatlane.endpoints import EndpointPolicy
from chatlane.lifecycle import LifecycleOptions
from chatlane.redaction import CREDENTIALS_REFUSED
from chatlane.runtime.turn import Turn
from chatlane.state import SERVICE_TIER_UNSET
from chatlane.stores import Conversation, MemoryStore
from chatlane.testing import GatewayHarness
from chatlane.types import ModelChoice
from tests.runtime.agents import EchoAgent, settings_agent

NO_CONFIRM = LifecycleOptions(confirm_new=False)


class EndpointSettingsAgent:
    """``settings_agent`` that lets chats choose its one endpoint, ``http://x/v1``."""

    endpoints = EndpointPolicy.of("http://x/v1")

    async def __call__(self, turn: Turn) -> str:
        return await settings_agent(turn)


class NamedDefaultAgent:
    """``settings_agent`` that says which model it uses by default (``default_model``)."""

    def __init__(self, default: object) -> None:
        self.default_model = default

    async def __call__(self, turn: Turn) -> str:
        return await settings_agent(turn)


class TestNew:
    async def test_asks_then_yes_proceeds(self) -> None:
        store = MemoryStore()
        async with GatewayHarness(EchoAgent(), store=store) as h:
            result = await h.send("hello", chat_id="c")
            await h.replies(chat_id="c", count=1)
            old = await store.conversation(result.session_key)
            await h.send("/new", chat_id="c")
            await h.send("yes", chat_id="c")
            replies = await h.replies(chat_id="c", count=3)
            assert replies[1].startswith("Start a new conversation?")
            assert replies[2] == "Started a new conversation."
            new = await store.conversation(result.session_key)
            assert new.id != old.id
            assert [e.content for e in await store.transcript(result.session_key, old.id)] == [
                "hello",
                "echo: hello",
            ]
            assert await store.transcript(result.session_key) == []

    async def test_another_command_cancels_too(self) -> None:
        store = MemoryStore()
        async with GatewayHarness(EchoAgent(), store=store) as h:
            result = await h.send("/new", chat_id="c")
            first = await store.conversation(result.session_key)
            await h.send("/status", chat_id="c")
            await h.send("yes", chat_id="c")
            replies = await h.replies(chat_id="c", count=3)
            assert replies[2] == "echo: yes"
            assert (await store.conversation(result.session_key)).id == first.id

    async def test_no_cancels_and_other_text_cancels_and_runs(self) -> None:
        store = MemoryStore()
        async with GatewayHarness(EchoAgent(), store=store) as h:
            result = await h.send("/new", chat_id="c")
            first = await store.conversation(result.session_key)
            await h.send("no", chat_id="c")
            await h.send("/reset", chat_id="c")
            await h.send("something else", chat_id="c")
            await h.replies(chat_id="c", count=4)
            await h.send("yes", chat_id="c")
            replies = await h.replies(chat_id="c", count=5)
            assert replies[1] == "Cancelled; nothing changed."
            assert replies[3:] == ["echo: something else", "echo: yes"]
            assert (await store.conversation(result.session_key)).id == first.id

    async def test_confirm_argument_and_no_confirmation_setting(self) -> None:
        async with GatewayHarness(EchoAgent()) as h:
            await h.send("/new confirm", chat_id="c")
            assert await h.replies(chat_id="c", count=1) == ["Started a new conversation."]
        async with GatewayHarness(EchoAgent(), lifecycle=NO_CONFIRM) as h:
            await h.send("/reset", chat_id="c")
            assert await h.replies(chat_id="c", count=1) == ["Started a new conversation."]

    async def test_boundary_interrupts_the_turn_and_drops_the_queue(self) -> None:
        async with GatewayHarness(EchoAgent(), lifecycle=NO_CONFIRM) as h:
            result = await h.send("sleep 5", chat_id="c")
            await h.until_running(chat_id="c")
            await h.send("queued", chat_id="c")
            await h.send("/new", chat_id="c")
            replies = await h.replies(chat_id="c", count=2)
            assert replies[1] == "Started a new conversation. Dropped 1 queued message."
            await h.settle()
            state = h.session(result.session_key)
            assert not state.turn.is_running
            assert state.persistent.run_generation == 2
            assert "slept 5" not in [o.text for o in h.outbox]

    async def test_boundary_clears_every_conversation_field(self) -> None:
        async with GatewayHarness(settings_agent, lifecycle=NO_CONFIRM) as h:
            for command in ("/model gpt-x", "/reasoning high", "/fast on", "/new"):
                await h.send(command, chat_id="c")
            await h.send("go", chat_id="c")
            replies = await h.replies(chat_id="c", count=5)
            assert replies[4] == "model=default reasoning=default tier=default"


def started(conversation: Conversation) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(conversation.started_at))


class TestResume:
    async def test_lists_by_title_and_number_and_switches(self) -> None:
        store = MemoryStore()
        async with GatewayHarness(EchoAgent(), store=store, lifecycle=NO_CONFIRM) as h:
            key = h.session_key(chat_id="c")
            await h.send("first talk", chat_id="c")
            await h.replies(chat_id="c", count=1)
            first = await store.conversation(key)
            await h.send("/new", chat_id="c")
            await h.send("second talk", chat_id="c")
            await h.replies(chat_id="c", count=3)
            second = await store.conversation(key)
            await h.send("/resume", chat_id="c")
            await h.send("/resume 2", chat_id="c")
            replies = await h.replies(chat_id="c", count=5)
            assert replies[3].splitlines() == [
                "Recent conversations (newest first):",
                f"1. second talk — {started(second)} (current)",
                f"2. first talk — {started(first)}",
                "Send /resume <number or title words> to switch.",
            ]
            assert replies[4] == f"Resumed “first talk” (started {started(first)})."
            assert (await store.conversation(key)).id == first.id
            assert not [reply for reply in replies if "c_" in reply]

    async def test_by_title_words_and_unknown(self) -> None:
        store = MemoryStore()
        async with GatewayHarness(EchoAgent(), store=store, lifecycle=NO_CONFIRM) as h:
            key = h.session_key(chat_id="c")
            titled = await store.new_conversation(key, title="Trip to Lisbon")
            await store.new_conversation(key)
            await h.send("/resume lisbon trip", chat_id="c")
            await h.send("/resume nowhere", chat_id="c")
            await h.send("/resume 9", chat_id="c")
            replies = await h.replies(chat_id="c", count=3)
            assert replies[0] == f"Resumed “Trip to Lisbon” (started {started(titled)})."
            assert replies[1].startswith("No conversation matches 'nowhere'")
            assert replies[1].endswith("Usage: /resume [number | title words]")
            assert replies[2].startswith("No conversation matches '9'")

    async def test_the_same_title_twice_is_told_apart_by_number(self) -> None:
        store = MemoryStore()
        async with GatewayHarness(EchoAgent(), store=store, lifecycle=NO_CONFIRM) as h:
            key = h.session_key(chat_id="c")
            older = await store.new_conversation(key, title="Weekly plan")
            newer = await store.new_conversation(key, title="Weekly plan")
            untitled = await store.new_conversation(key)
            await h.send("/resume weekly", chat_id="c")
            await h.send("/resume", chat_id="c")
            await h.send("/resume 3", chat_id="c")
            await h.send("/resume 3", chat_id="c")
            replies = await h.replies(chat_id="c", count=4)
            assert replies[0] == (
                f"Resumed “Weekly plan” (started {started(newer)}). Another conversation "
                "matches too: send /resume to pick it by number."
            )
            assert replies[1].splitlines()[1:4] == [
                f"1. (untitled) — {started(untitled)}",
                f"2. Weekly plan — {started(newer)} (current)",
                f"3. Weekly plan — {started(older)}",
            ]
            assert replies[2] == f"Resumed “Weekly plan” (started {started(older)})."
            assert (await store.conversation(key)).id == older.id
            assert replies[3] == f"Already in “Weekly plan” (started {started(older)})."

    async def test_an_id_is_still_taken_and_never_shown(self) -> None:
        store = MemoryStore()
        async with GatewayHarness(EchoAgent(), store=store, lifecycle=NO_CONFIRM) as h:
            key = h.session_key(chat_id="c")
            untitled = await store.new_conversation(key)
            await store.new_conversation(key, title="Elsewhere")
            await h.send(f"/resume {untitled.id}", chat_id="c")
            [reply] = await h.replies(chat_id="c", count=1)
            assert reply == f"Resumed the untitled conversation started {started(untitled)}."
            assert (await store.conversation(key)).id == untitled.id


class TestOverrides:
    async def test_model_is_sticky_shown_and_persisted(self, tmp_path: Path) -> None:
        url = f"sqlite:///{tmp_path / 'o.db'}"
        async with GatewayHarness(EndpointSettingsAgent(), store=url) as h:
            await h.send("/model gpt-x --provider openai --base-url http://x/v1/", chat_id="c")
            await h.send("/model", chat_id="c")
            await h.send("go", chat_id="c")
            replies = await h.replies(chat_id="c", count=3)
            assert replies[1] == "Model: gpt-x (openai at http://x/v1)"
            assert replies[2].startswith("model=gpt-x ")
        async with GatewayHarness(settings_agent, store=url) as h:
            await h.send("again", chat_id="c")
            assert (await h.replies(chat_id="c", count=1))[0].startswith("model=gpt-x ")

    async def test_api_keys_are_refused(self) -> None:
        store = MemoryStore()
        async with GatewayHarness(settings_agent, store=store) as h:
            await h.send("/model gpt-x --api-key sk-secret", chat_id="c")
            [reply] = await h.replies(chat_id="c", count=1)
            assert reply.startswith(CREDENTIALS_REFUSED)
            assert "sk-secret" not in str(await store.load_persistent(h.session_key(chat_id="c")))

    @pytest.mark.parametrize(
        "command",
        [
            "/model sk-proj-hunter2hunter2hunter2",
            "/model gpt-x --provider api_key=hunter2",
            "/model gpt-x --base-url http://me:hunter2@x/v1",
            "/model gpt-x --base-url https://x/v1?api_key=hunter2",
            "/model gpt-x --token=hunter2",
        ],
    )
    async def test_credentials_anywhere_are_refused_unrepeated(self, command: str) -> None:
        store = MemoryStore()
        async with GatewayHarness(EndpointSettingsAgent(), store=store) as h:
            await h.send(command, chat_id="c")
            [reply] = await h.replies(chat_id="c", count=1)
            assert reply.startswith(CREDENTIALS_REFUSED)
            assert "hunter2" not in reply
            assert "hunter2" not in str(await store.load_persistent(h.session_key(chat_id="c")))

    async def test_an_agent_without_an_endpoint_policy_takes_no_endpoint(self) -> None:
        async with GatewayHarness(settings_agent) as h:
            await h.send("/model gpt-x --base-url http://x/v1", chat_id="c")
            await h.send("/model", chat_id="c")
            replies = await h.replies(chat_id="c", count=2)
            assert replies[0].startswith("this agent takes no endpoint from a chat.")
            assert replies[1] == "Model: the default"

    @pytest.mark.parametrize(
        "bad", ["/model", "/model a b", "/model x --provider", "/model x --y 1", '/model "unclosed']
    )
    async def test_malformed_model_gets_usage(self, bad: str) -> None:
        async with GatewayHarness(settings_agent) as h:
            await h.send(bad + (" " if bad == "/model" else ""), chat_id="c")
            [reply] = await h.replies(chat_id="c", count=1)
            assert reply.startswith("Model:") if bad == "/model" else "Usage: /model" in reply

    async def test_reasoning_and_fast_three_states(self) -> None:
        async with GatewayHarness(settings_agent) as h:
            texts = (
                "/reasoning low",
                "/fast off",
                "a",
                "/fast on",
                "b",
                "/fast default",
                "/reasoning extreme",
                "c",
            )
            for count, text in enumerate(texts, start=1):
                await h.send(text, chat_id="c")
                replies = await h.replies(chat_id="c", count=count)
            assert replies[2] == "model=default reasoning=low tier=normal"
            assert replies[4] == "model=default reasoning=low tier=priority"
            assert "'extreme' is not one of" in replies[6]
            assert replies[7] == "model=default reasoning=low tier=default"


class TestResumeEdges:
    async def test_the_current_conversation_named_again_changes_nothing(self) -> None:
        """No boundary: the running turn answers and the waiting message runs."""
        async with GatewayHarness(EchoAgent(), lifecycle=NO_CONFIRM) as h:
            await h.send("sleep 0.2", chat_id="c")
            await h.until_running(chat_id="c")
            await h.send("waiting", chat_id="c")
            await h.send("/resume 1", chat_id="c")
            replies = await h.replies(chat_id="c", count=4)
        assert replies[1].startswith("Already in the untitled conversation started ")
        assert replies[2:] == ["slept 0.2", "echo: waiting"]

    async def test_an_older_conversation_than_the_list_is_found_by_id_and_title(self) -> None:
        store = MemoryStore()
        async with GatewayHarness(EchoAgent(), store=store, lifecycle=NO_CONFIRM) as h:
            key = h.session_key(chat_id="c")
            oldest = await store.new_conversation(key, title="Budget 2019")
            for n in range(25):
                await store.new_conversation(key, title=f"topic {n}")
            await h.send(f"/resume {oldest.id}", chat_id="c")
            await h.send("/new", chat_id="c")
            await h.send("/resume budget 2019", chat_id="c")
            replies = await h.replies(chat_id="c", count=3)
            assert replies[0] == replies[2] == f"Resumed “Budget 2019” (started {started(oldest)})."
            assert (await store.conversation(key)).id == oldest.id

    async def test_a_long_argument_is_not_echoed_whole(self) -> None:
        async with GatewayHarness(EchoAgent()) as h:
            await h.send("/resume " + "x" * 5000, chat_id="c")
            [reply] = await h.replies(chat_id="c", count=1)
        assert len(reply) < 300
        assert "…" in reply


class TestModelNames:
    @pytest.mark.parametrize("name", ["''", '""', "\u200b", "x" * 201])
    async def test_a_blank_invisible_or_huge_name_is_refused(self, name: str) -> None:
        async with GatewayHarness(settings_agent) as h:
            await h.send(f"/model {name}", chat_id="c")
            await h.send(f"/model --once {name}", chat_id="c")
            await h.send("go", chat_id="c")
            replies = await h.replies(chat_id="c", count=3)
        assert all("needs visible characters" in r or "at most 200" in r for r in replies[:2])
        assert replies[2].startswith("model=default ")

    @pytest.mark.parametrize(
        ("args", "why"),
        [
            ("x --provider " + "p" * 201, "--provider is at most 200 characters."),
            ("x --base-url " + "h" * 2001, "--base-url is at most 2000 characters."),
            ("x --provider=\u200b", "--provider needs visible characters."),
            ("x --base-url=", "--base-url needs visible characters."),
            ("\x1b[31mred\x1b[0m", "a model name may hold no control characters or bidi"),
            ("\u202egpt-4", "a model name may hold no control characters or bidi"),
            ("'gpt\x85x'", "a model name may hold no control characters or bidi"),
            ("x --provider '\u2066p'", "--provider may hold no control characters or bidi"),
            ("x --provider a --provider b", "--provider is given twice."),
            ("x --\x1b[2J", "unknown option '--\\x1b[2J'."),
        ],
    )
    async def test_every_value_is_checked_alike_and_never_repeated_raw(
        self, args: str, why: str
    ) -> None:
        """The name and every option's value: visible, not too long, no control character
        or bidirectional override; the refusal is one line that repeats none of it raw."""
        async with GatewayHarness(settings_agent) as h:
            await h.send(f"/model {args}", chat_id="c")
            await h.send(f"/model --once {args}", chat_id="c")
            await h.send("/model", chat_id="c")
            replies = await h.replies(chat_id="c", count=3)
        for refused in replies[:2]:
            reason, usage = refused.split("\n")
            assert reason.startswith(why)
            assert usage.startswith("Usage: /model")
            assert reason.isprintable()
        assert replies[2] == "Model: the default"

    @pytest.mark.parametrize(
        "command",
        [
            "/reasoning " + "x" * 5000,
            "/reasoning \u202ehigh",
            "/fast \x1b[2J" + "x" * 5000,
            "/approve #\x1b[2J" + "x" * 5000,
            "/busy \u2066" + "x" * 5000,
        ],
    )
    async def test_a_refused_argument_is_repeated_escaped_and_cut(self, command: str) -> None:
        async with GatewayHarness(settings_agent) as h:
            await h.send(command, chat_id="c")
            [reply] = await h.replies(chat_id="c", count=1)
        reason = reply.split("\n")[0]
        assert reason.isprintable()
        assert len(reason) < 300

    async def test_an_option_with_its_value_after_equals_is_read(self) -> None:
        async with GatewayHarness(settings_agent) as h:
            await h.send("/model m --provider=p", chat_id="c")
            await h.send("/model", chat_id="c")
            replies = await h.replies(chat_id="c", count=2)
        assert "unknown option" not in replies[0]
        assert replies[1] == f"Model: {ModelChoice('m', 'p').describe()}"

    async def test_the_model_shown_says_a_once_is_for_one_turn(self) -> None:
        async with GatewayHarness(settings_agent) as h:
            await h.send("/model sticky", chat_id="c")
            await h.send("/model --once quick", chat_id="c")
            await h.send("/model", chat_id="c")
            replies = await h.replies(chat_id="c", count=3)
        assert replies[2] == "Model: quick, for the next turn only; then sticky"


class TestDefaultModel:
    async def test_model_names_the_default_the_agent_says_it_uses(self) -> None:
        async with GatewayHarness(NamedDefaultAgent("gpt-4o-mini")) as h:
            await h.send("/model", chat_id="c")
            await h.send("/model --once other", chat_id="c")
            await h.send("/model", chat_id="c")
            replies = await h.replies(chat_id="c", count=3)
        assert replies[0] == "Model: gpt-4o-mini (the default)"
        assert replies[2] == "Model: other, for the next turn only; then gpt-4o-mini (the default)"

    async def test_model_default_goes_back_to_the_agents_own(self, tmp_path: Path) -> None:
        """``/model default`` drops the choice (and a ``--once`` waiting): it never names a
        model called "default"."""
        url = f"sqlite:///{tmp_path / 'o.db'}"
        async with GatewayHarness(NamedDefaultAgent("gpt-4o-mini"), store=url) as h:
            await h.send("/model sticky", chat_id="c")
            await h.send("/model --once quick", chat_id="c")
            await h.send("/model Default", chat_id="c")
            await h.send("/model", chat_id="c")
            replies = await h.replies(chat_id="c", count=4)
        assert replies[2] == "Model: back to gpt-4o-mini (the default)."
        assert replies[3] == "Model: gpt-4o-mini (the default)"
        async with GatewayHarness(NamedDefaultAgent("gpt-4o-mini"), store=url) as h:
            await h.send("/model", chat_id="c")  # as stored
            assert await h.replies(chat_id="c", count=1) == ["Model: gpt-4o-mini (the default)"]

    @pytest.mark.parametrize("default", [None, 42, "", "  ", "gpt\x1b[31m", "m" * 201])
    async def test_a_default_not_fit_to_show_is_not_named(self, default: object) -> None:
        async with GatewayHarness(NamedDefaultAgent(default)) as h:
            await h.send("/model", chat_id="c")
            assert await h.replies(chat_id="c", count=1) == ["Model: the default"]


class TestModelOnce:
    async def test_an_internal_turn_leaves_it_to_the_persons_next_turn(self) -> None:
        """A cron job's prompt (an internal message) runs with the conversation's model."""
        async with GatewayHarness(settings_agent) as h:
            await h.send("/model sticky", chat_id="c")
            await h.send("/model --once once-a", chat_id="c")
            await h.send("go", chat_id="c", internal=True)
            await h.settle()
            await h.send("mine", chat_id="c")
            await h.settle()
            await h.send("after", chat_id="c")
            replies = await h.replies(chat_id="c", count=5)
        assert [r.split()[0] for r in replies[2:]] == [
            "model=sticky",
            "model=once-a",
            "model=sticky",
        ]

    async def run_once(self, h: GatewayHarness, first: str) -> list[str]:
        await h.send("/model sticky", chat_id="c")
        await h.send("/model --once once-a", chat_id="c")
        await h.send("/model --once once-b", chat_id="c")
        await h.send(first, chat_id="c")
        await h.settle()
        await h.send("after", chat_id="c")
        return await h.replies(chat_id="c", count=5, timeout=5)

    async def test_restored_after_success(self) -> None:
        async with GatewayHarness(settings_agent) as h:
            replies = await self.run_once(h, "go")
            assert replies[3].startswith("model=once-b ")
            assert replies[4].startswith("model=sticky ")

    async def test_restored_after_an_error(self) -> None:
        async with GatewayHarness(settings_agent) as h:
            replies = await self.run_once(h, "fail")
            assert "RuntimeError" in replies[3]
            assert replies[4].startswith("model=sticky ")

    async def test_restored_after_stop(self) -> None:
        async with GatewayHarness(settings_agent) as h:
            await h.send("/model sticky", chat_id="c")
            await h.send("/model --once once-a", chat_id="c")
            await h.send("sleep 5", chat_id="c")
            await h.until_running(chat_id="c")
            await h.send("/stop", chat_id="c")
            await h.settle()
            await h.send("after", chat_id="c")
            replies = await h.replies(chat_id="c", count=4)
            assert replies[3].startswith("model=sticky ")

    async def test_restored_after_eviction(self) -> None:
        async with GatewayHarness(settings_agent, turn_timeout=0.2) as h:
            key = h.session_key(chat_id="c")
            await h.send("/model sticky", chat_id="c")
            await h.send("/model --once once-a", chat_id="c")
            await h.send("sleep 5", chat_id="c")
            await h.replies(chat_id="c", count=3, timeout=3)
            assert h.session(key).conversation.model_override == ModelChoice("sticky")

    async def test_a_once_from_a_conversation_that_ended_elsewhere_is_not_restored(
        self,
    ) -> None:
        store = MemoryStore()
        async with (
            GatewayHarness(settings_agent, store=store, reread_stored=0) as here,
            GatewayHarness(settings_agent, store=store, lifecycle=NO_CONFIRM) as there,
        ):
            await here.send("/model sticky", chat_id="c")
            await here.send("/model --once once-a", chat_id="c")
            await here.replies(chat_id="c", count=2)
            await there.send("/new", chat_id="c")
            await there.replies(chat_id="c", count=1)
            await here.send("go", chat_id="c")  # takes up the new conversation before it runs
            replies = await here.replies(chat_id="c", count=3)
            await here.settle()
            assert replies[2].startswith("model=default ")
            conversation = here.session(here.session_key(chat_id="c")).conversation
            assert conversation.model_override is None  # "sticky" was the old conversation's

    async def test_settled_by_a_boundary(self) -> None:
        async with GatewayHarness(settings_agent, lifecycle=NO_CONFIRM) as h:
            key = h.session_key(chat_id="c")
            await h.send("/model --once once-a", chat_id="c")
            await h.send("/new", chat_id="c")
            await h.send("go", chat_id="c")
            replies = await h.replies(chat_id="c", count=3)
            assert replies[2].startswith("model=default ")
            assert h.session(key).conversation.one_turn_restore is None
            assert h.session(key).conversation.service_tier_override is SERVICE_TIER_UNSET


async def test_once_restored_when_the_turn_is_interrupted() -> None:
    async with GatewayHarness(settings_agent, busy="interrupt") as h:
        await h.send("/model sticky", chat_id="c")
        await h.send("/model --once once-a", chat_id="c")
        await h.send("sleep 5", chat_id="c")
        await h.until_running(chat_id="c")
        await h.send("now", chat_id="c")
        replies = await h.replies(chat_id="c", count=4)
        assert replies[2] == "Interrupting the current task"
        assert replies[3].startswith("model=sticky ")
