"""The tests' way of stopping a process between two SQLite transactions sees a held lock."""

from __future__ import annotations

import contextlib
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.pausing import (
    assert_not_held,
    sqlite_file,
    stop_between_transactions,
    write_lock_is_free,
)

HOLDER = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.readline()
db.execute("COMMIT")
print("committed", flush=True)
sys.stdin.readline()
"""


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


def test_the_check_after_a_stop_waits_for_a_writer_and_fails_on_a_lock_never_given_back(
    tmp_path: Path,
) -> None:
    path = tmp_path / "shared.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN IMMEDIATE")
    with pytest.raises(AssertionError, match="stayed held"):
        assert_not_held(path, timeout=0.05)  # as a stopped process that held it
    failures: list[AssertionError] = []

    def check() -> None:
        try:
            assert_not_held(path)
        except AssertionError as failure:
            failures.append(failure)

    checking = threading.Thread(target=check)
    checking.start()
    checking.join(0.5)
    assert checking.is_alive()  # another process's write: it waits for it to end
    holder.execute("ROLLBACK")
    checking.join(30)
    assert not checking.is_alive()
    assert not failures
    assert write_lock_is_free(path)
    holder.close()


def test_only_a_sqlite_url_names_a_file() -> None:
    assert sqlite_file("sqlite:////tmp/a.db?busy_timeout=5") == Path("/tmp/a.db")
    assert sqlite_file("redis://127.0.0.1:6379/0") is None


def test_a_process_is_stopped_only_once_its_transaction_ended(tmp_path: Path) -> None:
    path = tmp_path / "shared.db"
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as setup:
        setup.execute("CREATE TABLE t (x)")
    command = [sys.executable, "-c", HOLDER, str(path)]
    with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE) as child:
        assert child.stdin is not None
        assert child.stdout is not None
        try:
            assert child.stdout.readline() == b"locked\n"
            stopping = threading.Thread(target=stop_between_transactions, args=(child.pid, path))
            stopping.start()
            stopping.join(0.5)
            assert stopping.is_alive()  # it waits for the transaction, never stops the child in it
            child.stdin.write(b"commit\n")
            child.stdin.flush()
            stopping.join(30)
            assert not stopping.is_alive()
            assert Path(f"/proc/{child.pid}/stat").read_text().split(") ")[1][0] == "T"
            assert write_lock_is_free(path)
        finally:
            child.send_signal(signal.SIGCONT)
            child.kill()
