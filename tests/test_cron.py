"""Schedules (cron expressions, intervals), job records, and claiming a tick exactly once."""

from __future__ import annotations

import asyncio
import datetime as dt
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chatlane.cron import (
    LOCAL,
    ORIGIN,
    Claim,
    CronExpression,
    Interval,
    Job,
    JobBook,
    explicit_target,
    parse_schedule,
    run_source,
)
from chatlane.errors import ConfigError, StoreError
from chatlane.identity import ChatType, SessionSource
from chatlane.stores import MemoryStore, Store, open_store
from chatlane.stores.base import Lease
from chatlane.types import SessionKey, Target
from tests.stores.conftest import StoreClock, forget_store, own_schema

UTC = dt.UTC
NEW_YORK = ZoneInfo("America/New_York")


def when(
    year: int,
    month: int,
    day: int,
    hour: int = 0,
    minute: int = 0,
    second: int = 0,
    *,
    tz: dt.tzinfo = UTC,
) -> dt.datetime:
    return dt.datetime(year, month, day, hour, minute, second, tzinfo=tz)


def at(*fields: int, tz: dt.tzinfo = UTC) -> float:
    return when(*fields, tz=tz).timestamp()


def local(moment: float | None, tz: dt.tzinfo = UTC) -> dt.datetime:
    assert moment is not None
    return dt.datetime.fromtimestamp(moment, tz)


class TestCronExpression:
    @pytest.mark.parametrize(
        ("expression", "expected"),
        [
            ("* * * * *", (2024, 1, 1, 12, 1)),
            ("*/15 * * * *", (2024, 1, 1, 12, 15)),
            ("0 9 * * mon-fri", (2024, 1, 2, 9, 0)),
            ("0 9 * * MON-FRI", (2024, 1, 2, 9, 0)),
            ("0 0 29 feb *", (2024, 2, 29, 0, 0)),
            ("5/20 3 1,15 * *", (2024, 1, 15, 3, 5)),
            ("0 0 * * 7", (2024, 1, 7, 0, 0)),
            ("0 0 * * sun", (2024, 1, 7, 0, 0)),
            ("0 12 * * *", (2024, 1, 2, 12, 0)),
            ("0 0 1-3/2 * *", (2024, 1, 3, 0, 0)),
            ("30 8 * jun *", (2024, 6, 1, 8, 30)),
            ("@hourly", (2024, 1, 1, 13, 0)),
            ("@daily", (2024, 1, 2, 0, 0)),
            ("@weekly", (2024, 1, 7, 0, 0)),
            ("@monthly", (2024, 2, 1, 0, 0)),
            ("@yearly", (2025, 1, 1, 0, 0)),
        ],
    )
    def test_next_after(self, expression: str, expected: tuple[int, ...]) -> None:
        moment = at(2024, 1, 1, 12, 0, 30)
        found = CronExpression.parse(expression).next_after(moment)
        assert local(found) == when(*expected)

    def test_strictly_after_a_matching_moment(self) -> None:
        moment = at(2024, 1, 1, 12, 15)
        assert CronExpression.parse("*/15 * * * *").next_after(moment) == moment + 900

    def test_both_day_fields_restricted_means_either(self) -> None:
        every_first_and_sunday = CronExpression.parse("0 0 1 * 0")
        found = every_first_and_sunday.next_after(at(2024, 1, 1, 12))
        assert local(found) == dt.datetime(2024, 1, 7, tzinfo=UTC)
        found = every_first_and_sunday.next_after(at(2024, 1, 28, 12))
        assert local(found) == dt.datetime(2024, 2, 1, tzinfo=UTC)

    def test_one_day_field_starred_means_both(self) -> None:
        sundays_in_march = CronExpression.parse("0 0 */1 3 sun")
        found = sundays_in_march.next_after(at(2024, 1, 1))
        assert local(found) == dt.datetime(2024, 3, 3, tzinfo=UTC)

    @pytest.mark.parametrize(
        ("expression", "message"),
        [
            ("* * * *", "5 fields"),
            ("* * * * * *", "5 fields"),
            ("61 * * * *", "minute: 61 is outside 0-59"),
            ("* 24 * * *", "hour: 24 is outside 0-23"),
            ("* * 0 * *", "day of month: 0 is outside 1-31"),
            ("* * * 13 *", "month: 13 is outside 1-12"),
            ("* * * * 8", "day of week: 8 is outside 0-7"),
            ("*/0 * * * *", "step '0'"),
            ("*/x * * * *", "step 'x'"),
            ("5-1 * * * *", "runs backwards"),
            ("fri-mon * * * *", "minute: 'fri'"),
            ("* * * * fri-mon", "runs backwards"),
            ("1,,2 * * * *", "minute: ''"),
            ("0 0 30 2 *", "never matches"),
            ("0 0 31 apr,jun *", "never matches"),
            ("@sometimes", "5 fields"),
            ("0 0 \u00b2 * *", "day of month: '\u00b2' is not a number"),
            ("0 9 \u0661 * *", "day of month: '\u0661' is not a number"),  # Arabic-Indic 1
            ("*/\u00b2 * * * *", "step '\u00b2'"),
            ("*/" + "9" * 5000 + " * * * *", "step '9999"),
            ("9" * 5000 + " * * * *", "minute: '9999"),
        ],
    )
    def test_malformed_is_refused_with_the_field(self, expression: str, message: str) -> None:
        with pytest.raises(ConfigError, match=message.replace("*", r"\*")):
            CronExpression.parse(expression)

    def test_a_rare_day_is_found_decades_ahead(self) -> None:
        feb_29_on_a_sunday = CronExpression.parse("0 0 29 2 */7")
        assert local(feb_29_on_a_sunday.next_after(at(2032, 3, 1))) == when(2060, 2, 29)
        assert local(feb_29_on_a_sunday.next_after(at(2089, 1, 1))) == when(2128, 2, 29)

    def test_no_tick_beyond_the_years_datetime_names(self) -> None:
        assert CronExpression.parse("@daily").next_after(1e300) is None
        assert CronExpression.parse("@daily").next_after(at(9999, 12, 31, 12)) is None

    def test_daylight_saving_gap_runs_once_at_the_mapped_instant(self) -> None:
        half_past_two = CronExpression.parse("30 2 * * *")
        found = half_past_two.next_after(at(2024, 3, 10, 1, 0, tz=NEW_YORK), tz=NEW_YORK)
        assert local(found, NEW_YORK) == dt.datetime(2024, 3, 10, 3, 30, tzinfo=NEW_YORK)
        after = half_past_two.next_after(found or 0.0, tz=NEW_YORK)
        assert local(after, NEW_YORK) == dt.datetime(2024, 3, 11, 2, 30, tzinfo=NEW_YORK)

    def test_daylight_saving_gap_keeps_ticks_in_order(self) -> None:
        every_half_hour = CronExpression.parse("*/30 * * * *")
        moment = at(2024, 3, 10, 1, 45, tz=NEW_YORK)
        found = every_half_hour.next_after(moment, tz=NEW_YORK)
        assert found == moment + 15 * 60

    def test_repeated_hour_runs_once(self) -> None:
        half_past_one = CronExpression.parse("30 1 * * *")
        first = half_past_one.next_after(at(2024, 11, 3, 0, 0, tz=NEW_YORK), tz=NEW_YORK)
        second = half_past_one.next_after(first or 0.0, tz=NEW_YORK)
        assert first is not None
        assert second is not None
        assert second - first > 23 * 3600

    @settings(max_examples=60)
    @given(
        minute=st.sets(st.integers(0, 59), min_size=1, max_size=4),
        hour=st.sets(st.integers(0, 23), min_size=1, max_size=3),
        offset=st.integers(0, 400 * 86400),
    )
    def test_next_after_is_the_first_match(
        self, minute: set[int], hour: set[int], offset: int
    ) -> None:
        expression = CronExpression.parse(
            f"{','.join(map(str, minute))} {','.join(map(str, hour))} * * *"
        )
        moment = at(2023, 1, 1) + offset
        found = expression.next_after(moment)
        assert found is not None
        assert moment < found <= moment + 86400
        match = local(found)
        assert (match.minute, match.second) in {(m, 0) for m in minute}
        assert match.hour in hour
        for candidate in range(int(moment) // 60 * 60 + 60, int(found), 60):
            earlier = local(candidate)
            assert not (earlier.minute in minute and earlier.hour in hour)


class TestInterval:
    @pytest.mark.parametrize(
        ("text", "seconds", "shown"),
        [
            ("every 30s", 30, "every 30s"),
            ("every 5m", 300, "every 5m"),
            ("every 2h", 7200, "every 2h"),
            ("EVERY 90 seconds", 90, "every 90s"),
            ("every 10 min", 600, "every 10m"),
            ("every 3 hours", 10800, "every 3h"),
        ],
    )
    def test_parse(self, text: str, seconds: int, shown: str) -> None:
        interval = parse_schedule(text)
        assert interval == Interval(shown, seconds)

    @pytest.mark.parametrize("text", ["every 0s", "every 5ms", "every five m", "every 5d", "every"])
    def test_malformed(self, text: str) -> None:
        with pytest.raises(ConfigError):
            parse_schedule(text)

    def test_the_longest_is_366_days(self) -> None:
        assert parse_schedule("every 8784h") == Interval("every 8784h", 366 * 86400)
        for text in ("every 8785h", "every 31622401s", "every " + "9" * 400 + "s"):
            with pytest.raises(ConfigError, match="at most 366 days"):
                parse_schedule(text)
        with pytest.raises(ConfigError, match="reads like"):
            parse_schedule("every " + "9" * 5000 + "s")

    def test_ticks_are_counted_from_the_anchor(self) -> None:
        every_minute = Interval("every 1m", 60)
        assert every_minute.next_after(1000.0, anchor=1000.0) == 1060.0
        assert every_minute.next_after(1059.9, anchor=1000.0) == 1060.0
        assert every_minute.next_after(1060.0, anchor=1000.0) == 1120.0
        assert every_minute.next_after(5.0, anchor=1000.0) == 1060.0


class TestJob:
    def test_configured_id_is_derived_from_the_content(self) -> None:
        first = Job("@daily", "report", "tg:1")
        assert first.id.startswith("cfg-")
        assert Job("@daily", "report", "tg:1").id == first.id
        assert Job("@daily", "other report", "tg:1").id != first.id
        assert Job("@daily", "report", "tg:1", id="mine").id == "mine"

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"prompt": "  "}, "needs a prompt"),
            ({"schedule": "whenever"}, "5 fields"),
            ({"target": ORIGIN}, "origin needs the chat"),
            ({"target": "tg"}, "platform:chat_id"),
            ({"target": "tg::5"}, "platform:chat_id"),
            ({"target": "a:b:c:d"}, "platform:chat_id"),
        ],
    )
    def test_invalid_jobs_are_refused(self, kwargs: dict[str, Any], message: str) -> None:
        fields: dict[str, Any] = {"schedule": "@daily", "prompt": "hi", "target": LOCAL}
        fields.update(kwargs)
        with pytest.raises(ConfigError, match=message):
            Job(**fields)

    def test_explicit_target_unescapes_colons(self) -> None:
        assert explicit_target("matrix:!room%3Aexample.org:t1") == Target(
            "matrix", "!room:example.org", "t1"
        )
        assert explicit_target("tg:-100") == Target("tg", "-100", None)

    def test_run_source_per_target(self) -> None:
        origin = SessionSource("tg", chat_id="c", chat_type=ChatType.GROUP, user_id="u")
        assert run_source(Job("@daily", "x", ORIGIN, origin)) == origin
        assert run_source(Job("@daily", "x", "tg:c")) == SessionSource("tg", chat_id="c")
        threaded = run_source(Job("@daily", "x", "tg:c:t"))
        assert threaded == SessionSource(
            "tg", chat_id="c", chat_type=ChatType.THREAD, thread_id="t"
        )
        job = Job("@daily", "x", LOCAL, id="j1")
        assert run_source(job) == SessionSource(LOCAL, chat_id="j1")


# -- the job book, over every backend --------------------------------------------------------


@pytest.fixture(params=["memory", "sqlite", "redis", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    kind: str = request.param
    if kind == "memory":
        url = "memory://"
    elif kind == "sqlite":
        url = f"sqlite:///{tmp_path / 'cron.db'}"
    elif kind == "postgres":
        url = own_schema(request.getfixturevalue("postgres_url"), "cron")
    else:
        url = f"{request.getfixturevalue('redis_url')}?prefix=cron-{secrets.token_hex(4)}"
    opened = await open_store(url)
    yield opened
    await opened.close()
    await forget_store(url)


def book(store: Store, holder: str = "p1", ttl: float = 30.0) -> JobBook:
    return JobBook(store, "main", holder, ttl)


class TestJobBook:
    async def test_save_load_delete(self, store: Store) -> None:
        origin = SessionSource("tg", chat_id="c", chat_type=ChatType.GROUP, thread_id="t")
        job = Job("*/5 * * * *", "weather?", ORIGIN, origin, id="j1", created_at=12.5)
        jobs = book(store)
        await jobs.save(job)
        await jobs.save(Job("every 1h", "tidy", LOCAL, id="j2"))
        loaded = await book(store, "p2").load()
        assert loaded["j1"] == job
        assert sorted(loaded) == ["j1", "j2"]
        await jobs.delete("j1")
        assert sorted(await jobs.load()) == ["j2"]

    async def test_a_record_that_is_no_longer_a_job_is_skipped(self, store: Store) -> None:
        await store.set_persistent(
            SessionKey("main:scheduler"), None, **{"job:bad": {"schedule": "nope"}}
        )
        await book(store).save(Job("@daily", "fine", id="ok"))
        assert list(await book(store).load()) == ["ok"]

    async def test_a_tick_is_claimed_once(self, store: Store) -> None:
        await book(store).save(Job("@daily", "x", id="j"))
        first, second = book(store, "p1"), book(store, "p2")
        assert await first.claim("j", 100.0) is Claim.CLAIMED
        assert await second.claim("j", 100.0) is Claim.TAKEN
        assert await first.claim("j", 100.0) is Claim.TAKEN
        assert await second.claim("j", 160.0) is Claim.CLAIMED
        assert await first.claim("j", 100.0) is Claim.TAKEN

    async def test_removed_and_configured_jobs(self, store: Store) -> None:
        assert await book(store).claim("gone", 100.0) is Claim.GONE
        assert await book(store).claim("cfg-1", 100.0, stored=False) is Claim.CLAIMED

    async def test_busy_while_another_process_claims(self, store: Store) -> None:
        await store.acquire(SessionKey("main:scheduler:job:j"), "other", 30.0)
        assert await book(store).claim("j", 100.0, stored=False) is Claim.BUSY


class UnreleasingStore(MemoryStore):
    """A memory store that fails to give a lease back, after everything else worked."""

    async def release(self, lease: Lease) -> None:
        raise StoreError("connection lost")


async def test_a_claim_stands_when_its_lease_cannot_be_given_back() -> None:
    clock = StoreClock(real=False)
    store = UnreleasingStore(clock=clock)
    assert await book(store, "p1", ttl=0.05).claim("j", 100.0, stored=False) is Claim.CLAIMED
    await clock.advance(0.1)  # past the lease that was never given back
    assert await book(store, "p2").claim("j", 100.0, stored=False) is Claim.TAKEN


class StallingStore(MemoryStore):
    """A memory store whose first read of job ``j`` is held until ``resume`` is set.

    It plays a process that stalls mid-claim; its clock moves only when the test moves it.
    """

    def __init__(self) -> None:
        self.clock = StoreClock(real=False)
        super().__init__(clock=self.clock)
        self.stalled = asyncio.Event()
        self.resume = asyncio.Event()

    async def load_persistent(self, key: SessionKey) -> dict[str, Any]:
        fields = await super().load_persistent(key)
        if key.endswith(":job:j") and not self.stalled.is_set():
            self.stalled.set()
            await self.resume.wait()
        return fields


async def test_a_claimer_that_stalls_past_its_lease_cannot_claim() -> None:
    store = StallingStore()
    slow = asyncio.create_task(book(store, "slow", ttl=0.05).claim("j", 100.0, stored=False))
    await store.stalled.wait()
    await store.clock.advance(0.1)  # the stalled claimer's lease runs out meanwhile
    assert await book(store, "fast").claim("j", 100.0, stored=False) is Claim.CLAIMED
    store.resume.set()
    assert await slow is Claim.BUSY
    assert await book(store, "slow").claim("j", 100.0, stored=False) is Claim.TAKEN
