"""``chatlane serve`` on a damaged SQLite store: refused at start, reported while running."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.keys import chat_key
from tests.ports import free_port
from tests.stores.test_sqlite_damage import damage_the_second_half, fill, write_from_elsewhere
from tests.test_serve import start, stop, wait_ready

KEY = chat_key("big", "api")


def serve_once(tmp_path: Path, port: int) -> subprocess.CompletedProcess[str]:
    """Run ``chatlane serve`` expecting it to refuse to start."""
    return subprocess.run(
        [sys.executable, "-m", "chatlane.cli", "serve", "--port", str(port)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )


def ask(base: str, text: str) -> httpx.Response:
    body = {"model": "chatlane", "messages": [{"role": "user", "content": text}]}
    headers = {"X-Chatlane-Session": "big"}
    return httpx.post(base + "/v1/chat/completions", json=body, headers=headers, timeout=20)


@pytest.mark.slow
def test_a_wal_deleted_after_kill_9_stops_the_next_start(tmp_path: Path) -> None:
    port = free_port()
    process = start(tmp_path, "--port", str(port))
    try:
        wait_ready(process)
        assert ask(f"http://127.0.0.1:{port}", "hello").status_code == 200
    finally:
        process.send_signal(signal.SIGKILL)
        process.communicate(timeout=30)
    os.unlink(tmp_path / "chatlane.db-wal")
    result = serve_once(tmp_path, port)
    assert result.returncode == 1
    assert "the write-ahead log was deleted or truncated" in result.stderr
    assert "Put the -wal file back" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["emptied", "second half overwritten"])
def test_a_damaged_store_stops_the_start(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "chatlane.db"
    asyncio.run(fill(path, key=KEY))
    if damage == "emptied":
        path.write_bytes(b"")
    else:
        damage_the_second_half(path)
    result = serve_once(tmp_path, free_port())
    assert result.returncode == 1
    assert f"SQLite store {str(path.name)!r} is damaged" in result.stderr
    assert "restore the store from a backup" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_damage_found_while_serving_turns_health_unhealthy(tmp_path: Path) -> None:
    path = tmp_path / "chatlane.db"
    asyncio.run(fill(path, key=KEY))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    process = start(tmp_path, "--port", str(port))
    try:
        wait_ready(process)
        assert httpx.get(base + "/health").json() == {"status": "ok"}
        damage_the_second_half(path)
        write_from_elsewhere(path)
        detail = httpx.get(f"{base}/admin/sessions/{KEY}")
        assert detail.status_code == 503
        assert "database disk image is malformed" in detail.json()["error"]
        health = httpx.get(base + "/health")
        assert health.status_code == 503
        assert health.json() == {
            "status": "unhealthy",
            "reason": "the store is damaged: database disk image is malformed",
        }
        assert "chatlane_store_damaged 1" in httpx.get(base + "/metrics").text
        refused = ask(base, "hello")
        assert refused.status_code == 503
        assert "is damaged: database disk image is malformed" in refused.text
        assert str(tmp_path) not in refused.text  # the condition, not the file
    finally:
        code = stop(process)
    assert code == 0
