"""Many sessions through a real gateway, and how a process's memory and CPU are read.

``bench.memory`` and ``bench.scale`` share this module. What stays true:

* Sessions are added through the real ``Gateway`` and ``TurnEngine``: dispatch,
  a turn under a lease, a no-op agent, the committed reply, ``deliver``. Each
  new session gets one message ("hello", answered "ok"). The messages run in
  the lanes of ``bench.dispatch``, so at most ``in_flight`` are in flight, and
  a message is done when its reply was delivered. Nothing here collects
  garbage: a caller that times a step collects before it starts the clock.
* A run checks its own work: every message started a turn and got exactly one
  ``REPLY``, or :class:`~bench.common.BenchError` is raised.
* Every configuration is measured in a fresh Python process of its own
  (:func:`run_child`), so no figure inherits another's heap, caches or file.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from bench.common import BenchError, plan_lanes
from chatlane.gateway import Gateway
from chatlane.identity import SessionSource
from chatlane.runtime.persisted import nothing_to_save
from chatlane.runtime.turn import Turn
from chatlane.state import SessionRegistry
from chatlane.stores import Store, open_store
from chatlane.types import InboundMessage, Outbound, OutboundKind, SessionKey

STORES = ("memory", "sqlite")
ROOT = Path(__file__).resolve().parent.parent
MB = 1024 * 1024
FIRST_SESSION = 1_000


def source(session: int) -> SessionSource:
    """The private chat of session ``session``'s user, as a Telegram adapter would name it."""
    uid = str(FIRST_SESSION + session)
    return SessionSource("telegram", chat_id=uid, user_id=uid)


def rss_bytes() -> int:
    """This process's resident set size now (Linux: ``/proc/self/statm``)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            resident_pages = int(statm.read().split()[1])
    except OSError as error:
        raise BenchError(f"cannot read this process's resident memory: {error}") from error
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def settled_rss() -> int:
    """The resident set size after a full garbage collection."""
    gc.collect()
    return rss_bytes()


@asynccontextmanager
async def bench_store(kind: str, folder: Path) -> AsyncIterator[Store]:
    """A new, empty store of ``kind``: in memory, or a SQLite file ``folder/chatlane.db``."""
    url = "memory://" if kind == "memory" else f"sqlite:///{folder / 'chatlane.db'}"
    store = await open_store(url)
    try:
        yield store
    finally:
        await store.close()


class Population:
    """A gateway on ``store`` and the sessions added to it so far, numbered from 0.

    :param room: the registry keeps this many sessions and evicts idle ones
        beyond it; ``None`` keeps the engine's own registry (room for 10,000).
    """

    def __init__(self, store: Store, room: int | None = None) -> None:
        registry = None
        if room is not None:
            registry = SessionRegistry(on_evict=nothing_to_save, max_sessions=room)
        self.gateway = Gateway(self.agent, self.deliver, registry=registry, store=store)
        self.store = store
        self.count = 0
        self.replies = 0
        self._waiting: dict[str, asyncio.Future[None]] = {}

    @property
    def registry(self) -> SessionRegistry:
        return self.gateway.engine.registry

    def key(self, session: int) -> SessionKey:
        return self.gateway.session_key(InboundMessage(source(session), ""))

    async def agent(self, turn: Turn) -> str:
        return "ok"

    async def deliver(self, outbound: Outbound) -> None:
        done = self._waiting.pop(outbound.in_reply_to[0])
        if outbound.kind is not OutboundKind.REPLY:
            done.set_exception(BenchError(f"chatlane sent a {outbound.kind}: {outbound.text}"))
            return
        self.replies += 1
        done.set_result(None)

    async def handle(self, message: InboundMessage) -> None:
        done = asyncio.get_running_loop().create_future()
        self._waiting[message.id] = done
        result = await self.gateway.dispatch(message)
        if not result.started:
            raise BenchError(f"chatlane did not start a turn: {result}")
        await done

    async def add(self, sessions: int, in_flight: int) -> None:
        """Add ``sessions`` new sessions, one message each; raises unless each was answered."""
        first = self.count
        self.count += sessions
        await self.send(range(first, first + sessions), in_flight)

    async def send(self, sessions: Sequence[int], in_flight: int) -> None:
        """One message to each of ``sessions`` (new or not), in lanes; each must be answered.

        Each message is made just before it is sent: the inputs of many sessions
        never sit in memory together, where they would count as the sessions' memory.
        """
        lanes = plan_lanes(len(sessions), 1, in_flight)
        made = [(InboundMessage(source(sessions[i]), "hello") for i in lane) for lane in lanes]
        await self.run(made, len(sessions))

    def prepare(self, sessions: int, in_flight: int) -> list[list[InboundMessage]]:
        """The first messages of ``sessions`` new sessions, in lanes, for :meth:`run` to time."""
        first = self.count
        self.count += sessions
        lanes = plan_lanes(sessions, 1, in_flight)
        return [[InboundMessage(source(first + i), "hello") for i in lane] for lane in lanes]

    async def run(self, lanes: Sequence[Iterable[InboundMessage]], messages: int) -> None:
        """Send every lane's messages in order, lanes at once; ``messages`` must be answered."""
        expected = self.replies + messages
        await asyncio.gather(*(self._lane(lane) for lane in lanes))
        if self.replies != expected:
            raise BenchError(f"chatlane: {self.replies} replies, expected {expected}")

    async def _lane(self, messages: Iterable[InboundMessage]) -> None:
        for message in messages:
            await self.handle(message)

    async def aclose(self) -> None:
        await self.gateway.aclose()


def run_child(module: str, config: dict[str, Any]) -> dict[str, Any]:
    """Run ``python -m bench.<module> --child <config>`` in a fresh process; its JSON result.

    :raises BenchError: if the child failed (its error output is included).
    """
    done = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", "--child", json.dumps(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise BenchError(f"bench.{module} {config}: exit {done.returncode}\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def command_line(module: str, argv: Sequence[str] | None) -> str:
    """How the benchmark was started, for the head of its table."""
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join(["python", "-m", f"bench.{module}", *args])


def peak_rss_bytes() -> int:
    """The highest resident set size this process reached (Linux: ``VmHWM``)."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise BenchError("no VmHWM in /proc/self/status")
