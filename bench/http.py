"""chatlane's OpenAI-compatible HTTP API next to a bare Starlette floor, over real HTTP.

Two servers, each its own process: ``chatlane serve`` (SQLite store, demo
agent, access token) and the floor (:mod:`bench.http_floor`, the same JSON on
bare Starlette under the same uvicorn settings). The same raw HTTP/1.1 client
(:mod:`bench.http_load`) drives both. What stays true:

* Requests are spread over ``sessions`` sessions (the ``X-Chatlane-Session``
  header), dealt into one lane per concurrent worker by session, so a
  session's requests are sequential and none finds its session busy.
* Every session gets one untimed request first, so no cell pays for creating
  sessions. Each cell (server, mode, concurrency) then warms up on its own
  connections before its timed requests.
* A mode is a completion, the same streamed, or a streamed long reply (the
  demo agent's ``tokens <n>``, the floor streaming the same chunks with the
  same pauses); a long reply's cells send 1/:data:`REPLY_SHARE` of the requests.
* The cells of the two servers are interleaved: for each mode and concurrency
  one after the other, the order alternating by round. The table shows
  medians over rounds.
* A server's CPU time is its process's user + system time (threads included)
  from ``/proc/<pid>/stat``, read after a quiet moment on either side of the
  timed requests.
* Before any cell, one response of each mode from each server is compared:
  the same JSON shape and the same number of events, else :class:`BenchError`.
  Every response is checked (:func:`bench.http_load.check`), and at the end
  chatlane's ``/metrics`` must count exactly one turn per request sent.

Run ``python -m bench.http --help`` for the options.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import http_load
from bench.common import SEED, BenchError, describe_machine, describe_versions, machine, positive
from bench.http_load import CellResult, Target
from chatlane.agents.demo import MAX_TOKENS

SIDES = ("chatlane", "floor")
PRIME_LANES = 16
ROOT = Path(__file__).resolve().parent.parent
"""The folder that holds ``bench``: the servers run elsewhere and must still import it."""
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0


@dataclass(frozen=True, slots=True)
class Goal:
    """chatlane's median ``metric`` over the floor's: at most (or at least) ``bound``."""

    metric: str
    bound: float
    at_most: bool
    concurrencies: frozenset[int] | None
    """Where the goal applies; ``None``: at every concurrency."""

    def applies(self, concurrency: int) -> bool:
        return self.concurrencies is None or concurrency in self.concurrencies

    def met(self, ratio: float) -> bool:
        return ratio <= self.bound if self.at_most else ratio >= self.bound

    def text(self) -> str:
        return f"{'≤' if self.at_most else '≥'} {self.bound:g}x"


GOALS = (
    Goal("requests_per_s", 0.5, at_most=False, concurrencies=frozenset({16, 64})),
    Goal("p50_ms", 2.0, at_most=True, concurrencies=frozenset({1})),
    Goal("p99_ms", 3.0, at_most=True, concurrencies=frozenset({16, 64})),
    Goal("server_cpu_ms", 2.0, at_most=True, concurrencies=None),
)


def _per_second(result: CellResult) -> float:
    return result.requests / (result.wall_ns / 1e9)


METRICS: dict[str, tuple[str, str, Callable[[CellResult], float]]] = {
    "requests_per_s": ("requests/s", ".0f", _per_second),
    "p50_ms": ("p50 ms", ".2f", lambda r: r.percentile_ms(50)),
    "p99_ms": ("p99 ms", ".2f", lambda r: r.percentile_ms(99)),
    "server_cpu_ms": ("server CPU ms/req", ".3f", lambda r: r.server_cpu_s * 1e3 / r.requests),
    "server_cpu_pct": ("server CPU %", ".0f", lambda r: r.server_cpu_s * 1e11 / r.wall_ns),
    "client_cpu_pct": ("client CPU %", ".0f", lambda r: r.client_cpu_s * 1e11 / r.wall_ns),
}
"""Per cell: a label, a format, and how to read it from a result. The CPU percentages
are of one CPU over the timed wall time."""


@dataclass(frozen=True, slots=True)
class Mode:
    """What a cell's requests ask for, and how many of them a cell sends."""

    name: str
    stream: bool
    text: str = http_load.TEXT
    share: int = 1
    """A cell of this mode sends 1/``share`` of ``--requests`` and ``--warmup`` (at least one)."""


NON_STREAMING = Mode("non-streaming", stream=False)
STREAMING = Mode("streaming", stream=True)
REPLY_SHARE = 10
"""A long reply costs tens of the echo's: its cells send a tenth of the requests."""


def long_reply(tokens: int) -> Mode:
    """A stream of ``tokens`` chunks, one event-loop pass apart (the demo's ``tokens <n>``)."""
    return Mode(f"streaming, {tokens}-token reply", True, f"tokens {tokens}", REPLY_SHARE)


@dataclass(frozen=True, slots=True)
class Workload:
    sessions: int
    requests: int
    warmup: int
    rounds: int
    concurrencies: tuple[int, ...]
    reply_tokens: int = 0
    """The tokens of the long reply's cells; 0: no such cells."""

    @property
    def modes(self) -> tuple[Mode, ...]:
        extra = (long_reply(self.reply_tokens),) if self.reply_tokens else ()
        return (NON_STREAMING, STREAMING, *extra)


@dataclass(frozen=True, slots=True)
class Pinning:
    """The CPUs the servers and the load generator run on (``None``: not pinned), and why."""

    servers: frozenset[int] | None
    client: frozenset[int] | None
    text: str


def plan_pinning(enabled: bool) -> Pinning:
    """Servers on the first usable CPU, the load generator on the second, if there are two."""
    usable = sorted(os.sched_getaffinity(0))
    if not enabled:
        return Pinning(None, None, "not pinned (--no-pin)")
    if len(usable) < 2:
        return Pinning(None, None, f"not pinned: only CPU {usable[0]} is usable")
    servers, client = usable[0], usable[1]
    text = f"both servers on CPU {servers}, the load generator on CPU {client}"
    return Pinning(frozenset({servers}), frozenset({client}), text)


# --- the servers ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Server:
    name: str
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    def cpu_seconds(self) -> float:
        """User + system CPU time of the process so far (every thread of it)."""
        stat = Path(f"/proc/{self.process.pid}/stat").read_text()
        fields = stat.rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def chatlane_command(folder: Path, port: int, token_file: Path) -> list[str]:
    """``chatlane serve`` with a configuration of its own: SQLite in ``folder``, demo agent."""
    config = folder / "chatlane.toml"
    store = f"sqlite:///{folder / 'chatlane.db'}"
    config.write_text(
        f'[server]\nhost = "127.0.0.1"\nport = {port}\n'
        f"token = {{ file = {json.dumps(str(token_file))} }}\n\n"
        f"[store]\nurl = {json.dumps(store)}\n\n"
        '[agent]\nname = "demo"\n'
    )
    return [sys.executable, "-m", "chatlane.cli", "serve", "--config", str(config)]


def floor_command(port: int, token_file: Path) -> list[str]:
    module = [sys.executable, "-m", "bench.http_floor"]
    return [*module, "--port", str(port), "--token-file", str(token_file)]


@contextlib.contextmanager
def running(
    name: str, command: list[str], port: int, folder: Path, cpus: frozenset[int] | None
) -> Iterator[Server]:
    """``command`` as a process (on ``cpus``), once it accepts connections; stopped with SIGTERM."""
    log = folder / f"{name}.log"
    pin = None if cpus is None else functools.partial(os.sched_setaffinity, 0, cpus)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    with log.open("wb") as out:
        process = subprocess.Popen(
            command,
            cwd=folder,
            env={**os.environ, "PYTHONPATH": path},
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=pin,
        )
    server = Server(name, process, port, log)
    try:
        wait_ready(server)
        yield server
    finally:
        stop(process)


def wait_ready(server: Server) -> None:
    """:raises BenchError: if the server exits or does not accept connections in time."""
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            break
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", server.port)):
            return
        time.sleep(0.05)
    tail = server.log.read_text(errors="replace")[-2000:]
    raise BenchError(f"{server.name} did not start listening on {server.port}:\n{tail}")


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# --- the workload ----------------------------------------------------------------


def session_name(session: int) -> str:
    return f"bench-{session}"


def plan_requests(requests: int, sessions: int, lanes: int, salt: str) -> list[list[int]]:
    """``requests`` session numbers (round robin over ``sessions``), shuffled by a seed and
    ``salt``, dealt into lanes by session: session ``s`` always goes to lane ``s % lanes``."""
    stream = [i % sessions for i in range(requests)]
    random.Random(f"{SEED}:{salt}").shuffle(stream)
    dealt: list[list[int]] = [[] for _ in range(lanes)]
    for session in stream:
        dealt[session % lanes].append(session)
    return [lane for lane in dealt if lane]


@dataclass(slots=True)
class Side:
    """One server as the client sees it: its targets per mode and what was sent to it."""

    server: Server
    targets: dict[Mode, Target]
    requests: dict[Mode, list[bytes]]
    sent: int = 0

    @classmethod
    def of(cls, server: Server, token: str, workload: Workload) -> Side:
        targets = {m: Target(server.port, token, m.stream, m.text) for m in workload.modes}
        requests = {
            mode: [target.request(session_name(s)) for s in range(workload.sessions)]
            for mode, target in targets.items()
        }
        return cls(server, targets, requests)

    def lanes(self, plan: list[list[int]], mode: Mode) -> list[list[bytes]]:
        self.sent += sum(map(len, plan))
        return [[self.requests[mode][s] for s in lane] for lane in plan]


def shape(value: object) -> object:
    """``value`` with every leaf replaced by its type's name."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(item) for item in value]
    return type(value).__name__


def body_shape(body: bytes, stream: bool) -> object:
    if not stream:
        return shape(json.loads(body))
    events = [e[6:] for e in body.split(b"\n\n") if e.startswith(b"data: ")]
    return [e.decode() if e == b"[DONE]" else shape(json.loads(e)) for e in events]


async def compare_shapes(sides: dict[str, Side], modes: Sequence[Mode]) -> None:
    """:raises BenchError: unless both servers answer each mode with the same shape."""
    for mode in modes:
        shapes = {}
        for name, side in sides.items():
            body = await http_load.post(side.targets[mode], "probe")
            shapes[name] = body_shape(body, mode.stream)
            side.sent += 1
        if shapes["chatlane"] != shapes["floor"]:
            raise BenchError(f"{mode.name} responses differ in shape: {shapes}")


async def count_turns(side: Side) -> None:
    """:raises BenchError: unless chatlane started exactly one turn per request it was sent."""
    metrics = await http_load.get(side.targets[NON_STREAMING], "/metrics")
    name = b"chatlane_turns_started_total "
    lines = [line for line in metrics.splitlines() if line.startswith(name)]
    turns = int(float(lines[0][len(name) :])) if lines else -1
    if turns != side.sent:
        raise BenchError(f"chatlane started {turns} turns for {side.sent} requests")


# --- measuring ---------------------------------------------------------------------

Results = dict[tuple[str, Mode, int], list[CellResult]]


async def measure(sides: dict[str, Side], workload: Workload) -> Results:
    """Compare shapes, prime every session, then run the interleaved rounds."""
    await compare_shapes(sides, workload.modes)
    prime = plan_requests(workload.sessions, workload.sessions, PRIME_LANES, "prime")
    for side in sides.values():
        await http_load.each(side.lanes(prime, NON_STREAMING), side.targets[NON_STREAMING])
    results: Results = {}
    for round_ in range(workload.rounds):
        order = [sides[name] for name in (SIDES if round_ % 2 == 0 else reversed(SIDES))]
        for mode in workload.modes:
            for concurrency in workload.concurrencies:
                for name, result in await run_pair(order, workload, round_, mode, concurrency):
                    results.setdefault((name, mode, concurrency), []).append(result)
    await count_turns(sides["chatlane"])
    return results


async def run_pair(
    order: list[Side], workload: Workload, round_: int, mode: Mode, concurrency: int
) -> list[tuple[str, CellResult]]:
    """One cell on each side, in ``order``, with the same plan of sessions."""
    salt = f"{round_}:{mode.name}:{concurrency}"
    warmups, requests = (max(1, n // mode.share) for n in (workload.warmup, workload.requests))
    warmup = plan_requests(warmups, workload.sessions, concurrency, f"warmup:{salt}")
    timed = plan_requests(requests, workload.sessions, concurrency, salt)
    pair = []
    for side in order:
        result = await http_load.run_cell(
            side.targets[mode],
            side.lanes(warmup, mode),
            side.lanes(timed, mode),
            side.server.cpu_seconds,
        )
        pair.append((side.server.name, result))
    return pair


# --- reporting -----------------------------------------------------------------------


def medians(rounds: list[CellResult]) -> dict[str, float]:
    return {
        key: statistics.median(read(r) for r in rounds) for key, (_, _, read) in METRICS.items()
    }


def cell_json(results: Results, mode: Mode, concurrency: int) -> dict[str, Any]:
    """One mode and concurrency: each side's rounds and medians, the ratios, the goals met."""
    out: dict[str, Any] = {"mode": mode.name, "stream": mode.stream, "concurrency": concurrency}
    for name in SIDES:
        rounds = results[(name, mode, concurrency)]
        out[name] = {
            "median": {key: round(value, 4) for key, value in medians(rounds).items()},
            "rounds": {
                key: [round(read(r), 4) for r in rounds] for key, (_, _, read) in METRICS.items()
            },
            "requests_per_round": rounds[0].requests,
            "events_per_response": events_per_response(rounds),
        }
    mine, floor = out["chatlane"]["median"], out["floor"]["median"]
    out["ratio"] = {
        key: round(mine[key] / floor[key], 3) if floor[key] else None for key in METRICS
    }
    out["goals"] = [goal_json(g, out["ratio"][g.metric]) for g in GOALS if g.applies(concurrency)]
    return out


def events_per_response(rounds: list[CellResult]) -> float:
    """``data:`` events per streamed response (0 for completions)."""
    return round(sum(r.events for r in rounds) / sum(r.requests for r in rounds), 2)


def goal_json(goal: Goal, ratio: float | None) -> dict[str, Any]:
    passed = ratio is not None and goal.met(ratio)
    return {"metric": goal.metric, "target": goal.text(), "ratio": ratio, "passed": passed}


def report_json(
    results: Results, workload: Workload, pinning: Pinning, head: dict[str, Any]
) -> dict[str, Any]:
    cells = [cell_json(results, m, c) for m in workload.modes for c in workload.concurrencies]
    goals = [goal for cell in cells for goal in cell["goals"]]
    return {
        **head,
        "pinning": pinning.text,
        "workload": {
            "sessions": workload.sessions,
            "requests_per_cell": workload.requests,
            "warmup_per_cell": workload.warmup,
            "rounds": workload.rounds,
            "concurrencies": list(workload.concurrencies),
            "reply_tokens": workload.reply_tokens,
            "reply_share": REPLY_SHARE,
        },
        "cells": cells,
        "goals_passed": sum(goal["passed"] for goal in goals),
        "goals": len(goals),
        "passed": all(goal["passed"] for goal in goals),
    }


def render(report: dict[str, Any]) -> str:
    w = report["workload"]
    load_end = " ".join(f"{value:.2f}" for value in report["load_average_end"])
    lines = [
        "chatlane serve (SQLite store, demo agent, token) next to a bare Starlette floor, "
        "both under uvicorn",
        f"command:  {report['command']}",
        f"machine:  {describe_machine(report['machine'])} at start, {load_end} at end",
        f"versions: {describe_versions(report['machine'])}",
        f"pinning:  {report['pinning']}",
        f"workload: {w['sessions']} sessions (each primed with one request); per cell "
        f"{w['warmup_per_cell']} warmup + {w['requests_per_cell']} timed requests; "
        f"{w['rounds']} rounds, sides alternating; medians over rounds"
        + (
            f"; {w['reply_tokens']}-token replies: 1/{w['reply_share']} of those requests"
            if w["reply_tokens"]
            else ""
        ),
        "ratio:    chatlane / floor",
    ]
    for cell in report["cells"]:
        goals = {goal["metric"]: goal for goal in cell["goals"]}
        lines += ["", f"{cell['mode']}, concurrency {cell['concurrency']}"]
        lines.append(f"  {'':<18}{'chatlane':>10}{'floor':>10}{'ratio':>9}  {'target':<7} verdict")
        for key, (label, form, _) in METRICS.items():
            mine, floor = cell["chatlane"]["median"][key], cell["floor"]["median"][key]
            ratio = cell["ratio"][key]
            shown = "-" if ratio is None else f"{ratio:.2f}x"
            goal = goals.get(key)
            target = goal["target"] if goal else ""
            verdict = ("PASS" if goal["passed"] else "FAIL") if goal else ""
            lines.append(
                f"  {label:<18}{mine:>10{form}}{floor:>10{form}}{shown:>9}  {target:<7} {verdict}"
            )
    lines += ["", f"targets met: {report['goals_passed']} of {report['goals']}"]
    return "\n".join(lines)


# --- the command line ---------------------------------------------------------------


def concurrencies(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated whole numbers of at least 1."""
    return tuple(positive(part) for part in text.split(","))


def token_count(text: str) -> int:
    """An argparse type: a whole number of at least 0, at most the demo agent's ``tokens``."""
    if text.isdecimal() and int(text) <= MAX_TOKENS:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a whole number from 0 to {MAX_TOKENS}: {text!r}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    add = parser.add_argument
    add("--sessions", type=positive, default=1_000, help="sessions (default 1000)")
    add("--requests", type=positive, help="timed requests per cell (default 10000; --quick 300)")
    add("--warmup", type=positive, help="warmup requests per cell (default 500; --quick 30)")
    add("--rounds", type=positive, help="rounds of cells per side (default 3; --quick 1)")
    add("--concurrency", type=concurrencies, default=(1, 16, 64), help="default 1,16,64")
    add(
        "--reply-tokens",
        type=token_count,
        default=200,
        help="tokens of the streamed long reply's cells (default 200; 0: no such cells)",
    )
    add("--quick", action="store_true", help="a smoke run: fewer requests, one round")
    add("--no-pin", action="store_true", help="leave the processes on every CPU")
    add("--json", action="store_true", help="print machine-readable results")
    return parser.parse_args(argv)


def workload_of(args: argparse.Namespace) -> Workload:
    quick = args.quick
    return Workload(
        sessions=args.sessions,
        requests=args.requests or (300 if quick else 10_000),
        warmup=args.warmup or (30 if quick else 500),
        rounds=args.rounds or (1 if quick else 3),
        concurrencies=args.concurrency,
        reply_tokens=args.reply_tokens,
    )


def run(workload: Workload, pinning: Pinning) -> Results:
    """Start both servers, pin this process, measure; the servers are stopped however it ends."""
    token = os.urandom(18).hex()
    with tempfile.TemporaryDirectory(prefix="chatlane-bench-http-") as tmp:
        folder = Path(tmp)
        token_file = folder / "token"
        token_file.write_text(token)
        token_file.chmod(0o600)
        ports = {name: free_port() for name in SIDES}
        commands = {
            "chatlane": chatlane_command(folder, ports["chatlane"], token_file),
            "floor": floor_command(ports["floor"], token_file),
        }
        with contextlib.ExitStack() as stack:
            servers = {
                name: stack.enter_context(
                    running(name, commands[name], ports[name], folder, pinning.servers)
                )
                for name in SIDES
            }
            if pinning.client is not None:
                os.sched_setaffinity(0, pinning.client)
            sides = {name: Side.of(server, token, workload) for name, server in servers.items()}
            return asyncio.run(measure(sides, workload))


def main(argv: Sequence[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(arguments)
    workload = workload_of(args)
    pinning = plan_pinning(not args.no_pin)
    head: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "bench.http", *arguments]),
        "machine": machine(),
    }
    results = run(workload, pinning)
    head["load_average_end"] = [round(load, 2) for load in os.getloadavg()]
    report = report_json(results, workload, pinning, head)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
