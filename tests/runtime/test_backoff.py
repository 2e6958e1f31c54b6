"""Store calls retried through an outage (:mod:`chatlane.runtime.backoff`)."""

from __future__ import annotations

import pytest

from chatlane.errors import StoreDamaged, StoreError
from chatlane.runtime.backoff import retry_store


async def test_a_call_is_retried_until_the_store_answers() -> None:
    answers: list[object] = [StoreError("away"), StoreError("away"), "done"]

    async def call() -> str:
        answer = answers.pop(0)
        if isinstance(answer, StoreError):
            raise answer
        return str(answer)

    assert await retry_store(call, wanted=lambda: True, what="a call") == "done"
    assert answers == []


async def test_a_call_no_longer_wanted_after_the_wait_is_not_made_again() -> None:
    """What is wanted is asked again once the wait is over: a turn that went stale
    while its commit waited out the outage must not commit then."""
    calls = 0
    answers = iter([True, False])  # wanted when it failed, no longer once the wait is over

    async def call() -> None:
        nonlocal calls
        calls += 1
        raise StoreError("away")

    with pytest.raises(StoreError, match="away"):
        await retry_store(call, wanted=lambda: next(answers), what="a commit")
    assert calls == 1


async def test_damage_is_never_waited_out() -> None:
    calls = 0

    async def call() -> None:
        nonlocal calls
        calls += 1
        raise StoreDamaged("malformed", "database disk image is malformed")

    with pytest.raises(StoreDamaged):
        await retry_store(call, wanted=lambda: True, what="a call")
    assert calls == 1
