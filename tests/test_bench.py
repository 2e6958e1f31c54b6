"""The benchmarks still run and check their own results (tiny workloads; no figure is judged)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def run_bench(module: str, *args: str) -> dict[str, Any]:
    """``python -m bench.<module> … --json``; its report (the script raises on a wrong result)."""
    done = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *args, "--rounds", "1", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def test_dispatch_runs_both_sides() -> None:
    report = run_bench("dispatch", "--sessions", "20", "--messages", "3")
    for side in ("chatlane", "aiogram", "aiogram_raw_updates", "floor"):
        assert report[side]["median_us"] > 0
    assert "passed" in report


def test_stores_runs_every_line() -> None:
    report = run_bench("stores", "--sessions", "20", "--turns", "2")
    assert set(report["lines"]) == {
        *(
            f"{store}/{form}"
            for store in ("memory", "sqlite", "redis")
            for form in ("turn", "engine", "unfused", "fused", "fused-bare")
        ),
        *("redis-py/ping", "resp/ping", "aiogram/redis"),
    }
    assert all(line["median_us"] > 0 for line in report["lines"].values())


def test_http_runs_both_servers_in_every_cell() -> None:
    report = run_bench(
        "http", "--sessions", "20", "--requests", "40", "--warmup", "8", "--concurrency", "1,4"
    )
    assert [(c["mode"], c["concurrency"]) for c in report["cells"]] == [
        (mode, n) for mode in ("non-streaming", "streaming") for n in (1, 4)
    ]
    for cell in report["cells"]:
        for side in ("chatlane", "floor"):
            assert cell[side]["median"]["requests_per_s"] > 0
            assert cell[side]["requests_per_round"] == 40
        assert cell["floor"]["events_per_response"] == cell["chatlane"]["events_per_response"]
    assert "passed" in report
