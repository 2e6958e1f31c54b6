"""The tests' way of stopping a process between two SQLite transactions sees a held lock."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from tests.pausing import sqlite_file, write_lock_is_free


def test_a_held_write_lock_is_seen_and_a_free_one_is_left_free(tmp_path: Path) -> None:
    path = tmp_path / "odd name?#.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    assert write_lock_is_free(path)
    holder.execute("BEGIN IMMEDIATE")
    assert not write_lock_is_free(path)
    holder.execute("ROLLBACK")
    assert write_lock_is_free(path)
    holder.execute("INSERT INTO t VALUES (1)")  # the probe gave the lock back
    holder.close()


def test_only_a_sqlite_url_names_a_file() -> None:
    assert sqlite_file("sqlite:////tmp/a.db?busy_timeout=5") == Path("/tmp/a.db")
    assert sqlite_file("redis://127.0.0.1:6379/0") is None
