"""The agent every ``chatlane serve`` of the multi-host test runs, logging its turns.

Each turn appends a ``start`` and an ``end`` line (session key, generation,
pid, the text, a system-wide ``time.monotonic_ns()``; ``end`` also says
whether the turn still held a live lease) to the file named by
``$MULTIHOST_TURN_LOG``. The hosts are network namespaces sharing one
filesystem and one monotonic clock, so the lines of all hosts form one log.
O_APPEND keeps every line whole.

Its reply names the run that produced it: ``reply <text> gen=<g> pid=<pid>``.
A message ``hold …`` holds its session's first turn (generation 1) until the
turn is interrupted, or :data:`HOLD_SECONDS` at most, so a host can be cut off
in the middle of a turn; any later turn of it answers at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from typing import Any

from chatlane.runtime.turn import Turn

LOG_VARIABLE = "MULTIHOST_TURN_LOG"
HOLD_SECONDS = 60.0


class TurnLog:
    """One JSON line per event, written whole with one ``os.write`` on an O_APPEND file."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.pid = os.getpid()

    def write(self, event: str, turn: Turn, **fields: Any) -> None:
        record = {
            "event": event,
            "key": turn.session_key,
            "gen": turn.generation,
            "pid": self.pid,
            "text": turn.text,
            "t": time.monotonic_ns(),
            **fields,
        }
        os.write(self.fd, (json.dumps(record) + "\n").encode())


class LoggingAgent:
    """Logs the turn around a short pause; opens its log at the first turn."""

    def __init__(self) -> None:
        self.log: TurnLog | None = None

    async def __call__(self, turn: Turn) -> str:
        if self.log is None:
            self.log = TurnLog(os.environ[LOG_VARIABLE])
        self.log.write("start", turn)
        try:
            if turn.text.startswith("hold ") and turn.generation == 1:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(turn.interrupted.wait(), HOLD_SECONDS)
            else:
                await asyncio.sleep(0.002)
            return f"reply {turn.text} gen={turn.generation} pid={self.log.pid}"
        finally:
            self.log.write("end", turn, current=turn.is_current())


answer = LoggingAgent()
