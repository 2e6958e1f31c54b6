"""What users and API clients are told of an error: never a store's file or server."""

from __future__ import annotations

from pathlib import Path

from chatlane.errors import (
    STORE_UNAVAILABLE,
    GatewayFull,
    SessionBusy,
    StoreDamaged,
    StoreError,
    shown_to_users,
)
from chatlane.stores.sqlite_file import damaged


def test_a_store_error_is_shown_as_the_store_being_unavailable() -> None:
    error = StoreError("SQLite store '/srv/chatlane/chatlane.db': database is locked")
    assert shown_to_users(error) == STORE_UNAVAILABLE
    redis = StoreError("redis store redis://cache.internal:6379/0: cannot reach the server")
    assert shown_to_users(redis) == STORE_UNAVAILABLE


def test_damage_is_shown_as_its_condition_without_the_path() -> None:
    error = damaged(Path("/srv/chatlane/chatlane.db"), "disk image malformed")
    assert isinstance(error, StoreDamaged)
    assert "/srv/chatlane" in str(error)  # the operator's log keeps the file
    shown = shown_to_users(error)
    assert shown == "the store is damaged: disk image malformed"
    assert "/srv" not in shown


def test_every_other_error_is_shown_in_its_own_words() -> None:
    full = GatewayFull("queued_bytes", "67108864 bytes wait")
    assert shown_to_users(full) == str(full)
    busy = SessionBusy("session 'x' is running elsewhere", key="x")
    assert shown_to_users(busy) == "session 'x' is running elsewhere"
