"""Real worker processes sharing one store, and the shared log they write."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.pausing import sqlite_file, stop_between_transactions

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Worker:
    name: str
    process: subprocess.Popen[bytes]

    def send(self, chat: str, text: str, message_id: str) -> None:
        line = json.dumps({"chat": chat, "text": text, "id": message_id}) + "\n"
        assert self.process.stdin is not None
        self.process.stdin.write(line.encode())
        self.process.stdin.flush()

    def quit(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(b'{"quit": true}\n')
        self.process.stdin.flush()
        self.process.wait(timeout=20)

    def signal(self, signum: int) -> None:
        os.kill(self.process.pid, signum)


@dataclass
class Cluster:
    """Starts workers on one store URL; reads back what they logged."""

    store_url: str
    log_path: Path
    ttl: float = 1.0
    workers: list[Worker] = field(default_factory=list)
    options: tuple[str, ...] = ()
    """More arguments for every worker (``--ordered``)."""

    def start(self, name: str) -> Worker:
        command = [
            sys.executable,
            "-m",
            "tests.multiprocess.worker",
            "--store",
            self.store_url,
            "--log",
            str(self.log_path),
            "--name",
            name,
            "--ttl",
            str(self.ttl),
            *self.options,
        ]
        process = subprocess.Popen(command, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        worker = Worker(name, process)
        self.workers.append(worker)  # stopped at the end even if it never says it is ready
        assert process.stdout is not None
        ready = process.stdout.readline()
        assert ready.strip() == b"ready", f"worker {name} did not start: {ready!r}"
        return worker

    def stop_all(self) -> None:
        for worker in self.workers:
            if worker.process.poll() is None:
                worker.signal(signal.SIGCONT)
                worker.process.kill()
            worker.process.wait(timeout=10)
            for pipe in (worker.process.stdin, worker.process.stdout):
                if pipe is not None:
                    pipe.close()

    def events(self) -> list[dict[str, Any]]:
        """Every complete line of the log (a worker may be half-way through writing one)."""
        if not self.log_path.exists():
            return []
        text = self.log_path.read_text()
        complete = text[: text.rfind("\n") + 1]
        return [json.loads(line) for line in complete.splitlines() if line.strip()]

    def pause(self, worker: Worker) -> None:
        """Stop ``worker`` (``SIGSTOP``) between two of its transactions (see tests/pausing.py)."""
        stop_between_transactions(worker.process.pid, sqlite_file(self.store_url))

    def wait_for(self, predicate: Any, timeout: float, what: str) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            events = self.events()
            if predicate(events):
                return events
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}")


def answered_ids(events: list[dict[str, Any]]) -> defaultdict[str, list[dict[str, Any]]]:
    """For each message id, the reply and notice deliveries that answered it."""
    answers: defaultdict[str, list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        if event["event"] == "deliver" and event["kind"] in ("reply", "notice"):
            for message_id in event["ids"]:
                answers[message_id].append(event)
    return answers


def turn_intervals(events: list[dict[str, Any]]) -> defaultdict[str, list[tuple[int, int, int]]]:
    """Per session: ``(start, end, generation)`` of every turn that ended, by start time."""
    starts: dict[tuple[str, int], int] = {}
    intervals: defaultdict[str, list[tuple[int, int, int]]] = defaultdict(list)
    for event in events:
        slot = (event["key"], event["gen"]) if event["event"] in ("start", "end") else None
        if slot and event["event"] == "start":
            starts[slot] = event["t"]
        elif slot and slot in starts:
            intervals[slot[0]].append((starts.pop(slot), event["t"], slot[1]))
    for spans in intervals.values():
        spans.sort()
    return intervals
