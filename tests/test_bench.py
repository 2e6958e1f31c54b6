"""The benchmarks still run and check their own results (tiny workloads; no figure is judged)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def run_bench(module: str, *args: str, rounds: bool = True) -> dict[str, Any]:
    """``python -m bench.<module> … --json``; its report (the script raises on a wrong result).

    :param rounds: pass ``--rounds 1`` (every script that times rounds takes it).
    """
    one_round = ["--rounds", "1"] if rounds else []
    done = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *args, *one_round, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def test_dispatch_runs_every_side() -> None:
    report = run_bench("dispatch", "--sessions", "20", "--messages", "3")
    sides = report["sides"]
    assert list(sides) == ["chatlane", "chatlane/raw", "aiogram", "aiogram/raw", "floor"]
    for side in sides.values():
        for clock in ("wall", "cpu"):
            assert len(side[clock]["rounds_us"]) == 1
            assert side[clock]["median_us"] > 0
    assert set(report["ratios"]) == {
        "chatlane / floor",
        "chatlane / aiogram",
        "aiogram / floor",
        "chatlane/raw / aiogram/raw",
    }
    assert all(ratio["cpu"] > 0 and ratio["wall"] > 0 for ratio in report["ratios"].values())
    assert [target["limit"] for target in report["targets"]] == [3.0, 0.25]
    assert report["passed"] == all(target["passed"] for target in report["targets"])
    versions = report["machine"]["versions"]
    assert versions["aiogram"] == metadata.version("aiogram")
    assert versions["redis"] == metadata.version("redis")
    assert versions["sqlite"] == sqlite3.sqlite_version


def test_stores_runs_every_line() -> None:
    report = run_bench("stores", "--sessions", "20", "--turns", "2")
    durable = ["sqlite", "redis", *(() if "postgres" in report["skipped"] else ("postgres",))]
    assert set(report["lines"]) == {
        *(
            f"{store}/{form}"
            for store in ("memory", *durable)
            for form in ("turn", "engine", "unfused", "fused", "fused-bare")
        ),
        *("redis-py/ping", "resp/ping", "aiogram/redis"),
    }
    for line in report["lines"].values():
        for clock in ("wall", "cpu"):
            assert len(line[clock]["rounds_us"]) == 1
            assert line[clock]["median_us"] > 0
    assert set(report["ratios"]) == {
        f"{store}/{form} / memory/{form}" for store in durable for form in ("engine", "fused")
    }
    assert [target["limit"] for target in report["targets"]][1:] == [150.0, 8.0, 8.0]
    assert report["passed"] == all(target["passed"] for target in report["targets"])


def test_stores_skips_a_backend_without_a_server_saying_why() -> None:
    from bench.common import machine
    from bench.stores import FORMS, Report, Servers, Workload, plan_lines, render

    servers = Servers(skipped=(("postgres", "no server here"),))
    assert list(plan_lines(["memory", "postgres"], servers)) == [f"memory/{f}" for f in FORMS]
    report = Report(Workload(1, 1, 1), None, {}, machine(), servers.skipped)
    assert "postgres: skipped (no server here)" in render(report)
    assert report.as_json()["skipped"] == {"postgres": "no server here"}


def test_stores_judges_durable_engine_turns_against_memory_on_cpu() -> None:
    from bench.common import Rounds
    from bench.stores import Report, Workload

    def line(cpu: float) -> Rounds:
        return Rounds(wall_us=(cpu * 3,), cpu_us=(cpu,))

    lines = {
        "memory/fused": line(10.0),
        "sqlite/fused": line(79.0),
        "redis/fused": line(81.0),
        "memory/engine": line(10.0),
        "sqlite/engine": line(90.0),
        "sqlite/turn": line(151.0),
    }
    report = Report(Workload(1, 1, 1), None, lines, {})
    verdicts = {target.rule.split(",")[0]: target.passed for target in report.targets()}
    assert verdicts == {
        "sqlite turn <= 150 µs": False,
        "sqlite engine turn (fused) / memory's <= 8x": True,
        "redis engine turn (fused) / memory's <= 8x": False,
    }
    assert report.ratios() == {
        "sqlite/engine / memory/engine": (9.0, 9.0),
        "sqlite/fused / memory/fused": (7.9, 7.9),
        "redis/fused / memory/fused": (8.1, 8.1),
    }


def test_http_runs_both_servers_in_every_cell() -> None:
    report = run_bench(
        "http", "--sessions", "20", "--requests", "40", "--warmup", "8", "--concurrency", "1,4",
        "--reply-tokens", "30",
    )  # fmt: skip
    modes = ("non-streaming", "streaming", "streaming, 30-token reply")
    assert [(c["mode"], c["concurrency"]) for c in report["cells"]] == [
        (mode, n) for mode in modes for n in (1, 4)
    ]
    for cell in report["cells"]:
        long = cell["mode"] == modes[2]
        for side in ("chatlane", "floor"):
            assert cell[side]["median"]["requests_per_s"] > 0
            assert cell[side]["requests_per_round"] == (4 if long else 40)
        assert cell["floor"]["events_per_response"] == cell["chatlane"]["events_per_response"]
        assert cell["chatlane"]["events_per_response"] == (
            33 if long else 0 if not cell["stream"] else 7
        )
    assert report["goals"] == 3 * 3  # each mode: CPU at 1 and 4, p50 at 1 (none at 4 alone)
    assert "passed" in report


@pytest.mark.timeout(240)  # a process per configuration, each filled with sessions
def test_memory_measures_every_configuration_and_brings_sessions_back() -> None:
    args = ["--sessions", "120", "--warmup", "10", "--sample", "5", "--room", "40"]
    report = run_bench("memory", *args, rounds=False)
    configurations = report["configurations"]
    assert [(c["store"], c["registry"]) for c in configurations] == [
        (store, registry) for store in ("memory", "sqlite") for registry in ("evicting", "resident")
    ]
    for c in configurations:
        assert c["sampled_came_back"] == 5
        evicting = c["registry"] == "evicting"
        assert c["sampled_left_memory"] == (5 if evicting else 0)
        assert c["resident_sessions"] == (40 if evicting else 130)
    assert len(report["targets"]) == 3
    assert report["machine"]["cpus"] >= 1


def test_scale_prints_the_curve_of_each_store_and_the_file_size() -> None:
    report = run_bench("scale", "--checkpoints", "20,40", "--probes", "5")
    for store in ("memory", "sqlite"):
        curve = report["stores"][store]["curve"]
        assert [point["sessions"] for point in curve] == [20, 40]
        assert all(point["median_us"] > 0 for point in curve)
    assert report["stores"]["sqlite"]["file"]["sessions"] == 45  # 40, then 5 probes
    assert report["stores"]["memory"]["file"] is None
    assert len(report["targets"]) == 3
