"""Session context: set, cleared and never-set values, aliases, binding and propagation."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest

from chatlane import context as ctx
from chatlane.context import (
    CRON_VAR_NAMES,
    SESSION_VAR_NAMES,
    CronTarget,
    SessionContext,
    bind_session,
    bound_context,
    clear_session_vars,
    cron_context,
    current_cron_target,
    current_session,
    get_session_env,
    reset_session_vars,
    run_in_thread,
    set_cron_delivery,
    set_session_vars,
    spawn,
    spawned_tasks,
    subprocess_env,
)
from chatlane.errors import InvalidSource
from chatlane.identity import SessionSource

ALL_NAMES = SESSION_VAR_NAMES + CRON_VAR_NAMES
CHAT_ID = "CHATLANE_SESSION_CHAT_ID"
HERMES_CHAT_ID = "HERMES_SESSION_CHAT_ID"
CRON_CHAT_ID = "CHATLANE_CRON_AUTO_DELIVER_CHAT_ID"


def hermes(name: str) -> str:
    return "HERMES_" + name.removeprefix("CHATLANE_")


@pytest.fixture(autouse=True)
def clean_context(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts with no variable set here and none in the process environment."""
    for name in ALL_NAMES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(hermes(name), raising=False)
    reset_session_vars()
    yield
    reset_session_vars()


def all_values() -> dict[str, str]:
    return {name: get_session_env(name, "<default>") for name in ALL_NAMES}


class TestFallback:
    def test_never_set_falls_back_to_environ(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(CHAT_ID, "from-env")
        assert get_session_env(CHAT_ID) == "from-env"

    def test_never_set_and_absent_gives_default(self) -> None:
        assert get_session_env(CHAT_ID) == ""
        assert get_session_env(CHAT_ID, "dflt") == "dflt"

    def test_set_value_wins_over_environ(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(CHAT_ID, "from-env")
        set_session_vars(chat_id="42")
        assert get_session_env(CHAT_ID) == "42"

    def test_set_to_empty_does_not_fall_back(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(CHAT_ID, "stale")
        set_session_vars(platform="tg", chat_id="")
        assert get_session_env(CHAT_ID) == ""
        assert get_session_env(CHAT_ID, "dflt") == ""

    def test_unknown_names_read_environ(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("CHATLANE_SOMETHING_ELSE", "x")
        set_session_vars(platform="tg", chat_id="1")
        assert get_session_env("CHATLANE_SOMETHING_ELSE") == "x"
        assert get_session_env("CHATLANE_NOT_THERE", "dflt") == "dflt"


class TestAliases:
    @pytest.mark.parametrize("name", ALL_NAMES)
    def test_hermes_name_reads_same_variable(self, name: str) -> None:
        set_session_vars(*(f"s{i}" for i in range(7)))
        set_cron_delivery("c0", "c1", "c2")
        assert get_session_env(hermes(name)) == get_session_env(name) != ""

    def test_hermes_name_sees_cleared(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(HERMES_CHAT_ID, "stale")
        clear_session_vars()
        assert get_session_env(HERMES_CHAT_ID) == ""

    def test_fallback_tries_requested_name_first(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(CHAT_ID, "chatlane")
        monkeypatch.setenv(HERMES_CHAT_ID, "hermes")
        assert get_session_env(CHAT_ID) == "chatlane"
        assert get_session_env(HERMES_CHAT_ID) == "hermes"

    def test_fallback_tries_other_prefix(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(HERMES_CHAT_ID, "hermes")
        assert get_session_env(CHAT_ID) == "hermes"
        monkeypatch.delenv(HERMES_CHAT_ID)
        monkeypatch.setenv(CHAT_ID, "chatlane")
        assert get_session_env(HERMES_CHAT_ID) == "chatlane"


class TestCompatibilityApi:
    def test_set_returns_one_token_per_variable(self) -> None:
        tokens = set_session_vars(platform="tg", chat_id="1")
        assert len(tokens) == len(SESSION_VAR_NAMES)
        assert all(isinstance(t, contextvars.Token) for t in tokens)
        assert [t.var.name for t in tokens] == list(SESSION_VAR_NAMES)

    def test_tokens_restore_never_set(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(CHAT_ID, "from-env")
        tokens = set_session_vars(chat_id="1")
        for token in reversed(tokens):
            token.var.reset(token)
        assert get_session_env(CHAT_ID) == "from-env"

    def test_ints_and_none_are_normalised(self) -> None:
        set_session_vars(platform="tg", chat_id=42, thread_id=None)
        assert get_session_env(CHAT_ID) == "42"
        assert get_session_env("CHATLANE_SESSION_THREAD_ID", "dflt") == ""

    def test_clear_sets_empty_and_leaves_cron(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in SESSION_VAR_NAMES:
            monkeypatch.setenv(name, "stale")
        set_cron_delivery("tg", "99", "7")
        tokens = set_session_vars(*(f"s{i}" for i in range(7)))
        clear_session_vars(tokens)
        assert {name: get_session_env(name, "dflt") for name in SESSION_VAR_NAMES} == dict.fromkeys(
            SESSION_VAR_NAMES, ""
        )
        assert [get_session_env(n) for n in CRON_VAR_NAMES] == ["tg", "99", "7"]

    def test_reset_returns_all_ten_to_fallback(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in ALL_NAMES:
            monkeypatch.setenv(name, "env")
        set_session_vars(*(f"s{i}" for i in range(7)))
        set_cron_delivery("tg", "99", "7")
        clear_session_vars()
        reset_session_vars()
        assert all_values() == dict.fromkeys(ALL_NAMES, "env")

    def test_set_cron_delivery_returns_tokens(self) -> None:
        tokens = set_cron_delivery("tg", "99")
        assert [t.var.name for t in tokens] == list(CRON_VAR_NAMES)
        assert current_cron_target() == CronTarget("tg", "99", "")


class TestBindSession:
    def test_binds_and_yields_context(self) -> None:
        with bind_session({"platform": "tg", "chat_id": "1"}, session_key="k") as bound:
            assert bound == SessionContext(platform="tg", chat_id="1", session_key="k")
            assert current_session() == bound
            assert get_session_env("CHATLANE_SESSION_KEY") == "k"

    def test_clears_on_exit(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(CHAT_ID, "stale")
        with bind_session({"chat_id": "1"}):
            pass
        assert get_session_env(CHAT_ID, "dflt") == ""
        assert current_session() is None

    def test_clears_on_exception(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(CHAT_ID, "stale")
        with pytest.raises(RuntimeError, match="boom"), bind_session({"chat_id": "1"}):
            raise RuntimeError("boom")
        assert get_session_env(CHAT_ID, "dflt") == ""

    def test_nested_binding_restores_enclosing_session(self) -> None:
        with bind_session({"platform": "tg", "chat_id": "outer"}) as outer:
            with bind_session({"platform": "web", "chat_id": "inner"}):
                assert get_session_env(CHAT_ID) == "inner"
            assert current_session() == outer
        assert current_session() is None

    def test_session_source_none_ids_become_empty(self) -> None:
        source = SessionSource("tg", chat_id="5", chat_name="Room", user_name="ada")
        with bind_session(source, session_key="main:tg:dm:5") as bound:
            assert bound == SessionContext("tg", "5", "Room", "", "", "ada", "main:tg:dm:5")
            assert get_session_env("CHATLANE_SESSION_THREAD_ID", "dflt") == ""
            assert get_session_env("HERMES_SESSION_USER_NAME") == "ada"

    def test_session_context_can_be_rebound(self) -> None:
        captured = SessionContext("tg", "1", session_key="k")
        with bind_session(captured, session_key="k2") as bound:
            assert bound == SessionContext("tg", "1", session_key="k2")

    def test_unknown_field_is_refused(self) -> None:
        with pytest.raises(InvalidSource, match="chat_idd"), bind_session({"chat_idd": "1"}):
            pass  # pragma: no cover
        assert current_session() is None

    def test_current_session_none_when_never_set_or_cleared(self) -> None:
        assert current_session() is None
        set_session_vars(platform="tg")
        assert current_session() == SessionContext(platform="tg")
        clear_session_vars()
        assert current_session() is None

    def test_current_session_ignores_environ(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(CHAT_ID, "from-env")
        assert current_session() is None


class TestBoundContext:
    def test_holds_the_session_and_leaves_the_creator_alone(self) -> None:
        source = SessionSource("tg", chat_id="5", thread_id="7", user_id="u", user_name="ada")
        with bind_session({"platform": "web", "chat_id": "creator"}):
            bound = bound_context(source, "main:tg:dm:5")
            assert get_session_env(CHAT_ID) == "creator"
        expected = SessionContext("tg", "5", "", "7", "u", "ada", "main:tg:dm:5")
        assert bound.run(current_session) == expected
        assert current_session() is None

    def test_cron_variables_are_cleared_there(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A turn is bound: a stale delivery target in the environment never reaches it."""
        for name in CRON_VAR_NAMES:
            monkeypatch.setenv(name, "stale")
            monkeypatch.setenv(name.replace("CHATLANE_", "HERMES_"), "stale")
        with cron_context("tg", "9"):
            bound = bound_context(SessionSource("tg", chat_id="5"), "k")
        assert bound.run(current_cron_target) is None
        for name in CRON_VAR_NAMES:
            assert bound.run(get_session_env, name, "default") == ""
            assert bound.run(get_session_env, name.replace("CHATLANE_", "HERMES_")) == ""
        child = bound.run(subprocess_env)
        assert {name: child[name] for name in CRON_VAR_NAMES} == dict.fromkeys(CRON_VAR_NAMES, "")
        assert child["HERMES_CRON_AUTO_DELIVER_CHAT_ID"] == ""

    async def test_a_task_created_with_it_sees_the_session_to_its_end(self) -> None:
        async def body() -> list[str]:
            seen = [get_session_env(CHAT_ID)]
            await asyncio.sleep(0)
            seen.append(await run_in_thread(get_session_env, CHAT_ID))
            return seen

        tasks = [
            asyncio.create_task(body(), context=bound_context(SessionSource("tg", chat_id=n), n))
            for n in ("a", "b", "c")
        ]
        assert await asyncio.gather(*tasks) == [["a", "a"], ["b", "b"], ["c", "c"]]

    def test_two_contexts_of_one_session_never_share_a_write(self) -> None:
        source = SessionSource("tg", chat_id="5", user_id="u")
        first, second = bound_context(source, "k"), bound_context(source, "k")
        assert first is not second
        first.run(set_cron_delivery, "tg", "9", "")
        first.run(set_session_vars, "tg", "other")
        assert second.run(current_cron_target) is None
        assert second.run(get_session_env, CHAT_ID) == "5"
        assert bound_context(source, "k").run(get_session_env, CHAT_ID) == "5"

    def test_many_sessions_each_get_their_own(self) -> None:
        sources = [SessionSource("tg", chat_id=str(n)) for n in range(5000)]
        contexts = [bound_context(source, f"k{n}") for n, source in enumerate(sources)]
        assert [c.run(get_session_env, CHAT_ID) for c in contexts] == [str(n) for n in range(5000)]
        assert bound_context(sources[0], "k0").run(get_session_env, CHAT_ID) == "0"


class TestCronContext:
    def test_clears_session_and_sets_target(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(CHAT_ID, "stale")
        with cron_context("tg", 99, None) as target:
            assert target == CronTarget("tg", "99", "")
            assert current_cron_target() == target
            assert get_session_env(CHAT_ID, "dflt") == ""
            assert get_session_env("HERMES_CRON_AUTO_DELIVER_CHAT_ID") == "99"

    def test_restores_previous_values(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(CRON_CHAT_ID, "env")
        set_session_vars(platform="tg", chat_id="1")
        with pytest.raises(RuntimeError), cron_context("web", "2", "3"):
            raise RuntimeError
        assert current_session() == SessionContext(platform="tg", chat_id="1")
        assert current_cron_target() is None
        assert get_session_env(CRON_CHAT_ID) == "env"

    @pytest.mark.asyncio
    async def test_concurrent_jobs_keep_their_targets(self) -> None:
        both_inside = asyncio.Barrier(2)

        async def job(chat_id: str) -> list[CronTarget | None]:
            seen = []
            with cron_context("tg", chat_id, f"t{chat_id}"):
                await both_inside.wait()
                seen.append(current_cron_target())
                await asyncio.sleep(0)
                seen.append(current_cron_target())
            return seen

        a, b = await asyncio.gather(job("a"), job("b"))
        assert a == [CronTarget("tg", "a", "ta")] * 2
        assert b == [CronTarget("tg", "b", "tb")] * 2


class TestTasks:
    @pytest.mark.asyncio
    async def test_child_task_starts_with_copy_and_reset_cleans(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv(CHAT_ID, "env")

        async def handler() -> tuple[str, str]:
            inherited = get_session_env(CHAT_ID)
            reset_session_vars()
            return inherited, get_session_env(CHAT_ID)

        set_session_vars(platform="tg", chat_id="creator")
        inherited, after_reset = await asyncio.create_task(handler())
        assert inherited == "creator"
        assert after_reset == "env"
        assert get_session_env(CHAT_ID) == "creator"

    @pytest.mark.asyncio
    async def test_spawn_keeps_creator_context(self) -> None:
        release = asyncio.Event()

        async def background() -> SessionContext | None:
            await release.wait()
            return current_session()

        with bind_session({"platform": "tg", "chat_id": "1"}) as bound:
            task = spawn(background())
        release.set()
        assert await task == bound

    @pytest.mark.asyncio
    async def test_a_spawned_task_that_calls_exit_fails_alone(self) -> None:
        async def background() -> None:
            sys.exit(2)

        task = spawn(background())
        with pytest.raises(RuntimeError, match=r"called exit \(2\)"):
            await task

        async def still_here() -> str:
            return "the loop goes on"

        assert await asyncio.create_task(still_here()) == "the loop goes on"

    @pytest.mark.asyncio
    async def test_spawn_holds_strong_reference_until_done(self) -> None:
        release = asyncio.Event()

        async def background() -> str:
            await release.wait()
            return get_session_env(CHAT_ID)

        set_session_vars(chat_id="1")
        name = spawn(background(), name="held").get_name()
        gc.collect()
        assert [t.get_name() for t in spawned_tasks()] == [name]
        (task,) = spawned_tasks()
        release.set()
        assert await task == "1"
        assert spawned_tasks() == frozenset()

    @pytest.mark.asyncio
    async def test_spawn_logs_exception(self, caplog: pytest.LogCaptureFixture) -> None:
        async def failing() -> None:
            raise ValueError("lost?")

        task = spawn(failing(), name="failing")
        await asyncio.wait({task})
        records = [r for r in caplog.records if r.name == "chatlane.context"]
        assert len(records) == 1
        assert records[0].levelno == logging.ERROR
        assert "failing" in records[0].getMessage()
        assert records[0].exc_info is not None
        assert isinstance(records[0].exc_info[1], ValueError)


class TestThreads:
    @pytest.mark.asyncio
    async def test_run_in_thread_sees_context_plain_executor_does_not(self) -> None:
        loop = asyncio.get_running_loop()
        with bind_session({"platform": "tg", "chat_id": "1"}):
            in_helper = await run_in_thread(get_session_env, CHAT_ID, "unbound")
            in_plain = await loop.run_in_executor(None, get_session_env, CHAT_ID, "unbound")
        assert in_helper == "1"
        assert in_plain == "unbound"

    @pytest.mark.asyncio
    async def test_run_in_thread_passes_arguments(self) -> None:
        def join(a: str, *, b: str) -> str:
            return a + b + get_session_env(CHAT_ID)

        set_session_vars(chat_id="!")
        assert await run_in_thread(join, "a", b="b") == "ab!"


class TestSubprocessEnv:
    def test_set_values_written_under_both_names(self) -> None:
        set_session_vars(platform="tg", chat_id="42")
        env = subprocess_env({"PATH": "/bin"})
        assert env["PATH"] == "/bin"
        assert env[CHAT_ID] == env[HERMES_CHAT_ID] == "42"
        assert env["CHATLANE_SESSION_USER_ID"] == env["HERMES_SESSION_USER_ID"] == ""

    def test_never_set_left_as_in_base_and_base_not_mutated(self) -> None:
        base = {CRON_CHAT_ID: "base", CHAT_ID: "stale"}
        clear_session_vars()
        env = subprocess_env(base)
        assert env[CRON_CHAT_ID] == "base"
        assert "HERMES_CRON_AUTO_DELIVER_CHAT_ID" not in env
        assert env[CHAT_ID] == env[HERMES_CHAT_ID] == ""
        assert base == {CRON_CHAT_ID: "base", CHAT_ID: "stale"}

    def test_default_base_is_environ(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("SOME_OTHER_VAR", "kept")
        assert subprocess_env()["SOME_OTHER_VAR"] == "kept"
        assert CHAT_ID not in subprocess_env()

    @pytest.mark.parametrize("name", [CHAT_ID, HERMES_CHAT_ID])
    def test_real_subprocess_sees_value(self, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(name, "stale")
        code = f"import os;print(os.environ[{name!r}])"
        with bind_session({"platform": "tg", "chat_id": "-100"}):
            bound = subprocess.run(
                [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, check=True
            )
        cleared = subprocess.run(
            [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, check=True
        )
        assert bound.stdout.decode().strip() == "-100"
        assert cleared.stdout == b"\n"


def test_public_names_are_exported() -> None:
    assert set(ctx.__all__) <= set(dir(ctx))
    assert len(SESSION_VAR_NAMES) == 7
    assert len(CRON_VAR_NAMES) == 3
    assert all(name.startswith("CHATLANE_") for name in ALL_NAMES)
