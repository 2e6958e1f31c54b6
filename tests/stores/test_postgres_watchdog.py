"""The PostgreSQL store's watchdog: one timer bounds every call under way (no server needed;
``test_postgres_half_open.py`` bounds real calls with it)."""

from __future__ import annotations

import asyncio
from typing import Any

from chatlane.stores.postgres.pools import WATCH_TICKS, Watchdog, watch_tick
from chatlane.stores.postgres.url import parse_url


class Watched:
    """Stands for a call: notes when the watchdog ends it."""

    def __init__(self) -> None:
        self.ended = asyncio.Event()

    def expire(self) -> None:
        self.ended.set()


def timer_of(watchdog: Watchdog) -> Any:
    return watchdog._timer


async def test_only_a_call_past_its_deadline_is_ended_and_the_timer_stops_with_the_calls() -> None:
    watchdog = Watchdog(0.01)
    late, lasting, forgotten = Watched(), Watched(), Watched()
    moment = asyncio.get_running_loop().time()
    watchdog.watch(late, moment)
    watchdog.watch(lasting, moment + 3600)
    watchdog.watch(forgotten, moment)
    watchdog.forget(forgotten)
    await late.ended.wait()
    assert not lasting.ended.is_set()
    assert not forgotten.ended.is_set()
    assert timer_of(watchdog) is not None  # still watching one
    watchdog.forget(lasting)
    stopped = asyncio.Event()
    watchdog.watch(Stopper(stopped), moment)
    await stopped.wait()
    assert timer_of(watchdog) is None  # nothing watched: no timer left running


class Stopper(Watched):
    """Ended by the watchdog's last tick; sets ``stopped`` once that tick re-armed nothing."""

    def __init__(self, stopped: asyncio.Event) -> None:
        super().__init__()
        self._stopped = stopped

    def expire(self) -> None:
        asyncio.get_running_loop().call_soon(self._stopped.set)  # after the tick ends


async def test_a_second_watch_moves_the_deadline_and_stop_ends_the_timer() -> None:
    watchdog = Watchdog(0.01)
    call = Watched()
    moment = asyncio.get_running_loop().time()
    watchdog.watch(call, moment)
    watchdog.watch(call, moment + 3600)
    watchdog.stop()
    assert timer_of(watchdog) is None
    assert not call.ended.is_set()


def test_the_tick_is_an_eighth_of_the_shortest_limit() -> None:
    assert WATCH_TICKS == 8
    assert watch_tick(parse_url("postgresql://h/db")) == 2 / 8  # renew_timeout's default
    assert watch_tick(parse_url("postgresql://h/db?command_timeout=0.4")) == 0.4 / 8


class Failing(Watched):
    def expire(self) -> None:
        super().expire()
        raise OSError("closing its connection failed")


async def test_a_call_that_fails_to_end_leaves_the_others_watched() -> None:
    watchdog = Watchdog(0.01)
    moment = asyncio.get_running_loop().time()
    failing, later = Failing(), Watched()
    watchdog.watch(failing, moment)
    watchdog.watch(later, moment + 0.02)
    await later.ended.wait()  # the loop reports the failure; the timer goes on
    assert failing.ended.is_set()
