"""Another process writing a SQLite store without pause, for the tests of
:mod:`chatlane.stores.sqlite_waiting`.

``python -m tests.stores.busy_writer <database>`` opens the store and writes
from 1,000 tasks at once — calls the writer thread takes, not the loop's
quick ones, so that its batches follow each other with no pause — printing
``writing`` after its first commit. When its stdin closes it stops, prints
its committed transactions and how many writes failed, and exits 1 if any did.
"""

from __future__ import annotations

import asyncio
import sqlite3
import sys
import time
from collections.abc import Callable
from pathlib import Path

from chatlane.errors import StoreError
from chatlane.stores import sqlite_queue as pq
from chatlane.stores.sqlite import SQLiteStore
from chatlane.types import SessionKey
from tests.keys import chat_key

TASKS = 1000


async def write_until_stdin_closes(database: Path) -> int:
    """Write until stdin closes; the writes that failed."""
    store = await SQLiteStore.open(f"sqlite:///{database}")
    stopped = asyncio.Event()
    failed = 0

    async def write(task: int) -> None:
        nonlocal failed
        key = chat_key(f"busy-{task}")
        count = 0
        while not stopped.is_set():
            try:
                await store._write(enqueue(key, f"m{task}-{count}"))
            except StoreError:
                failed += 1
            count += 1
            if task == 0 and count == 1:
                print("writing", flush=True)

    loop = asyncio.get_running_loop()
    loop.add_reader(sys.stdin.fileno(), stopped.set)  # readable at EOF
    try:
        await asyncio.gather(*(write(task) for task in range(TASKS)))
    finally:
        loop.remove_reader(sys.stdin.fileno())
        print(store.stats.transactions, failed, flush=True)
        await store.close()
    return failed


def enqueue(key: SessionKey, message_id: str) -> Callable[[sqlite3.Connection], int]:
    return lambda db: pq.enqueue(db, time.time, key, message_id, "p2", b"x" * 200)


def main() -> None:
    failed = asyncio.run(write_until_stdin_closes(Path(sys.argv[1])))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
