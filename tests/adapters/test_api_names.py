"""Session names over the real HTTP API: each is used exactly as sent, or refused with a 400."""

from __future__ import annotations

import asyncio
import json
import queue
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatlane.identity import SessionSource, build_session_key
from tests.adapters.test_api import TOKEN, make_config, serve
from tests.test_identity import TRICKY

AUTH = f"Bearer {TOKEN}".encode()
WHOAMI = {"messages": [{"role": "user", "content": "whoami"}]}


def api_key(name: str) -> str:
    """The key of the session ``name`` names, when it is used exactly as sent."""
    return build_session_key(SessionSource("api", chat_id=name, user_id=name))


# ``str.strip`` makes all four one name; only the first may name a session.
REFUSED_ALIKE = [
    (" x:y", "U+0020 (SPACE), whitespace at the start, at position 0"),
    ("x:y\x1c", "U+001C, a control character, at position 3"),
    ("x:y\u0085", "U+0085, a control character, at position 3"),
]


async def test_names_that_strip_alike_are_refused_not_merged(tmp_path: Path) -> None:
    async with serve(make_config(tmp_path)) as s, httpx.AsyncClient() as http:
        assert f"key={api_key('x:y')} " in await s.ask("whoami", "x:y")
        for name, problem in REFUSED_ALIKE:
            with pytest.raises(openai.BadRequestError) as caught:
                await s.ask("whoami", name)
            assert f"the 'user' field has {problem}" in caught.value.message
        url = f"{s.base_url}/chat/completions"
        for name, problem in REFUSED_ALIKE[1:]:  # HTTP itself drops a header's outer spaces
            headers = {b"Authorization": AUTH, b"X-Chatlane-Session": name.encode()}
            response = await http.post(url, json={**WHOAMI, "user": "x:y"}, headers=headers)
            assert response.status_code == 400
            message = response.json()["error"]["message"]
            assert f"the X-Chatlane-Session header has {problem}" in message
        sessions = [key for key, _ in s.hub.gateway.engine.registry.items()]
        assert sessions == [api_key("x:y")]


async def test_an_empty_header_leaves_the_name_to_user_and_a_blank_user_is_refused(
    tmp_path: Path,
) -> None:
    async with serve(make_config(tmp_path)) as s, httpx.AsyncClient() as http:
        url = f"{s.base_url}/chat/completions"
        empty = {b"Authorization": AUTH, b"X-Chatlane-Session": b""}
        response = await http.post(url, json={**WHOAMI, "user": "alice"}, headers=empty)
        assert f"key={api_key('alice')} " in response.json()["choices"][0]["message"]["content"]
        response = await http.post(url, json={**WHOAMI, "user": "\u2003"}, headers=empty)
        assert response.status_code == 400
        assert "U+2003 (EM SPACE), whitespace at the start" in response.json()["error"]["message"]


@pytest.fixture(scope="module")
def api_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real gateway serving on its own event loop in a thread, for Hypothesis's sync tests."""
    config = make_config(tmp_path_factory.mktemp("names"))
    started: queue.Queue[tuple[str, Callable[[], object]]] = queue.Queue()

    async def run() -> None:
        stopped, loop = asyncio.Event(), asyncio.get_running_loop()
        async with serve(config) as s:
            started.put(
                (f"{s.base_url}/chat/completions", partial(loop.call_soon_threadsafe, stopped.set))
            )
            await stopped.wait()

    thread = threading.Thread(target=asyncio.run, args=(run(),))
    thread.start()
    url, stop = started.get(timeout=30)
    try:
        yield url
    finally:
        stop()
        thread.join(timeout=30)


names = st.text(st.sampled_from(TRICKY) | st.characters(), max_size=6)


def session_of(http: httpx.Client, url: str, name: str) -> str | None:
    """The key the gateway ran ``name``'s message in, or ``None`` if it refused the name."""
    body = json.dumps({**WHOAMI, "user": name})  # ASCII-escaped: lone surrogates travel too
    headers = {b"Authorization": AUTH, b"Content-Type": b"application/json"}
    response = http.post(url, content=body, headers=headers)
    if response.status_code == 400:
        assert "the 'user' field" in response.json()["error"]["message"]
        return None
    reply: str = response.json()["choices"][0]["message"]["content"]
    assert f" key={api_key(name)} gen=" in reply, (name, reply)  # the name, exactly as sent
    return api_key(name)


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(core=names, before=names, after=names)
def test_distinct_accepted_names_never_share_a_session(
    api_url: str, core: str, before: str, after: str
) -> None:
    one, other = core, before + core + after
    with httpx.Client(timeout=30) as http:
        keys = {session_of(http, api_url, one), session_of(http, api_url, other)}
    if one != other and None not in keys:
        assert len(keys) == 2
