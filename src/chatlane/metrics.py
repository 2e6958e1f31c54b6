"""Prometheus metrics: what the engine counts, rendered in the text exposition format.

Counters only grow; the queue-depth gauge is read at scrape time from the
live sessions, so it is never stale. Rendering needs no client library.
"""

from __future__ import annotations

import bisect
import gc
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse
    from starlette.routing import BaseRoute

    from chatlane.hub import Hub
    from chatlane.runtime.leases import BeatGaps
    from chatlane.stores.base import DeliveryStats
    from chatlane.stores.sqlite_writer import WriterStats

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    """Counters the engine updates as turns run."""

    def __init__(self) -> None:
        self.turns_started = 0
        self.turns_finished: Counter[str] = Counter()
        self.busy_outcomes: Counter[tuple[str, str]] = Counter()
        self.lease_failures = 0
        self.stale_refused = 0
        self.messages_failed = 0
        self.taken_back = 0
        self.senders_refused: Counter[str] = Counter()
        self.deliveries: Counter[str] = Counter()
        self._latency_counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self._latency_sum = 0.0

    def turn_started(self) -> None:
        self.turns_started += 1

    def turn_finished(self, outcome: str, seconds: float) -> None:
        """``outcome``: answered, failed, fenced, stopped, … (the turn's end)."""
        self.turns_finished[outcome] += 1
        self._latency_counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self._latency_sum += seconds

    def busy(self, outcome: str, policy: str) -> None:
        self.busy_outcomes[(outcome, policy)] += 1

    def lease_failure(self) -> None:
        self.lease_failures += 1

    def stale(self) -> None:
        self.stale_refused += 1

    def failed(self, count: int) -> None:
        """``count`` messages were set aside as failed (kept for an operator to retry)."""
        self.messages_failed += count

    def took_back(self) -> None:
        """A message told it was not taken, which the store had kept all the same (a call
        whose answer was lost), was dropped from the store again."""
        self.taken_back += 1

    def refused(self, platform: str) -> None:
        """A message from a sender not on ``platform``'s allowlist was refused."""
        self.senders_refused[platform] += 1

    def delivery(self, outcome: str) -> None:
        """A delivery attempt ended: ``delivered``, ``retried``, ``released`` or ``dead``."""
        self.deliveries[outcome] += 1

    def render(
        self,
        queue_depth: int,
        running: int,
        beats: BeatGaps | None = None,
        store_damaged: bool = False,
        sqlite: WriterStats | None = None,
        ledger: DeliveryStats | None = None,
    ) -> str:
        """The exposition text (with the SQLite store's counters when ``sqlite`` is given,
        and the delivery ledger's gauges when ``ledger`` is)."""
        lines = [
            *self._turns(queue_depth, running),
            *self._refusals(store_damaged),
            *(_liveness(beats) if beats is not None else []),
            *(_sqlite(sqlite) if sqlite is not None else []),
            *(self._ledger(ledger) if ledger is not None else []),
            *self._histogram(),
            *_collector(),
        ]
        return "\n".join(lines) + "\n"

    def _turns(self, queue_depth: int, running: int) -> list[str]:
        """Turns started, ended and running, and the messages that wait for one."""
        return [
            *_metric(
                "chatlane_turns_started_total",
                "counter",
                "Turns that started.",
                [("", self.turns_started)],
            ),
            *_metric(
                "chatlane_turns_finished_total",
                "counter",
                "Turns that ended, by outcome.",
                [(f'outcome="{o}"', n) for o, n in sorted(self.turns_finished.items())],
            ),
            *_metric(
                "chatlane_busy_outcomes_total",
                "counter",
                "Messages that arrived while their session was busy, by outcome and policy.",
                [
                    (f'outcome="{o}",policy="{p}"', n)
                    for (o, p), n in sorted(self.busy_outcomes.items())
                ],
            ),
            *_metric(
                "chatlane_queue_depth",
                "gauge",
                "Messages waiting for a turn, or steered into a running one and not taken yet.",
                [("", queue_depth)],
            ),
            *_metric("chatlane_turns_running", "gauge", "Turns running now.", [("", running)]),
        ]

    def _refusals(self, store_damaged: bool) -> list[str]:
        """What was refused or set aside: a damaged store, lost leases, stale writes, failed
        messages, messages taken back, unknown senders."""
        return [
            *_metric(
                "chatlane_store_damaged",
                "gauge",
                "1 once the store found damage (the gateway then refuses every message).",
                [("", int(store_damaged))],
            ),
            *_metric(
                "chatlane_lease_failures_total",
                "counter",
                "Leases lost or not renewed.",
                [("", self.lease_failures)],
            ),
            *_metric(
                "chatlane_stale_writes_refused_total",
                "counter",
                "Writes and replies of stale turns that were refused.",
                [("", self.stale_refused)],
            ),
            *_metric(
                "chatlane_messages_failed_total",
                "counter",
                "Messages set aside as failed (kept; an operator can run them again).",
                [("", self.messages_failed)],
            ),
            *_metric(
                "chatlane_messages_taken_back_total",
                "counter",
                "Messages told they were not taken that the store had kept all the same "
                "(a call whose answer was lost), dropped from it again.",
                [("", self.taken_back)],
            ),
            *_metric(
                "chatlane_senders_refused_total",
                "counter",
                "Messages refused because their sender is not on the allowlist, by platform.",
                [(f'platform="{p}"', n) for p, n in sorted(self.senders_refused.items())],
            ),
        ]

    def _ledger(self, stats: DeliveryStats) -> list[str]:
        oldest = max(time.time() - stats.oldest_pending_at, 0.0) if stats.pending else 0.0
        return [
            *_metric(
                "chatlane_delivery_attempts_total",
                "counter",
                "Delivery attempts by outcome (delivered, retried, released, dead).",
                [(f'outcome="{o}"', n) for o, n in sorted(self.deliveries.items())],
            ),
            *_metric(
                "chatlane_deliveries_pending",
                "gauge",
                "Deliveries recorded and not yet accepted by their platform.",
                [("", stats.pending)],
            ),
            *_metric(
                "chatlane_delivery_oldest_pending_seconds",
                "gauge",
                "Age of the oldest pending delivery (0 when none is pending).",
                [("", round(oldest, 3))],
            ),
            *_metric(
                "chatlane_deliveries_dead",
                "gauge",
                "Deliveries given up on (dead letters), kept until retried or pruned.",
                [("", stats.dead)],
            ),
        ]

    def _histogram(self) -> list[str]:
        name = "chatlane_turn_duration_seconds"
        lines = [f"# HELP {name} How long turns ran.", f"# TYPE {name} histogram"]
        total = 0
        for bound, count in zip(
            (*LATENCY_BUCKETS, float("inf")), self._latency_counts, strict=True
        ):
            total += count
            shown = "+Inf" if bound == float("inf") else f"{bound:g}"
            lines.append(f'{name}_bucket{{le="{shown}"}} {total}')
        lines += [f"{name}_sum {self._latency_sum:.6f}", f"{name}_count {total}"]
        return lines

    def routes(self, hub: Hub) -> Sequence[BaseRoute]:
        """``GET /metrics``: behind the access token unless ``server.metrics_public``."""
        from starlette.responses import PlainTextResponse
        from starlette.routing import Route

        from chatlane.stores.sqlite import SQLiteStore

        public = hub.config.server.metrics_public

        async def endpoint(request: Request) -> PlainTextResponse:
            refused = None if public else _refusal(request, hub)
            if refused is not None:
                return refused
            engine = hub.gateway.engine
            damaged = hub.store.damaged is not None
            sqlite = hub.store.stats if isinstance(hub.store, SQLiteStore) else None
            ledger = await _ledger_stats(hub)
            text = self.render(
                engine.queue_depth(),
                engine.running_count(),
                engine.leases.beats,
                damaged,
                sqlite,
                ledger,
            )
            return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

        return [Route("/metrics", endpoint, methods=["GET"])]


def _refusal(request: Request, hub: Hub) -> PlainTextResponse | None:
    """``None`` if the request carries the access token (or none is configured); else 401,
    or 429 with ``Retry-After`` while its client address is blocked for wrong tokens."""
    from starlette.responses import PlainTextResponse

    from chatlane.access import TooManyGuesses, client_address

    try:
        if hub.access.check_bearer(request.headers, client_address(request)):
            return None
    except TooManyGuesses as blocked:
        headers = {"Retry-After": str(blocked.seconds)}
        return PlainTextResponse(f"{blocked}\n", status_code=429, headers=headers)
    return PlainTextResponse(
        "a valid bearer token is required\n",
        status_code=401,
        headers={"WWW-Authenticate": "Bearer"},
    )


def _sqlite(stats: WriterStats) -> list[str]:
    on_thread = stats.transactions - stats.on_loop
    return [
        *_metric(
            "chatlane_sqlite_transactions_total",
            "counter",
            "SQLite transactions committed, by the thread that ran them.",
            [('thread="loop"', stats.on_loop), ('thread="writer"', on_thread)],
        ),
        *_metric(
            "chatlane_sqlite_operations_total",
            "counter",
            "Store calls those transactions ran.",
            [("", stats.operations)],
        ),
        *_metric(
            "chatlane_sqlite_handed_over_total",
            "counter",
            "Batches of a turn's writes the event loop gave the writer thread: calls were "
            "queued there, a checkpoint ran, another process held the lock, or a batch was slow.",
            [("", stats.handed_over)],
        ),
        *_metric(
            "chatlane_sqlite_lock_waits_total",
            "counter",
            "Write transactions that found another process holding the write lock and "
            "waited for it (waited), or found another process's writer waiting and let it "
            "in first (let_in): processes sharing the file take turns.",
            [('side="waited"', stats.lock.waited), ('side="let_in"', stats.lock.let_in)],
        ),
        *_metric(
            "chatlane_sqlite_checkpoints_total",
            "counter",
            "Checkpoints of the WAL into the database file: beside the writes, or held "
            "(the writer thread's, its writes held, once the WAL grew past its bound).",
            [('kind="beside"', stats.checkpoints), ('kind="held"', stats.held_checkpoints)],
        ),
    ]


def _collector() -> list[str]:
    """Python's garbage collector: full collections hold up every request in flight."""
    return [
        *_metric(
            "python_gc_collections_total",
            "counter",
            "Collections the garbage collector ran, by generation (2 is a full one).",
            [(f'generation="{g}"', s["collections"]) for g, s in enumerate(gc.get_stats())],
        ),
        *_metric(
            "python_gc_frozen_objects",
            "gauge",
            "Objects kept out of every collection (what chatlane serve made at its start).",
            [("", gc.get_freeze_count())],
        ),
    ]


def _liveness(beats: BeatGaps) -> list[str]:
    return [
        *_metric(
            "chatlane_heartbeats_total",
            "counter",
            "Heartbeats this process wrote to the store.",
            [("", beats.count)],
        ),
        *_metric(
            "chatlane_heartbeat_gap_max_seconds",
            "gauge",
            "The longest time between two of this process's heartbeats.",
            [("", round(beats.longest, 3))],
        ),
    ]


def _metric(
    name: str, kind: str, help_text: str, samples: list[tuple[str, int | float]]
) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        lines.append(f"{name}{{{labels}}} {value}" if labels else f"{name} {value}")
    return lines


async def _ledger_stats(hub: Hub) -> DeliveryStats | None:
    """The ledger at a glance, when the gateway delivers through it and the store answers."""
    from chatlane.errors import StoreError

    if hub.gateway.delivery is None:
        return None
    try:
        return await hub.store.delivery_stats()
    except StoreError:
        return None
