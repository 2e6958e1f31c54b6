"""The web chat over a real uvicorn server, with real HTTP and WebSocket clients."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from chatlane.access import GUESS_WINDOW, GUESSES, AccessToken
from chatlane.adapters import web
from chatlane.adapters.web import WebAdapter
from chatlane.adapters.web_ids import BrowserIds
from chatlane.adapters.web_page import AUTH_COOKIE, IDENTITY_COOKIE, Gate, WebPage
from chatlane.adapters.web_wire import MAX_FRAME_BYTES, MAX_TEXT, MessageState, state_of
from chatlane.agents.demo import DemoAgent
from chatlane.config import Config, Secret, ServerConfig, StoreConfig
from chatlane.errors import STORE_UNAVAILABLE
from chatlane.gateway import DispatchResult
from chatlane.hub import Hub, build_app, open_hub
from chatlane.identity import SessionSource, build_session_key
from chatlane.runtime.busy import BusyOutcome, BusyPolicy, BusySettings
from chatlane.runtime.settings import RuntimeSettings
from chatlane.secrets import TokenSource
from chatlane.serve import uvicorn_config
from chatlane.stores import MemoryStore, Store, open_store
from chatlane.stores.base import Admission
from chatlane.types import Agent, Outbound, OutboundKind, SessionKey, Target
from tests.runtime.test_outage import write_lock

Event = dict[str, Any]
MEMORY = StoreConfig(url="memory://")
"""Tests keep nothing on disk (a SQLite store would also get a browser-id secret file)."""
WAIT = 10.0


@contextlib.asynccontextmanager
async def web_server(
    config: Config | None = None, agent: Agent | None = None, store: StoreConfig = MEMORY
) -> AsyncIterator[str]:
    """A hub with only the web adapter, served on a free port; yields ``host:port``.

    The hub runs ``agent`` if given, else the one ``config`` names (the demo agent),
    on ``store`` (:data:`MEMORY` unless a test needs another).
    """
    async with web_hub(config, agent, store) as (address, _):
        yield address


@contextlib.asynccontextmanager
async def web_hub(
    config: Config | None = None,
    agent: Agent | None = None,
    store: StoreConfig = MEMORY,
    *,
    opened: Store | None = None,
) -> AsyncIterator[tuple[str, Hub]]:
    """As :func:`web_server`, yielding the hub too; on the store ``opened`` if given."""
    config = msgspec.structs.replace(config or Config(), store=store)
    if opened is not None:
        hub = Hub(config, opened, agent or DemoAgent())
    elif agent is None:
        hub = await open_hub(config)
    else:
        hub = Hub(config, await open_store(config.store.url), agent)
    hub.add(WebAdapter(config))
    async with served(hub) as address:
        yield address, hub


@contextlib.asynccontextmanager
async def served(hub: Hub) -> AsyncIterator[str]:
    """``hub``'s app served as ``chatlane serve`` runs it, on a free port of 127.0.0.1 (a
    proxy uvicorn trusts, so a test names a client's address in ``X-Forwarded-For``);
    yields ``host:port``."""
    options = uvicorn_config(build_app(hub), hub.config)
    options.host, options.port = "127.0.0.1", 0
    server = uvicorn.Server(options)
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(WAIT):
            while not server.started:
                assert not task.done(), "the server did not start"
                await asyncio.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@pytest.fixture
async def host() -> AsyncIterator[str]:
    async with web_server() as address:
        yield address


async def browser_id(host: str) -> str:
    """Load the page like a browser and return the identity cookie it was given."""
    async with httpx.AsyncClient(base_url=f"http://{host}") as client:
        response = await client.get("/")
        assert response.status_code == 200
        return response.cookies[IDENTITY_COOKIE]


@contextlib.asynccontextmanager
async def chat_socket(
    host: str, cookie: str | None, path: str = "/ws", **headers: str
) -> AsyncIterator[ClientConnection]:
    if cookie is not None:
        headers["Cookie"] = cookie
    async with connect(f"ws://{host}{path}", additional_headers=headers) as ws:
        yield ws


@contextlib.asynccontextmanager
async def greeted(host: str, bid: str) -> AsyncIterator[tuple[ClientConnection, Event]]:
    """A socket for browser ``bid``, after its commands, history and conversations."""
    async with chat_socket(host, f"{IDENTITY_COOKIE}={bid}") as ws:
        greeting = {}
        for expected in ("commands", "history", "conversations"):
            event = await receive(ws)
            assert event["type"] == expected
            greeting[expected] = event
        yield ws, greeting


async def receive(ws: ClientConnection) -> Event:
    event: Event = json.loads(await asyncio.wait_for(ws.recv(), WAIT))
    return event


async def until(ws: ClientConnection, kind: str, text: str | None = None) -> list[Event]:
    """Events up to and including the first of ``kind`` (with ``text``, if given)."""
    seen = []
    while True:
        event = await receive(ws)
        seen.append(event)
        if event["type"] == kind and (text is None or event.get("text") == text):
            return seen


async def drain(ws: ClientConnection) -> None:
    """Read events until the socket closes (raises ``ConnectionClosed``)."""
    while True:
        await receive(ws)


async def say(ws: ClientConnection, text: str) -> None:
    await ws.send(json.dumps({"type": "message", "text": text}))


async def until_running(ws: ClientConnection) -> None:
    """Wait for the ``state`` event of the message said last: its turn is under way."""
    state = (await until(ws, "state"))[-1]
    assert state["state"] == "running", state


# -- the page and identity ------------------------------------------------------------


async def test_page_gives_each_browser_a_private_identity_cookie(host: str) -> None:
    async with httpx.AsyncClient(base_url=f"http://{host}") as client:
        first = await client.get("/")
        assert first.status_code == 200
        assert 'role="log"' in first.text
        (set_cookie,) = first.headers.get_list("set-cookie")
        assert set_cookie.startswith(f"{IDENTITY_COOKIE}=")
        assert "HttpOnly" in set_cookie
        assert "samesite=lax" in set_cookie.lower()
        assert "connect-src 'self'" in first.headers["content-security-policy"]
        again = await client.get("/")
        assert again.headers.get_list("set-cookie") == []
        for asset in ("app.js", "app.css"):
            assert (await client.get(f"/web/static/{asset}")).status_code == 200
    assert await browser_id(host) != first.cookies[IDENTITY_COOKIE]


async def test_the_page_loads_every_script_and_style_from_this_server(host: str) -> None:
    async with httpx.AsyncClient(base_url=f"http://{host}") as client:
        page = (await client.get("/")).text
        assets = re.findall(r'(?:src|href)="(/web/static/[^"]+)"', page)
        assert len(assets) == 6  # app.css, three vendored libraries, markdown.js, app.js
        for asset in assets:
            response = await client.get(asset)
            assert response.status_code == 200, asset
            assert response.headers["content-type"].split(";")[0] in (
                "text/javascript",
                "application/javascript",
                "text/css",
            ), asset
        for licence in ("marked/LICENSE", "dompurify/LICENSE", "highlight/LICENSE"):
            assert (await client.get(f"/web/static/vendor/{licence}")).status_code == 200


async def test_connect_sends_commands_history_and_conversations(host: str) -> None:
    bid = await browser_id(host)
    async with greeted(host, bid) as (_, greeting):
        names = {item["name"] for item in greeting["commands"]["items"]}
        assert {"approve", "deny", "new", "resume", "help"} <= names
        assert all(item["usage"] and item["summary"] for item in greeting["commands"]["items"])
        assert greeting["history"]["messages"] == []
        (item,) = greeting["conversations"]["items"]
        assert item["current"] is True
        assert item["id"] == greeting["history"]["conversation"]


def test_browser_ids_are_hex_and_earlier_base64_ids_stay_valid() -> None:
    ids = BrowserIds(b"s" * 32)
    bid = ids.verify(ids.issue())
    assert bid is not None
    assert re.fullmatch(r"[0-9a-f]{36}", bid)  # Markdown-safe
    earlier = "_viMq4R6y7gI5ESBZADVpj_-"  # as ids were issued before: URL-safe base64
    assert ids.verify(f"{earlier}.{ids._mac(earlier)}") == earlier


async def test_socket_without_identity_cookie_is_closed_4400(host: str) -> None:
    async with chat_socket(host, None) as ws:
        with pytest.raises(ConnectionClosed) as closed:
            await receive(ws)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 4400


RESEMBLING = {
    "control-after": "{}\x1c",
    "nel-after": "{}\x85",
    "control-before": "\x1f{}",
    "space-after": "{} ",
    "quoted": '"{}"',
}
"""Identity cookies that Starlette's cookie parser would trim or unquote into the id."""


@pytest.mark.parametrize("around", RESEMBLING.values(), ids=RESEMBLING.keys())
async def test_the_page_gives_a_fresh_id_for_a_cookie_that_resembles_one(
    host: str, around: str
) -> None:
    bid = await browser_id(host)
    cookie = f"{IDENTITY_COOKIE}={around.format(bid)}; other=1"
    async with httpx.AsyncClient(base_url=f"http://{host}") as client:
        page = await client.get("/", headers={b"Cookie": cookie.encode("latin-1")})
    assert page.cookies[IDENTITY_COOKIE] != bid


@pytest.mark.parametrize("name", ["nel-after", "space-after", "quoted"])
async def test_a_socket_whose_cookie_resembles_an_id_is_closed_4400(host: str, name: str) -> None:
    bid = await browser_id(host)
    cookie = f"{IDENTITY_COOKIE}={RESEMBLING[name].format(bid)}; other=1"
    async with chat_socket(host, cookie) as ws:
        with pytest.raises(ConnectionClosed) as closed:
            await receive(ws)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 4400


@pytest.mark.parametrize("origin", ["http://evil.example", "http://[::1", "http://host:port"])
async def test_cross_origin_socket_is_closed_4403(host: str, origin: str) -> None:
    bid = await browser_id(host)
    cookie = f"{IDENTITY_COOKIE}={bid}"
    async with chat_socket(host, cookie, Origin=origin) as ws:
        with pytest.raises(ConnectionClosed) as closed:
            await receive(ws)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 4403


# -- conversation ------------------------------------------------------------------


async def test_streams_chunks_then_the_reply(host: str) -> None:
    async with greeted(host, await browser_id(host)) as (ws, _):
        await say(ws, "hello there")
        events = await until(ws, "reply")
    chunks = [e for e in events if e["type"] == "chunk"]
    assert len(chunks) >= 2
    assert "".join(c["text"] for c in chunks) == events[-1]["text"] == "echo: hello there"
    said = [e for e in events if e["type"] != "title"]  # the conversation's, not the message's
    assert {e["id"] for e in said} == {events[-1]["id"]}
    assert events[-1]["id"]


async def test_whoami_names_this_browsers_own_session(host: str) -> None:
    bid = await browser_id(host)
    async with greeted(host, bid) as (ws, _):
        await say(ws, "whoami")
        (reply,) = [e for e in await until(ws, "reply") if e["type"] == "reply"]
    issued = bid.partition(".")[0]  # the cookie holds the id and the server's signature
    assert f"key=main:web:dm:{issued} " in reply["text"]
    assert f"platform=web chat={issued} thread= user={issued} " in reply["text"]


async def test_history_comes_back_on_reconnect_and_only_to_its_browser(host: str) -> None:
    bid = await browser_id(host)
    async with greeted(host, bid) as (ws, _):
        await say(ws, "remember me ✓")
        await until(ws, "reply")
    async with greeted(host, bid) as (_, greeting):
        messages = greeting["history"]["messages"]
        assert [(m["role"], m["text"]) for m in messages] == [
            ("user", "remember me ✓"),
            ("assistant", "echo: remember me ✓"),
        ]
        assert greeting["conversations"]["items"][0]["preview"] == "remember me ✓"
    async with greeted(host, await browser_id(host)) as (_, stranger):
        assert stranger["history"]["messages"] == []


async def test_tabs_of_one_browser_share_the_session(host: str) -> None:
    bid = await browser_id(host)
    async with greeted(host, bid) as (first, _), greeted(host, bid) as (second, _):
        await say(first, "from the first tab")
        echoed = await until(second, "reply")
        assert echoed[0] == {"type": "user", "text": "from the first tab", "id": echoed[-1]["id"]}
        assert echoed[-1]["text"] == "echo: from the first tab"
        mine = await until(first, "reply")
        assert all(e["type"] != "user" for e in mine)


async def test_a_message_while_busy_gets_an_ack(host: str) -> None:
    async with greeted(host, await browser_id(host)) as (ws, _):
        await say(ws, "sleep 1")
        await until_running(ws)
        await say(ws, "next please")
        events = await until(ws, "reply", "echo: next please")
    kinds = [e["type"] for e in events]
    assert "ack" in kinds
    replies = [e["text"] for e in events if e["type"] == "reply"]
    assert replies == ["slept 1", "echo: next please"]
    assert kinds.index("ack") < next(i for i, e in enumerate(events) if e["type"] == "reply")


async def test_refused_sender_gets_a_notice() -> None:
    config = Config(allow={"web": ["someone-else"]})
    async with web_server(config) as host, greeted(host, await browser_id(host)) as (ws, _):
        await say(ws, "let me in")
        (notice,) = await until(ws, "notice")
    assert "not allowed" in notice["text"]


async def test_a_message_the_store_cannot_take_is_refused_without_naming_its_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "chatlane.db"
    async with (
        web_server(store=StoreConfig(url=f"sqlite:///{path}?busy_timeout=50")) as host,
        greeted(host, await browser_id(host)) as (ws, _),
    ):
        with write_lock(path):
            await say(ws, "during")
            (error,) = [e for e in await until(ws, "error") if e["type"] == "error"]
        await say(ws, "after")
        await until(ws, "reply", "echo: after")
    assert error["text"] == f"The message was not handled: {STORE_UNAVAILABLE}"


async def test_busy_reject_policy_gives_a_notice() -> None:
    config = Config(runtime=RuntimeSettings(busy=BusySettings(BusyPolicy.REJECT)))
    async with web_server(config) as host, greeted(host, await browser_id(host)) as (ws, _):
        await say(ws, "sleep 1")
        await until_running(ws)
        await say(ws, "too soon")
        events = await until(ws, "notice")
        assert events[-1]["text"]
        await until(ws, "reply", "slept 1")


async def test_approval_round_trip(host: str) -> None:
    async with greeted(host, await browser_id(host)) as (ws, _):
        await say(ws, "approve rm -rf x")
        approval = (await until(ws, "approval"))[-1]
        assert "rm -rf x" in approval["text"]
        await say(ws, "/approve")
        events = await until(ws, "reply", "approved: rm -rf x")
    assert events[-1]["id"] == approval["id"]


ODD_COMMAND = "echo `id` <b>bold</b> **not bold** [x](javascript:alert(1)) $HOME\t→ 🙂"
"""A command whose Markdown or HTML reading would differ from what it runs."""


async def test_an_approval_names_its_command_and_reason_verbatim_then_and_on_reconnect(
    host: str,
) -> None:
    bid = await browser_id(host)
    async with greeted(host, bid) as (ws, _):
        await say(ws, f"approve {ODD_COMMAND}")
        asked = (await until(ws, "approval"))[-1]
        assert asked["asks"]["command"] == ODD_COMMAND
        assert asked["asks"]["reason"]  # the demo agent says why it asks
    async with greeted(host, bid) as (ws, _):
        await receive(ws)  # the message, not answered yet
        again = await receive(ws)
        assert (again["type"], again["asks"]) == ("approval", asked["asks"])
        await say(ws, "/deny")
        await until(ws, "reply", f"denied: {ODD_COMMAND}")


async def test_messages_not_answered_yet_come_back_on_reconnect(host: str) -> None:
    bid = await browser_id(host)
    async with greeted(host, bid) as (ws, _):
        await say(ws, "sleep 1")
        await say(ws, "then this")
        await until(ws, "ack")
    async with greeted(host, bid) as (ws, greeting):
        assert greeting["history"]["messages"] == []
        waiting = [await receive(ws), await receive(ws)]
        assert [(e["type"], e["text"]) for e in waiting] == [
            ("user", "sleep 1"),
            ("user", "then this"),
        ]
        await until(ws, "reply", "echo: then this")
    async with greeted(host, bid) as (ws, greeting):
        said = [m["text"] for m in greeting["history"]["messages"] if m["role"] == "user"]
        assert said == ["sleep 1", "then this"]
        await say(ws, "whoami")
        events = await until(ws, "reply")
        assert [e["type"] for e in events].count("user") == 0


async def test_replies_committed_while_away_come_back_once_and_in_order() -> None:
    """The web chat's ledger is its transcript (docs/delivery.md)."""
    async with web_hub() as (host, hub):
        bid = await browser_id(host)
        async with greeted(host, bid) as (ws, _):
            await say(ws, "sleep 0.3")
            await say(ws, "then this")
            await until(ws, "ack")  # gone before either reply
        await asyncio.wait_for(hub.gateway.engine.wait_idle(), WAIT)  # both committed
        async with greeted(host, bid) as (ws, greeting):
            shown = [(m["role"], m["text"]) for m in greeting["history"]["messages"]]
            await say(ws, "whoami")
            events = await until(ws, "reply")
    assert shown == [
        ("user", "sleep 0.3"),
        ("assistant", "slept 0.3"),
        ("user", "then this"),
        ("assistant", "echo: then this"),
    ]
    assert [e["type"] for e in events].count("reply") == 1  # nothing delivered twice


async def test_a_waiting_approval_comes_back_on_reconnect(host: str) -> None:
    bid = await browser_id(host)
    async with greeted(host, bid) as (ws, _):
        await say(ws, "approve rm -rf y")
        asked = (await until(ws, "approval"))[-1]
    async with greeted(host, bid) as (ws, _):
        said, again = await receive(ws), await receive(ws)  # before anything is said
        assert (said["type"], said["text"]) == ("user", "approve rm -rf y")
        assert (again["type"], again["id"]) == ("approval", asked["id"])
        assert again["text"] == asked["text"]
        await say(ws, "/approve")
        events = await until(ws, "reply", "approved: rm -rf y")
        assert events[-1]["id"] == asked["id"]
    async with greeted(host, bid) as (ws, _):
        await say(ws, "whoami")
        events = await until(ws, "reply")
        assert [e for e in events if e["type"] == "approval"] == []


async def test_new_and_resume_resend_history_and_the_list(host: str) -> None:
    async with greeted(host, await browser_id(host)) as (ws, greeting):
        first = greeting["history"]["conversation"]
        await say(ws, "in the first")
        await until(ws, "reply")
        await say(ws, "/new confirm")
        events = await until(ws, "reply")
        history, listing, reply = events[-3:]
        assert history["type"] == "history"
        assert history["messages"] == []
        assert history["conversation"] != first
        assert [i["current"] for i in listing["items"]] == [True, False]
        assert "new conversation" in reply["text"]
        await say(ws, f"/resume {first}")
        history = (await until(ws, "history"))[-1]
        assert history["conversation"] == first
        assert history["messages"][0]["text"] == "in the first"


async def test_the_first_reply_brings_the_conversations_title_once(host: str) -> None:
    bid = await browser_id(host)
    async with greeted(host, bid) as (ws, greeting):
        conversation = greeting["history"]["conversation"]
        assert greeting["conversations"]["items"][0]["title"] == ""
        await say(ws, "Plan the   trip\nwith details")
        events = await until(ws, "reply")
        titles = [e for e in events if e["type"] == "title"]
        assert titles == [{"type": "title", "conversation": conversation, "title": "Plan the trip"}]
        assert events.index(titles[0]) < len(events) - 1  # before the reply
        await say(ws, "a later message")
        assert not [e for e in await until(ws, "reply") if e["type"] == "title"]
    async with greeted(host, bid) as (_, greeting):
        assert greeting["conversations"]["items"][0]["title"] == "Plan the trip"


async def say_as(ws: ClientConnection, text: str, ref: str) -> str:
    """Send ``text`` named ``ref``; the id the server gave it."""
    await ws.send(json.dumps({"type": "message", "text": text, "ref": ref}))
    accepted = (await until(ws, "accepted"))[-1]
    assert accepted["ref"] == ref
    return str(accepted["id"])


def of(events: list[Event], kind: str, message_id: str) -> list[Event]:
    return [e for e in events if e["type"] == kind and e["id"] == message_id]


async def test_the_sender_learns_its_ids_and_every_tab_each_state_and_outcome(
    host: str,
) -> None:
    bid = await browser_id(host)
    async with greeted(host, bid) as (ws, _), greeted(host, bid) as (other, _):
        running = await say_as(ws, "approve rm -rf x", "r1")
        await until(ws, "approval")
        waiting = await say_as(ws, "after that", "r2")
        (queued,) = of(await until(ws, "state"), "state", waiting)
        assert queued["state"] == "queued"
        assert queued["short_id"] > 0
        await say(ws, f"/unqueue #{queued['short_id']}")
        events = await until(ws, "reply")
        assert events[-1]["command"] is True
        assert events[-1]["text"].startswith(f"Took #{queued['short_id']} out of the queue")
        assert [e["outcome"] for e in of(events, "outcome", waiting)] == ["dropped"]
        await say(ws, "/approve")
        events = await until(ws, "reply", "approved: rm -rf x")
        assert "command" not in events[-1]
        seen = await until(other, "reply", "approved: rm -rf x")
    assert [e["state"] for e in of(seen, "state", running)] == ["running"]
    assert [e["state"] for e in of(seen, "state", waiting)] == ["queued"]
    assert [e["outcome"] for e in of(seen, "outcome", waiting)] == ["dropped"]
    assert [e["outcome"] for e in of(seen, "outcome", running)] == ["answered"]
    assert not [e for e in seen if e["type"] == "accepted"]


async def test_a_stopped_turn_and_a_refused_message_end_so() -> None:
    config = Config(runtime=RuntimeSettings(busy=BusySettings(BusyPolicy.REJECT)))
    async with web_server(config) as host, greeted(host, await browser_id(host)) as (ws, _):
        running = await say_as(ws, "approve rm -rf x", "r1")
        await until(ws, "approval")
        refused = await say_as(ws, "too soon", "r2")
        events = await until(ws, "state")
        assert [e["state"] for e in of(events, "state", refused)] == ["refused"]
        await say(ws, "/stop")
        events = await until(ws, "reply")
        assert events[-1]["command"] is True
        if not of(events, "outcome", running):
            events = await until(ws, "outcome")
        assert [e["outcome"] for e in of(events, "outcome", running)] == ["stopped"]


async def test_a_reconnect_tells_the_running_and_the_queued_states(host: str) -> None:
    bid = await browser_id(host)
    async with greeted(host, bid) as (ws, _):
        running = await say_as(ws, "approve rm -rf x", "r1")
        await until(ws, "approval")
        waiting = await say_as(ws, "after that", "r2")
        await until(ws, "state")
    async with greeted(host, bid) as (ws, _):
        told = [await receive(ws) for _ in range(5)]  # 2 users, the approval, 2 states
        assert [e["type"] for e in told] == ["user", "user", "approval", "state", "state"]
        first, second = told[3:]
        assert (first["id"], first["state"]) == (running, "running")
        assert first["elapsed"] >= 0
        assert (second["id"], second["state"]) == (waiting, "queued")
        assert second["short_id"] > 0
        await say(ws, "/approve")
        await until(ws, "reply", "echo: after that")


async def test_a_steer_the_agent_has_not_taken_names_its_short_id_and_can_be_taken_back() -> None:
    """Under ``steer`` a message waits in the running turn until its agent takes it, counted
    as queued: its state names the id ``/unqueue`` takes it back by, on arrival and to a tab
    that connects later."""
    config = Config(runtime=RuntimeSettings(busy=BusySettings(BusyPolicy.STEER)))
    async with web_server(config) as host:
        bid = await browser_id(host)
        async with greeted(host, bid) as (ws, _):
            await say_as(ws, "approve rm -rf x", "r1")
            await until(ws, "approval")
            steered = await say_as(ws, "and this", "r2")
            (arrived,) = of(await until(ws, "state"), "state", steered)
            assert arrived["state"] == "steered"
            assert arrived["short_id"] > 0
        async with greeted(host, bid) as (ws, _):
            told = [await receive(ws) for _ in range(5)]  # 2 users, the approval, 2 states
            (again,) = of(told, "state", steered)
            assert (again["state"], again["short_id"]) == ("steered", arrived["short_id"])
            await say(ws, f"/unqueue #{arrived['short_id']}")
            events = await until(ws, "reply")
            assert events[-1]["text"].startswith(
                f"Took #{arrived['short_id']} back from the running turn"
            )
            if not of(events, "outcome", steered):
                events = await until(ws, "outcome")
            assert [e["outcome"] for e in of(events, "outcome", steered)] == ["dropped"]
            await say(ws, "/approve")
            await until(ws, "reply", "approved: rm -rf x")


async def test_too_many_tabs_are_refused(host: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(web, "MAX_TABS", 2)
    bid = await browser_id(host)
    async with (
        greeted(host, bid),
        greeted(host, bid),
        chat_socket(host, f"{IDENTITY_COOKIE}={bid}") as third,
    ):
        with pytest.raises(ConnectionClosed) as closed:
            await receive(third)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 1013


async def test_shutdown_closes_open_sockets_while_a_turn_runs() -> None:
    async with contextlib.AsyncExitStack() as sockets:
        async with web_server() as host:
            ws, _ = await sockets.enter_async_context(greeted(host, await browser_id(host)))
            await say(ws, "sleep 30")
            await until_running(ws)
        with pytest.raises(ConnectionClosed):
            await drain(ws)


# -- bad input ------------------------------------------------------------------------


BAD_FRAMES = [
    ("not json", "Not valid JSON"),
    ("[" * 60_000, "Not valid JSON"),
    ('{"type": "other"}', "Unknown frame"),
    ("[1, 2]", "Unknown frame"),
    ('{"type": "message", "text": 5}', '"text", a string'),
    ('{"type": "message", "text": "   "}', "empty"),
    ('{"type": "message", "text": "\\ud800 lone"}', "lone surrogate"),
    (json.dumps({"type": "message", "text": "é" * (MAX_TEXT // 2 + 1)}), "too long"),
    ("x" * 70_000, "too large"),
    ('{"type": "message", "text": "hi", "ref": 5}', '"ref"'),
    ('{"type": "message", "text": "hi", "ref": "<b>"}', '"ref"'),
    (json.dumps({"type": "message", "text": "hi", "ref": "r" * 65}), '"ref"'),
]


async def test_bad_frames_get_error_events_and_the_socket_lives_on(host: str) -> None:
    async with greeted(host, await browser_id(host)) as (ws, _):
        for frame, expected in BAD_FRAMES:
            await ws.send(frame)
            event = await receive(ws)
            assert event["type"] == "error", frame[:40]
            assert expected in event["text"], frame[:40]
        await ws.send(b'{"type": "message", "text": "binary"}')
        assert "binary" in (await receive(ws))["text"]
        await say(ws, "still here \u200d\U0001f9d1\u200d\U0001f4bb \x00")
        events = await until(ws, "reply")
    assert events[-1]["text"] == "echo: still here \u200d\U0001f9d1\u200d\U0001f4bb \x00"


async def test_a_frame_past_the_byte_limit_closes_the_socket_unread(host: str) -> None:
    async with greeted(host, await browser_id(host)) as (ws, _):
        await ws.send("x" * (MAX_FRAME_BYTES // 4))
        assert "too large" in (await receive(ws))["text"]
        await ws.send("x" * (MAX_FRAME_BYTES + 1))
        with pytest.raises(ConnectionClosed) as closed:
            await drain(ws)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 1009


async def test_text_of_exactly_the_limit_is_accepted(host: str) -> None:
    async with greeted(host, await browser_id(host)) as (ws, _):
        await say(ws, "a" * MAX_TEXT)
        events = await until(ws, "reply")
    assert events[-1]["text"] == "echo: " + "a" * MAX_TEXT


async def test_outbound_for_a_chat_without_socket_is_dropped() -> None:
    adapter = WebAdapter(Config(store=MEMORY))
    source = SessionSource("web", chat_id="nobody-home-123456")
    key, target = build_session_key(source), Target.of(source)
    await adapter.deliver(Outbound(OutboundKind.REPLY, key, target, "lost in the transcript"))


# -- the access token -----------------------------------------------------------------


@pytest.fixture
def token_config(tmp_path: Path) -> Config:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-tøken\n")
    return Config(server=ServerConfig(token=Secret(file=str(token_file))))


async def sign_in(client: httpx.AsyncClient, token: str) -> httpx.Response:
    """Post the sign-in form as a browser does."""
    return await client.post("/", data={"token": token})


async def test_token_guards_the_page(token_config: Config) -> None:
    async with (
        web_server(token_config) as host,
        httpx.AsyncClient(base_url=f"http://{host}") as client,
    ):
        denied = await client.get("/")
        assert denied.status_code == 401
        assert '<form method="post" action="/">' in denied.text
        assert IDENTITY_COOKIE not in denied.cookies
        in_url = await client.get("/", params={"token": "s3cret-tøken"})
        assert in_url.status_code == 401  # a token in the address is never taken
        assert AUTH_COOKIE not in in_url.cookies
        wrong = await sign_in(client, "guess ✗")
        assert wrong.status_code == 401
        assert "not right" in wrong.text
        signed_in = await sign_in(client, "s3cret-tøken")
        assert signed_in.status_code == 303
        assert signed_in.headers["location"] == "/"
        assert "s3cret" not in signed_in.cookies[AUTH_COOKIE]
        assert (await client.get("/")).status_code == 200


async def test_each_sign_in_is_its_own_session_with_an_expiry(token_config: Config) -> None:
    async with web_server(token_config) as host:
        cookies = []
        for _ in range(2):
            async with httpx.AsyncClient(base_url=f"http://{host}") as client:
                response = await sign_in(client, "s3cret-tøken")
                header = response.headers["set-cookie"]
                assert f"Max-Age={7 * 24 * 3600}" in header
                assert "HttpOnly" in header
                cookies.append(response.cookies[AUTH_COOKIE])
        assert cookies[0] != cookies[1]  # per browser, not a function of the token


async def test_a_sign_in_ends_at_its_expiry(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret")
    now = [1_000_000.0]
    access = AccessToken(TokenSource.read(Secret(file=str(token_file))))
    ids = BrowserIds(b"a test secret of 32 bytes, fixed")
    page = WebPage(Gate(access, ttl=60, clock=lambda: now[0]), ids)
    app = Starlette(routes=list(page.routes()))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        assert (await sign_in(client, "s3cret")).status_code == 303
        assert (await client.get("/")).status_code == 200
        now[0] += 59
        assert (await client.get("/")).status_code == 200
        now[0] += 1
        assert (await client.get("/")).status_code == 401


async def test_wrong_tokens_are_rate_limited(token_config: Config) -> None:
    async with (
        web_server(token_config) as host,
        httpx.AsyncClient(base_url=f"http://{host}") as client,
    ):
        for attempt in range(GUESSES):
            assert (await sign_in(client, f"guess {attempt}")).status_code == 401
        limited = await sign_in(client, "s3cret-tøken")  # even the right one, for now
        assert limited.status_code == 429
        assert 0 < int(limited.headers["retry-after"]) <= GUESS_WINDOW
        assert AUTH_COOKIE not in limited.cookies


async def test_the_page_and_its_scripts_are_not_served_before_a_sign_in(
    token_config: Config,
) -> None:
    """``/web/static/index.html`` is the chat page: it is refused without a sign-in as ``/``
    is, and so are the scripts; the sign-in page's own stylesheet is served to anyone."""
    async with (
        web_server(token_config) as host,
        httpx.AsyncClient(base_url=f"http://{host}") as client,
    ):
        page = await client.get("/web/static/index.html")
        assert page.status_code == 401
        assert 'role="log"' not in page.text
        assert re.findall(r'href="(/web/static/[^"]+)"', (await client.get("/")).text) == [
            "/web/static/app.css"
        ]
        assert (await client.get("/web/static/app.css")).status_code == 200
        for asset in ("app.js", "markdown.js", "vendor/marked/marked.umd.js", "absent.js"):
            assert (await client.get(f"/web/static/{asset}")).status_code == 401, asset
        assert (await sign_in(client, "s3cret-tøken")).status_code == 303
        assets = re.findall(r'(?:src|href)="(/web/static/[^"]+)"', (await client.get("/")).text)
        assert len(assets) == 6
        for asset in [*assets, "/web/static/index.html"]:
            assert (await client.get(asset)).status_code == 200, asset
        bearer = {b"Authorization": "Bearer s3cret-tøken".encode()}
        async with httpx.AsyncClient(base_url=f"http://{host}", headers=bearer) as script:
            assert (await script.get("/web/static/app.js")).status_code == 200


def set_cookies(response: httpx.Response) -> dict[str, str]:
    """The ``Set-Cookie`` headers of ``response``, by cookie name, lowercased."""
    headers = response.headers.get_list("set-cookie")
    return {header.partition("=")[0]: header.lower() for header in headers}


async def test_the_identity_cookie_is_secure_over_https_as_the_sign_in_is(
    host: str, token_config: Config
) -> None:
    """Reached over HTTPS (a proxy uvicorn trusts says so), the browser id — all that keeps
    one browser's session from another's — is never sent over plain HTTP; reached over HTTP,
    it is not marked (a browser would not keep it)."""
    https = {"X-Forwarded-Proto": "https"}
    async with httpx.AsyncClient(base_url=f"http://{host}") as client:
        assert "; secure" in set_cookies(await client.get("/", headers=https))[IDENTITY_COOKIE]
    async with httpx.AsyncClient(base_url=f"http://{host}") as client:
        assert "; secure" not in set_cookies(await client.get("/"))[IDENTITY_COOKIE]
    async with (
        web_server(token_config) as signing_in,
        httpx.AsyncClient(base_url=f"http://{signing_in}") as client,
    ):
        signed_in = await client.post("/", data={"token": "s3cret-tøken"}, headers=https)
        cookies = set_cookies(signed_in)
        assert "; secure" in cookies[AUTH_COOKIE]
        assert "; secure" in cookies[IDENTITY_COOKIE]


async def test_an_identity_cookie_given_over_http_is_made_secure_over_https(
    host: str, token_config: Config
) -> None:
    """A browser id first given over plain HTTP, the page later reached over HTTPS: the same
    id is set again, marked Secure (the browser never says how its cookie was set), on the
    page and on a sign-in; over plain HTTP, a browser that has one gets none."""
    https = {"X-Forwarded-Proto": "https"}
    async with httpx.AsyncClient(base_url=f"http://{host}") as client:
        plain = set_cookies(await client.get("/"))[IDENTITY_COOKIE]
        assert "; secure" not in plain
        bid = client.cookies[IDENTITY_COOKIE]
        assert IDENTITY_COOKIE not in set_cookies(await client.get("/"))
        again = set_cookies(await client.get("/", headers=https))[IDENTITY_COOKIE]
        assert again.startswith(f"{IDENTITY_COOKIE}={bid.lower()};")
        assert "; secure" in again
    async with (
        web_server(token_config) as signing_in,
        httpx.AsyncClient(base_url=f"http://{signing_in}") as client,
    ):
        signed_in = await client.post("/", data={"token": "s3cret-tøken"})
        assert "; secure" not in set_cookies(signed_in)[IDENTITY_COOKIE]
        bid = client.cookies[IDENTITY_COOKIE]
        cookies = f"{IDENTITY_COOKIE}={bid}; {AUTH_COOKIE}={client.cookies[AUTH_COOKIE]}"
        client.cookies.clear()  # each request below sends the cookies set over plain HTTP
        sent = {**https, "Cookie": cookies}
        for answer in (
            await client.get("/", headers=sent),
            await client.post("/", data={"token": "s3cret-tøken"}, headers=sent),
        ):
            again = set_cookies(answer)[IDENTITY_COOKIE]
            assert again.startswith(f"{IDENTITY_COOKIE}={bid.lower()};")
            assert "; secure" in again


SIGN_INS_AT_ONCE = 40


async def test_wrong_sign_ins_sent_at_once_are_counted_together(
    token_config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forty sign-ins from one address, each form held after its first byte until all forty
    reached the page: five wrong tokens are judged, the other 35 refused unread."""
    arrived = 0
    all_arrived = asyncio.Event()
    sign_in_as_served = WebPage.sign_in

    async def counted(page: WebPage, request: Request) -> Response:
        nonlocal arrived
        arrived += 1
        if arrived == SIGN_INS_AT_ONCE:
            all_arrived.set()
        return await sign_in_as_served(page, request)

    monkeypatch.setattr(WebPage, "sign_in", counted)

    async def held_form(guess: int) -> AsyncIterator[bytes]:
        yield b"t"
        await all_arrived.wait()
        yield f"oken=guess-{guess}".encode()

    form = {"Content-Type": "application/x-www-form-urlencoded"}
    async with (
        web_server(token_config) as host,
        httpx.AsyncClient(base_url=f"http://{host}") as client,
        asyncio.timeout(WAIT),
    ):
        answers = await asyncio.gather(
            *(client.post("/", content=held_form(n), headers=form) for n in range(SIGN_INS_AT_ONCE))
        )
    statuses = sorted(answer.status_code for answer in answers)
    assert statuses == [401] * GUESSES + [429] * (SIGN_INS_AT_ONCE - GUESSES)
    assert all(0 < int(a.headers["retry-after"]) <= GUESS_WINDOW for a in answers[GUESSES:])


async def test_a_sign_in_that_posts_no_token_is_not_counted(token_config: Config) -> None:
    """An empty field, a body that is no form, a form over 4 KiB (declared or not): no token
    is judged, none is counted, however often; the right token then signs in."""
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    oversized = b"token=s3cret-t%C3%B8ken&pad=" + b"x" * 4096

    async def streamed() -> AsyncIterator[bytes]:
        yield oversized  # no Content-Length: the form is read to learn its size

    async with (
        web_server(token_config) as host,
        httpx.AsyncClient(base_url=f"http://{host}") as client,
    ):
        for _ in range(GUESSES + 1):
            assert (await sign_in(client, "")).status_code == 401
            assert (await client.post("/", json={"token": "guess"})).status_code == 401
            assert (await client.post("/", content=oversized, headers=form)).status_code == 401
            assert (await client.post("/", content=streamed(), headers=form)).status_code == 401
        assert (await sign_in(client, "s3cret-tøken")).status_code == 303


async def test_a_stale_token_posted_again_and_again_is_one_guess(token_config: Config) -> None:
    """The old token posted over and over (a saved password after a token change) counts
    once: the right one still signs in; a different wrong one each time does not."""
    async with (
        web_server(token_config) as host,
        httpx.AsyncClient(base_url=f"http://{host}") as client,
    ):
        for _ in range(GUESSES * 4):
            assert (await sign_in(client, "the old token")).status_code == 401
        assert (await sign_in(client, "s3cret-tøken")).status_code == 303
        for attempt in range(GUESSES - 1):
            assert (await sign_in(client, f"guess {attempt}")).status_code == 401
        assert (await sign_in(client, "the old token")).status_code == 429
        assert (await sign_in(client, "s3cret-tøken")).status_code == 429


async def test_a_right_sign_in_is_not_counted(token_config: Config) -> None:
    async with (
        web_server(token_config) as host,
        httpx.AsyncClient(base_url=f"http://{host}") as client,
    ):
        for _ in range(GUESSES + 1):
            assert (await sign_in(client, "s3cret-tøken")).status_code == 303
        for attempt in range(GUESSES - 1):
            assert (await sign_in(client, f"guess {attempt}")).status_code == 401
        assert (await sign_in(client, "s3cret-tøken")).status_code == 303


async def test_wrong_bearer_tokens_on_the_socket_count_with_the_sign_ins(
    token_config: Config,
) -> None:
    """A script's wrong bearer tokens and a form's wrong tokens share one count per client
    address (named by the trusted proxy, here the test's own loopback address)."""
    guesser, neighbour = {"X-Forwarded-For": "203.0.113.7"}, {"X-Forwarded-For": "198.51.100.2"}
    right = "Bearer s3cret-t\xc3\xb8ken"  # the UTF-8 bytes, as a WebSocket client sends them
    async with web_server(token_config) as host:
        async with httpx.AsyncClient(base_url=f"http://{host}", headers=guesser) as browser:
            assert (await sign_in(browser, "s3cret-tøken")).status_code == 303
            identity = f"{IDENTITY_COOKIE}={browser.cookies[IDENTITY_COOKIE]}"
            signed_in = f"{identity}; {AUTH_COOKIE}={browser.cookies[AUTH_COOKIE]}"
            for attempt in range(GUESSES - 2):
                assert (await sign_in(browser, f"guess {attempt}")).status_code == 401
            for attempt in range(2):
                wrong = f"Bearer socket guess {attempt}"  # different from the posted ones
                async with chat_socket(host, identity, Authorization=wrong, **guesser) as ws:
                    assert await close_code(ws) == 4401
            assert (await sign_in(browser, "s3cret-tøken")).status_code == 429
            assert (await browser.get("/")).status_code == 200  # its sign-in still holds
        async with httpx.AsyncClient(base_url=f"http://{host}", headers=guesser) as script:
            bearer = {b"Authorization": "Bearer s3cret-tøken".encode()}
            assert (await script.get("/", headers=bearer)).status_code == 429
        async with chat_socket(host, identity, Authorization=right, **guesser) as ws:
            assert await close_code(ws) == 4429
        async with chat_socket(host, signed_in, **guesser) as ws:
            assert (await receive(ws))["type"] == "commands"
        async with chat_socket(host, identity, Authorization=right, **neighbour) as ws:
            assert (await receive(ws))["type"] == "commands"


async def close_code(ws: ClientConnection) -> int:
    """The code ``ws`` is closed with, before any event."""
    with pytest.raises(ConnectionClosed) as closed:
        await receive(ws)
    assert closed.value.rcvd is not None
    return closed.value.rcvd.code


async def test_a_cross_site_sign_in_is_refused(token_config: Config) -> None:
    async with (
        web_server(token_config) as host,
        httpx.AsyncClient(base_url=f"http://{host}") as client,
    ):
        for headers in (
            {"Origin": "http://elsewhere.example"},
            {"Origin": "null", "Sec-Fetch-Site": "cross-site"},
            {"Origin": "http://[::1"},  # no URL at all: matches no host
        ):
            response = await client.post("/", data={"token": "s3cret-tøken"}, headers=headers)
            assert response.status_code == 403
            assert AUTH_COOKIE not in response.cookies


async def test_token_guards_the_socket(token_config: Config) -> None:
    async with web_server(token_config) as host:
        async with httpx.AsyncClient(base_url=f"http://{host}") as client:
            await sign_in(client, "s3cret-tøken")
            bid, session = client.cookies[IDENTITY_COOKIE], client.cookies[AUTH_COOKIE]
        identity = f"{IDENTITY_COOKIE}={bid}"
        for path in ("/ws", "/ws?token=s3cret-t%C3%B8ken"):
            async with chat_socket(host, identity, path) as ws:
                with pytest.raises(ConnectionClosed) as closed:
                    await receive(ws)
            assert closed.value.rcvd is not None
            assert closed.value.rcvd.code == 4401
        async with chat_socket(host, f"{identity}; {AUTH_COOKIE}={session}") as ws:
            assert (await receive(ws))["type"] == "commands"
        async with chat_socket(host, identity, Authorization="Bearer s3cret-t\xc3\xb8ken") as ws:
            assert (await receive(ws))["type"] == "commands"


@pytest.mark.parametrize("expires", [b"\xb2", b"\xb9", b"9" * 5000])
async def test_a_sign_in_cookie_with_an_odd_expiry_is_no_sign_in(
    token_config: Config, expires: bytes
) -> None:
    """Not a 500 with a traceback, nor a socket dropped without a close frame: ``²`` (the
    byte 0xB2 as Starlette reads a header) passes ``str.isdigit`` and fails ``int``, and so
    does a number of 5,000 digits."""
    forged = AUTH_COOKIE.encode() + b"=" + expires + b".nonce.signature"
    async with web_server(token_config) as host:
        async with httpx.AsyncClient(base_url=f"http://{host}") as client:
            page = await client.get("/", headers={b"cookie": forged})
        assert page.status_code == 401
        if expires.isascii():  # what a WebSocket client sends as it is
            async with chat_socket(host, forged.decode()) as ws:
                with pytest.raises(ConnectionClosed) as closed:
                    await receive(ws)
            assert closed.value.rcvd is not None
            assert closed.value.rcvd.code in (4400, 4401)


class HeldEnqueues(MemoryStore):
    """A store that takes no message until :attr:`go_on` is set; :attr:`asked` counts the
    messages handed to it meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.go_on = asyncio.Event()
        self.asked = 0

    async def enqueue_and_acquire(self, *args: Any, **options: Any) -> Admission:
        self.asked += 1
        await self.go_on.wait()
        return await super().enqueue_and_acquire(*args, **options)


async def test_one_browser_has_a_bounded_number_of_messages_not_handed_on() -> None:
    """A socket that floods: past :data:`web.MAX_UNDISPATCHED` messages the gateway has not
    taken yet, one more is refused at once, and told so; the ones taken all run."""
    store = HeldEnqueues()
    async with web_hub(opened=store) as (host, _):
        bid = await browser_id(host)
        async with greeted(host, bid) as (ws, _):
            ids = [await say_as(ws, f"m{n}", f"r{n}") for n in range(web.MAX_UNDISPATCHED)]
            extra = await say_as(ws, "one too many", "extra")
            events = await until(ws, "error")
            assert of(events, "state", extra) == [
                {"type": "state", "id": extra, "state": "refused"}
            ]
            assert events[-1]["text"].startswith("Too many messages at once (32 wait")
            store.go_on.set()
            answered = await until(ws, "reply", f"echo: m{web.MAX_UNDISPATCHED - 1}")
    assert store.asked == len(ids)
    assert [e["text"] for e in answered if e["type"] == "reply"][-1] == "echo: m31"


@pytest.mark.parametrize("outcome", list(BusyOutcome))
def test_every_busy_outcome_shows_as_a_message_state(outcome: BusyOutcome) -> None:
    shown = state_of(DispatchResult(SessionKey("k"), "m1", outcome=outcome))
    assert shown in set(MessageState) - {MessageState.RUNNING, MessageState.COMMAND}


def test_the_page_refuses_what_the_server_would_refuse() -> None:
    """The page checks a message's bytes against the server's limit before sending it, and
    puts no ``maxlength`` on its box (it would cut a paste short without a word)."""
    page = (Path(web.__file__).parent / "static" / "index.html").read_text(encoding="utf-8")
    assert f'data-max-bytes="{MAX_TEXT}"' in page
    assert "maxlength" not in page
