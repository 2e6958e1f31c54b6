"""The embedding examples of the docs run as written: each is a program of its own here."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

DOCS = Path(__file__).resolve().parent.parent / "docs"
MARK = "<!-- run as written by tests/test_docs.py -->\n```python\n"


def examples(page: str) -> list[str]:
    """The Python blocks of ``docs/<page>`` marked as run by this file."""
    text = (DOCS / page).read_text()
    return re.findall(re.escape(MARK) + r"(.*?)```", text, flags=re.DOTALL)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


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
