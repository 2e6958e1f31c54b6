"""The embedding examples of the docs run as written: each is a program of its own here."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.ports import free_port

DOCS = Path(__file__).resolve().parent.parent / "docs"
MARK = "<!-- run as written by tests/test_docs.py -->\n```python\n"


def examples(page: str) -> list[str]:
    """The Python blocks of ``docs/<page>`` marked as run by this file."""
    text = (DOCS / page).read_text()
    return re.findall(re.escape(MARK) + r"(.*?)```", text, flags=re.DOTALL)


@contextmanager
def running(code: str, tmp_path: Path) -> Iterator[str]:
    """``code`` as a program, configured by the environment; its URL once uvicorn listens."""
    port = free_port()
    script = tmp_path / "app.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATLANE_")}
    env.update(CHATLANE_SERVER__PORT=str(port), CHATLANE_STORE__URL="sqlite:///app.db")
    process = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    seen = []
    try:
        for line in process.stderr:  # uvicorn says when it listens
            seen.append(line)
            if "Uvicorn running on" in line:
                break
        else:
            raise AssertionError("the example did not start:\n" + "".join(seen))
        yield f"http://127.0.0.1:{port}"
        process.send_signal(signal.SIGTERM)
        rest = process.stderr.read()
        # uvicorn shuts down gracefully, then ends by the signal it caught
        assert process.wait(30) in (0, -signal.SIGTERM), "".join(seen) + rest
        assert "Application shutdown complete." in rest
        assert "Traceback" not in rest
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        process.stderr.close()


@pytest.mark.parametrize("page", ["api.md", "web.md"])
def test_each_page_has_its_example(page: str) -> None:
    assert len(examples(page)) == 1


def test_the_api_embedding_example_runs(tmp_path: Path) -> None:
    (code,) = examples("api.md")
    with running(code, tmp_path) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused-on-loopback", max_retries=0)
        reply = client.chat.completions.create(
            model="chatlane", messages=[{"role": "user", "content": "hello"}], user="docs"
        )
        client.close()
    assert reply.choices[0].message.content == "echo: hello"
    assert (tmp_path / "app.db").is_file(), "the configured store"


def test_the_web_embedding_example_runs(tmp_path: Path) -> None:
    (code,) = examples("web.md")
    with running(code, tmp_path) as url:
        page = httpx.get(url + "/", timeout=20)
        assert page.status_code == 200
        assert "<html" in page.text.lower()
        assert httpx.get(url + "/v1/models", timeout=20).status_code == 404, "only the web chat"


def test_a_command_given_by_a_python_agent_answers_under_serve(tmp_path: Path) -> None:
    text = (DOCS / "commands.md").read_text()
    mark = "<!-- mybot.py, run as written by tests/test_docs.py -->\n```python\n"
    (tmp_path / "mybot.py").write_text(text.split(mark)[1].split("```")[0])
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATLANE_")}
    command = [
        "serve",
        "--agent",
        "python:mybot:agent",
        "--port",
        str(port),
        "--store",
        "memory://",
    ]
    process = subprocess.Popen(
        [sys.executable, "-m", "chatlane.cli", *command],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    try:
        seen = []
        for line in process.stdout:  # the banner's last line says it is ready
            seen.append(line)
            if "store:" in line:
                break
        else:
            raise AssertionError("chatlane serve did not start:\n" + "".join(seen))
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)

        def ask(text: str) -> str:
            reply = client.chat.completions.create(
                model="chatlane", messages=[{"role": "user", "content": text}], user="docs"
            )
            return reply.choices[0].message.content or ""

        assert ask("/ping 2") == "pong pong "
        assert "/ping [count] — answer pong" in ask("/help")
        assert ask("/ping x").startswith("the count must be a number from 1 to 100")
        for refused in ("/ping 100000000", "/ping ²", "/ping 0"):
            assert ask(refused).startswith("the count must be a number from 1 to 100")
        assert ask("hello") == "you said: hello"
        client.close()
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
        process.stdout.close()


def test_commands_that_are_not_command_specs_stop_the_start(tmp_path: Path) -> None:
    (tmp_path / "badbot.py").write_text(
        "async def agent(turn):\n    return 'x'\n\nagent.commands = ['/ping']\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATLANE_")}
    command = ["serve", "--agent", "python:badbot:agent", "--port", str(free_port())]
    result = subprocess.run(
        [sys.executable, "-m", "chatlane.cli", *command, "--store", "memory://"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    assert "agent 'python:badbot:agent': its commands must be CommandSpec, not '/ping'" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr
