"""``chatlane serve`` as people run it: a real process, real HTTP, a graceful stop."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
import msgspec
import pytest

from chatlane.config import Config, Secret, ServerConfig, StoreConfig
from chatlane.secrets import resolve_secrets
from chatlane.serve import STOPPED, STOPPED_MEMORY, announce, freeze_the_start, require_token
from tests.pausing import stop_between_transactions
from tests.ports import free_port
from tests.serving import reaped

ROOT = Path(__file__).resolve().parent.parent


def start(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "chatlane.cli", "serve", *args]
    return subprocess.Popen(
        command,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )


def wait_ready(process: subprocess.Popen[str], timeout: float = 30) -> str:
    assert process.stdout is not None
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            break
        seen.append(line)
        if "store:" in line:
            return "".join(seen)
    raise AssertionError("chatlane serve did not become ready:\n" + "".join(seen))


def stop(process: subprocess.Popen[str]) -> int:
    process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout=20)
    finally:
        if process.stdout is not None:
            process.stdout.close()
    return code


@pytest.mark.slow
def test_serve_with_no_config_runs_the_web_chat_and_api(tmp_path: Path) -> None:
    port = free_port()
    process = start(tmp_path, "--port", str(port))
    try:
        banner = wait_ready(process)
        base = f"http://127.0.0.1:{port}"
        assert f"web chat: {base}/" in banner
        assert "sqlite:///chatlane.db" in banner
        assert httpx.get(base + "/").status_code == 200
        models = httpx.get(base + "/v1/models").json()
        assert models["data"]
        reply = httpx.post(
            base + "/v1/chat/completions",
            timeout=20,
            headers={"X-Chatlane-Session": "serve-test"},
            json={"model": "chatlane", "messages": [{"role": "user", "content": "whoami"}]},
        )
        content = reply.json()["choices"][0]["message"]["content"]
        assert "key=main:api:dm:serve-test" in content
        metrics = httpx.get(base + "/metrics").text
        assert "chatlane_turns_started_total 1" in metrics
        sessions = httpx.get(base + "/admin/sessions").json()["sessions"]
        assert [s["key"] for s in sessions] == ["main:api:dm:serve-test"]
        frozen = re.search(r"^python_gc_frozen_objects (\d+)$", metrics, re.MULTILINE)
        assert frozen is not None
        assert int(frozen[1]) > 10_000  # the start's objects
    finally:
        assert stop(process) == 0
    assert (tmp_path / "chatlane.db").exists()


@pytest.mark.parametrize(
    ("store", "line"), [("memory://", STOPPED_MEMORY), ("sqlite:///chatlane.db", STOPPED)]
)
def test_the_stop_line_says_whether_the_store_keeps_what_waits(
    tmp_path: Path, store: str, line: str
) -> None:
    with reaped(start(tmp_path, "--port", str(free_port()), "--store", store)) as process:
        wait_ready(process)
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=30)
    assert process.returncode == 0
    assert output.splitlines()[-1] == line


class _Cycle:
    """An object that refers to itself: only the garbage collector can free it."""

    def __init__(self) -> None:
        self.me = self


def test_the_start_frees_its_garbage_then_keeps_the_rest_out_of_collections() -> None:
    garbage, kept = _Cycle(), _Cycle()
    garbage_ref, kept_ref = weakref.ref(garbage), weakref.ref(kept)
    del garbage
    try:
        freeze_the_start()
        assert garbage_ref() is None  # collected before the freeze, not frozen with the rest
        assert gc.get_freeze_count() > 0
        del kept
        gc.collect()
        assert kept_ref() is not None  # frozen: no collection walks it
    finally:
        gc.unfreeze()
    gc.collect()
    assert kept_ref() is None


def read_response(sock: socket.socket) -> bytes:
    """One whole HTTP response with a ``Content-Length`` from ``sock``."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += received(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += received(sock)
    return head


def received(sock: socket.socket) -> bytes:
    data = sock.recv(65536)
    assert data, "the server closed the connection in the middle of a response"
    return data


@pytest.mark.slow
def test_an_idle_connection_is_closed_after_the_keep_alive_setting(tmp_path: Path) -> None:
    port = free_port()
    process = start(tmp_path, "--port", str(port), "--store", "memory://", "--keep-alive", "1")
    try:
        wait_ready(process)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            for _ in range(2):  # the connection is kept for a second request
                sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                head = read_response(sock)
                assert head.startswith(b"HTTP/1.1 200")
                assert b"connection: close" not in head.lower()
            assert sock.recv(1) == b""  # then, idle, it is closed by the server
    finally:
        assert stop(process) == 0


@pytest.mark.slow
def test_accepted_messages_survive_a_restart(tmp_path: Path) -> None:
    port = free_port()
    process = start(tmp_path, "--port", str(port))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(process)
        with httpx.Client(timeout=5) as client:
            body = {"model": "chatlane", "messages": [{"role": "user", "content": "sleep 30"}]}
            headers = {"X-Chatlane-Session": "restart"}
            with contextlib.suppress(httpx.TimeoutException):
                client.post(base + "/v1/chat/completions", json=body, headers=headers, timeout=1)
    finally:
        assert stop(process) == 0
    assert len(pending_ids(tmp_path, "main:api:dm:restart")) == 1


def wait_for_metrics(port: int, *lines: str) -> None:
    """Return once the gateway's ``/metrics`` shows every one of ``lines``."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        shown = httpx.get(f"http://127.0.0.1:{port}/metrics").text.splitlines()
        if all(line in shown for line in lines):
            return
        time.sleep(0.02)
    raise AssertionError(f"/metrics never showed {lines}")


def pending_ids(tmp_path: Path, key: str) -> list[str]:
    """The ids of ``key``'s messages still queued in ``tmp_path``'s SQLite store."""
    script = (
        "import asyncio, json, sys\n"
        "from chatlane.stores import open_store\n"
        "async def main():\n"
        "    s = await open_store('sqlite:///chatlane.db')\n"
        "    pending = await s.pending(sys.argv[1])\n"
        "    print(json.dumps([r.message_id for r in pending]))\n"
        "    await s.close()\n"
        "asyncio.run(main())\n"
    )
    command = [sys.executable, "-c", script, key]
    detail = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, check=True)
    ids: list[str] = json.loads(detail.stdout)
    return ids


@pytest.mark.slow
def test_requests_waiting_at_shutdown_get_503_and_their_messages_stay(tmp_path: Path) -> None:
    port = free_port()
    process = start(tmp_path, "--port", str(port))
    answers: dict[str, tuple[int, str]] = {}
    retry: dict[str, str | None] = {}

    def ask(name: str, content: str, stream: bool = False) -> None:
        body = {"model": "chatlane", "messages": [{"role": "user", "content": content}]}
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        headers = {"X-Chatlane-Session": "shutdown"}
        with (
            httpx.Client(timeout=30) as client,
            client.stream("POST", url, json={**body, "stream": stream}, headers=headers) as reply,
        ):
            answers[name] = (reply.status_code, reply.read().decode())
            retry[name] = reply.headers.get("x-should-retry")

    asks = [("running", "sleep 30", False), ("queued", "q1", False), ("streamed", "q2", True)]
    threads = [threading.Thread(target=ask, args=a) for a in asks]
    try:
        wait_ready(process)
        for queued, thread in enumerate(threads):
            thread.start()  # in this order: the first runs, the others queue behind it
            wait_for_metrics(port, "chatlane_turns_running 1", f"chatlane_queue_depth {queued}")
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    for thread in threads:
        thread.join(timeout=30)
    assert process.returncode == 0
    assert "Traceback" not in output
    assert output.rstrip().endswith(STOPPED)
    assert "Cancel" not in output, output  # no request was still open when uvicorn gave up
    assert answers["running"][0] == answers["queued"][0] == 503
    error = json.loads(answers["running"][1])["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "service_unavailable")
    assert retry["running"] == retry["queued"] == "false"  # the SDK would run them twice
    status, events = answers["streamed"]
    assert status == 200
    assert '"code": "service_unavailable"' in events
    assert events.rstrip().endswith("data: [DONE]")
    assert len(pending_ids(tmp_path, "main:api:dm:shutdown")) == 3


def refuses_connections(port: int) -> bool:
    """Whether nothing listens on ``port`` any more (a connection made as the listener
    closed is reset)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except (ConnectionRefusedError, ConnectionResetError):
        return True
    return False


@pytest.mark.slow
def test_a_second_ctrl_c_ends_the_wait_for_open_requests_without_a_traceback(
    tmp_path: Path,
) -> None:
    port = free_port()
    process = start(tmp_path, "--port", str(port))
    try:
        wait_ready(process)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            body = b'{"model": "chatlane", "messages": ['  # the rest never comes
            head = (
                "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                "Content-Type: application/json\r\nX-Chatlane-Session: half\r\n"
                "Content-Length: 1000\r\n\r\n"
            )
            sock.sendall(head.encode() + body)
            process.send_signal(signal.SIGINT)
            # no new connection is taken: the server waits for the half-sent request
            wait_for(lambda: refuses_connections(port), "the server to stop listening")
            process.send_signal(signal.SIGINT)  # stop waiting for it
            output, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0
    assert "Traceback" not in output, output
    assert output.rstrip().endswith(STOPPED)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_paused_gateways_requests_get_the_answer_another_one_committed(tmp_path: Path) -> None:
    """Gateway A is stopped (SIGSTOP) past the lease TTL mid-turn; B adopts and answers.

    Once A runs again, its waiting requests — one plain, one streamed — get
    B's answer, never "dropped".
    """
    env = {"CHATLANE_RUNTIME__LEASE_TTL": "1.5"}
    ports = free_port(), free_port()
    first, second = (start(tmp_path, "--port", str(port), env=env) for port in ports)
    sessions = {"plain": False, "streamed": True}
    answers: dict[str, str] = {}
    threads = [
        threading.Thread(target=ask_into, args=(answers, ports[0], name, "sleep 3", stream))
        for name, stream in sessions.items()
    ]
    keys = [f"main:api:dm:{name}" for name in sessions]
    try:
        wait_ready(first)
        wait_ready(second)
        for thread in threads:
            thread.start()
        wait_for(lambda: held_leases(tmp_path, keys) == len(keys), "the turns to start on A")
        stop_between_transactions(first.pid, tmp_path / "chatlane.db")
        wait_for(lambda: answered_count(tmp_path, keys) == len(keys), "B's answers")
        first.send_signal(signal.SIGCONT)
        for thread in threads:
            thread.join(timeout=60)
    finally:
        first.send_signal(signal.SIGCONT)
        stop(first)
        stop(second)
    assert answers == {"plain": "slept 3", "streamed": "slept 3"}


def ask_into(answers: dict[str, str], port: int, session: str, text: str, stream: bool) -> None:
    """Ask ``session`` on ``port``; put the answer (streamed chunks joined) in ``answers``."""
    body = {"model": "chatlane", "messages": [{"role": "user", "content": text}], "stream": stream}
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    with httpx.Client(timeout=60) as client:
        reply = client.post(url, json=body, headers={"X-Chatlane-Session": session})
    if not stream:
        answers[session] = reply.json()["choices"][0]["message"]["content"]
        return
    events = [
        line[len("data: ") :] for line in reply.text.splitlines() if line.startswith("data: ")
    ]
    chunks = [json.loads(event) for event in events if event != "[DONE]"]
    answers[session] = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def held_leases(tmp_path: Path, keys: list[str]) -> int:
    """How many of ``keys`` hold a live lease in ``tmp_path``'s SQLite store."""
    marks = ",".join("?" * len(keys))
    sql = f"SELECT count(*) FROM leases WHERE key IN ({marks}) AND expires_at > ?"
    return stored_count(tmp_path, sql, (*keys, time.time()))


def answered_count(tmp_path: Path, keys: list[str]) -> int:
    """How many answers to ``keys`` are committed in ``tmp_path``'s SQLite store.

    A commit writes the answer to the transcript and marks its messages
    answered in one transaction, so either tells.
    """
    marks = ",".join("?" * len(keys))
    sql = (
        "SELECT count(*) FROM transcript t JOIN sessions s ON t.conversation_id = "
        f"s.current_conversation WHERE s.key IN ({marks}) AND t.role = 'assistant'"
    )
    return stored_count(tmp_path, sql, keys)


def stored_count(tmp_path: Path, sql: str, params: Sequence[object]) -> int:
    path = tmp_path / "chatlane.db"
    if not path.exists():
        return 0
    with contextlib.closing(sqlite3.connect(path, timeout=5)) as db:
        try:
            found: int = db.execute(sql, tuple(params)).fetchone()[0]
        except sqlite3.OperationalError:  # the schema is not there yet
            return 0
    return found


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--busy", "later"], "--busy: 'later' is not one of"),
        (["--store", "ftp://x"], "store URL 'ftp://x'"),
        (
            ["--store", "postgresql://postgres@127.0.0.1:1/postgres?pool_max=99999999999999999999"],
            "pool_max must be a whole number from 1 to 1000",
        ),
        (["--store", "sqlite:///t.db?busy_timeout=²"], "busy_timeout must be a whole number"),
        (
            ["--store", "postgresql://postgres:top/hunter2@127.0.0.1/postgres"],
            "postgres store URL: malformed",
        ),
        (["--agent", "python:nowhere:agent"], "cannot import it"),
        (["--host", "0.0.0.0"], "needs a token"),
        (["--host", "999.1.1.1"], "'999.1.1.1': expected an IP address or a host name"),
        (["--host", "not a host!"], "expected an IP address or a host name"),
        (["--port", "70000"], "--port 70000: expected a port between 1 and 65535"),
        (["--port", "0"], "--port 0: expected a port"),
        (["--host", ""], "--host: expected a value"),
        (["--store", ""], "--store: expected a value"),
        (["--keep-alive", "0"], "--keep-alive 0: expected a whole number of seconds > 0"),
    ],
)
def test_bad_options_stop_the_start_with_a_clear_message(
    tmp_path: Path, args: list[str], message: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CHATLANE_TOKEN"}
    # a free port, not 8080, which a gateway on this machine may hold (a --port in args wins)
    port = ["--port", str(free_port())]
    result = subprocess.run(
        [sys.executable, "-m", "chatlane.cli", "serve", *port, *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert result.returncode == 1
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert "hunter2" not in result.stderr


def test_a_port_in_use_stops_the_start_with_a_hint(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "chatlane.cli", "serve", "--port", str(port)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert result.returncode == 1
    assert f"port {port} on 127.0.0.1 is already in use" in result.stderr
    assert "--port <another port>" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "chatlane.db").exists()  # nothing started, nothing created


async def test_connections_to_the_bound_address_send_without_delay() -> None:
    """Accepted connections have Nagle's algorithm off, as asyncio's own sockets do.

    With it on, an answer written in two parts (headers, then body) waits for
    the client's delayed ACK before its second part: about 40 ms a request.
    """
    import asyncio

    from chatlane.serve import bind_socket

    config = Config(server=ServerConfig(host="127.0.0.1", port=0))
    accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(on_connect, sock=bind_socket(config))
    async with server:
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await accepted != 0
        writer.close()


def test_broken_config_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "chatlane.toml").write_text("[server]\nport = 'eighty'\n")
    result = subprocess.run(
        [sys.executable, "-m", "chatlane.cli", "serve", "--config", "chatlane.toml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    assert "configuration key 'server.port' = 'eighty'" in result.stderr


def test_logs_carry_the_session_key_and_generation() -> None:
    import logging

    from chatlane.logs import JsonFormatter, TextFormatter, turn_fields

    record = logging.LogRecord(
        "chatlane.runtime", logging.INFO, __file__, 1, "fenced stale %s", ("reply",), None
    )
    for name, value in turn_fields("main:web:dm:x", 7).items():
        setattr(record, name, value)
    assert TextFormatter().format(record).endswith("fenced stale reply session=main:web:dm:x gen=7")
    entry = json.loads(JsonFormatter().format(record))
    assert (entry["session_key"], entry["generation"], entry["message"]) == (
        "main:web:dm:x",
        7,
        "fenced stale reply",
    )


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"CHATLANE_TELEGRAM__ENABLED": "true"}, "telegram is enabled but has no bot token"),
        (
            {
                "CHATLANE_TELEGRAM__ENABLED": "true",
                "TELEGRAM_BOT_TOKEN": "1:x",
                "CHATLANE_TELEGRAM__API_URL": "http://127.0.0.1:9",
            },
            "Telegram Bot API",
        ),
    ],
)
def test_an_adapter_that_cannot_start_stops_the_start_cleanly(
    tmp_path: Path, env: dict[str, str], message: str
) -> None:
    base = {k: v for k, v in os.environ.items() if k != "TELEGRAM_BOT_TOKEN"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "chatlane.cli",
            "serve",
            "--port",
            str(free_port()),
            "--store",
            "memory://",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**base, **env},
        timeout=60,
    )
    assert result.returncode == 1
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert "1:x" not in result.stderr


@pytest.mark.parametrize(
    "url",
    [
        "redis://:hunter2-secret@redis.internal:6379/0",
        "postgresql://bot:hunter2-secret@db.internal/chatlane",
        "redis+sentinel://h1,h2/main?sentinel_password=hunter2-secret",
        "redis://:top@hunter2-secret@redis.internal:6379/0",
        "postgresql://bot:top@hunter2-secret@db.internal/chatlane",
        "redis+sentinel://:top@hunter2-secret@h1,h2/main",
    ],
)
def test_the_start_banner_never_shows_the_stores_password(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    announce(Config(store=StoreConfig(url=url)))
    printed = capsys.readouterr().out
    assert "hunter2-secret" not in printed
    assert "store:" in printed


def test_a_token_variable_that_is_not_set_is_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    """A loopback gateway may run without a token; one configured from a variable that is
    not set most likely has its name mistyped."""
    config = Config(server=ServerConfig(token=Secret(env="NOPE_NOT_SET")))
    with caplog.at_level(logging.WARNING, logger="chatlane.server"):
        require_token(config, resolve_secrets(config, {}))
    assert "the environment variable NOPE_NOT_SET, which gives nothing" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="chatlane.server"):
        require_token(Config(), resolve_secrets(Config(), {}))  # the default: no token, quietly
    assert caplog.text == ""


def test_the_start_banner_lists_the_chat_platforms_enabled(
    capsys: pytest.CaptureFixture[str],
) -> None:
    announce(Config())
    assert "chats:" not in capsys.readouterr().out
    enabled = {"enabled": True}
    config = msgspec.convert({"telegram": enabled, "discord": enabled}, Config)
    announce(config)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2] == "  chats:    telegram, discord"
    assert lines[-1].startswith("  store:")  # last: what waiting for the start reads


def test_the_start_banner_brackets_an_ipv6_address(capsys: pytest.CaptureFixture[str]) -> None:
    announce(Config(server=ServerConfig(host="::1", port=18188)))
    printed = capsys.readouterr().out
    assert "web chat: http://[::1]:18188/" in printed
    assert "http://::1:" not in printed


WITHOUT = (
    "import runpy, sys; sys.modules.update(dict.fromkeys(sys.argv[1].split(',')));"
    " sys.argv = ['chatlane', *sys.argv[2:]]; runpy.run_module('chatlane.cli', run_name='__main__')"
)
"""Runs ``chatlane`` as if the modules named in its first argument were not installed."""

TOKENS = ("TELEGRAM_BOT_TOKEN", "SLACK_BOT_TOKEN", "SLACK_SIGNING_SECRET", "DISCORD_BOT_TOKEN")
"""Left unset: a missing extra is named first, before any missing token."""


@pytest.mark.parametrize(
    ("extra", "missing", "options", "enabled"),
    [
        ("redis", "hiredis", ["--store", "redis://127.0.0.1:1/0"], None),
        ("postgres", "asyncpg", ["--store", "postgresql://u@127.0.0.1:1/db"], None),
        ("openai", "openai", ["--agent", "openai"], None),
        ("telegram", "telegram", [], "TELEGRAM"),
        ("slack", "slack_sdk", [], "SLACK"),
        ("discord", "discord", [], "DISCORD"),
    ],
)
def test_a_missing_extra_stops_the_start_in_one_line_naming_the_pip_install(
    tmp_path: Path, extra: str, missing: str, options: list[str], enabled: str | None
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATLANE_") and k not in TOKENS}
    env["OPENAI_API_KEY"] = "sk-test"
    if enabled is not None:
        env[f"CHATLANE_{enabled}__ENABLED"] = "true"
    command = ["serve", "--port", str(free_port()), "--store", "memory://", *options]
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT, missing, *command],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert line.startswith("Error: the ")
    assert f" needs the {extra} extra (" in line
    assert line.endswith(f"pip install 'chatlane[{extra}]'")


def test_a_store_in_a_missing_folder_stops_the_start_in_one_line(tmp_path: Path) -> None:
    store = "sqlite:///missing/chatlane.db"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATLANE_")}
    command = ["serve", "--port", str(free_port()), "--store", store]
    result = subprocess.run(
        [sys.executable, "-m", "chatlane.cli", *command],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"Error: cannot create SQLite store '{tmp_path}/missing/chatlane.db': "
        f"'{tmp_path}/missing' does not exist (chatlane creates the database file, not its folder)"
    ]
    assert not (tmp_path / "missing").exists()


def test_the_start_banner_shows_a_sqlite_stores_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    announce(Config(store=StoreConfig(url="sqlite:///data/chat.db")))
    printed = capsys.readouterr().out
    assert f"store:    sqlite:///data/chat.db (file {tmp_path}/data/chat.db)" in printed
    announce(Config(store=StoreConfig(url="sqlite:////srv/bot/chat.db")))
    assert "store:    sqlite:////srv/bot/chat.db (file /srv/bot/chat.db)" in capsys.readouterr().out
