"""What the shared turn log and the store say about a run, as figures and as failures.

The log holds a ``start`` and an ``end`` line per turn from every host (see
:mod:`tests.multihost.agent`); the store holds each session's transcript, in
which a committed answer is one ``assistant`` entry.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from chatlane.stores import Store
from chatlane.types import SessionKey


class Span(NamedTuple):
    """One turn of a session: start and end (monotonic ns), generation, pid, lease kept till end."""

    start: int
    end: int
    gen: int
    pid: int
    live: bool


def read_log(path: Path) -> list[dict[str, Any]]:
    """Every complete line of the log (a host may be half-way through writing one)."""
    text = path.read_text() if path.exists() else ""
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


def running(path: Path, texts: list[str]) -> bool:
    """Whether the log at ``path`` shows a turn of each of ``texts`` started and not ended."""
    balance: Counter[str] = Counter()
    for event in read_log(path):
        balance[event["text"]] += 1 if event["event"] == "start" else -1
    return all(balance[text] > 0 for text in texts)


@dataclass
class Turns:
    """The turns in the log, per session, by start time; those that never ended; fenced ones."""

    spans: defaultdict[str, list[Span]] = field(default_factory=lambda: defaultdict(list))
    unended: list[dict[str, Any]] = field(default_factory=list)
    stale: list[dict[str, Any]] = field(default_factory=list)
    runs: Counter[str] = field(default_factory=Counter)

    def pids(self) -> set[int]:
        return {span.pid for spans in self.spans.values() for span in spans}

    def live(self) -> dict[str, list[Span]]:
        """Per session, only the turns that still held their lease when they ended."""
        return {key: [s for s in spans if s.live] for key, spans in self.spans.items()}


def turns(events: list[dict[str, Any]]) -> Turns:
    found = Turns()
    starts: dict[tuple[str, int, int], dict[str, Any]] = {}
    for event in events:
        slot = (event["key"], event["gen"], event["pid"])
        if event["event"] == "start":
            starts[slot] = event
            found.runs[event["text"]] += 1
            continue
        start = starts.pop(slot)
        span = Span(start["t"], event["t"], event["gen"], event["pid"], event["current"])
        found.spans[event["key"]].append(span)
        if not event["current"]:
            found.stale.append(event)
    found.unended = list(starts.values())
    for spans in found.spans.values():
        spans.sort()
    return found


def max_concurrent(spans: list[Span]) -> int:
    """The most turns of one session running at one instant (an end before a start at a tie)."""
    edges = sorted([(s.start, 1) for s in spans] + [(s.end, -1) for s in spans])
    running = most = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


def overlaps(spans_by_key: dict[str, list[Span]]) -> list[str]:
    """Each pair of consecutive turns of a session that overlapped or kept the generation."""
    problems = []
    for key, spans in spans_by_key.items():
        for before, after in itertools.pairwise(spans):
            if before.end > after.start:
                problems.append(f"{key}: turns {before} and {after} overlapped")
            if after.gen <= before.gen:
                problems.append(f"{key}: generation {after.gen} after {before.gen}")
    return problems


async def committed(store: Store, sessions: list[str]) -> Counter[str]:
    """How many assistant entries each input text has in the transcripts of ``sessions``."""
    answers: Counter[str] = Counter()
    for session in sessions:
        for entry in await store.transcript(SessionKey(f"main:api:dm:{session}"), limit=10_000):
            if entry.role == "assistant":
                answers[entry.content.split(" gen=")[0].removeprefix("reply ")] += 1
    return answers
