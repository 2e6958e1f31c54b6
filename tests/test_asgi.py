"""The app's ASGI layers: the Host check answers as Starlette's does and remembers only
what it admitted; the direct router takes exactly the routes Starlette's router takes."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Mount, Route, Router, WebSocketRoute
from starlette.types import Message, Receive, Scope, Send

from chatlane.asgi import REMEMBERED, DirectRouter, HostCheck, direct_routes

ALLOWED = ["127.0.0.1", "localhost", "*.example.com"]


async def call(
    app: Any, method: str = "GET", path: str = "/", host: bytes | None = None
) -> Message:
    """Run ``app`` for one request; its response: the status, and the body as ``text``."""
    headers = [] if host is None else [(b"host", host)]
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "scheme": "http",
        "server": ("127.0.0.1", 8000),
    }
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return {"status": sent[0]["status"], "text": body.decode(), "headers": sent[0]["headers"]}


class Counting:
    """An ASGI app that answers ``ok`` and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.calls += 1
        await PlainTextResponse("ok")(scope, receive, send)


@pytest.mark.parametrize(
    ("host", "status"),
    [
        (b"127.0.0.1:8000", 200),
        (b"LOCALHOST", 200),
        (b"chat.example.com", 200),
        (b"rebound.example", 400),
        (b"example.com", 400),
        (b"127.0.0.1:8000:1", 400),
        (None, 400),
    ],
)
async def test_the_host_check_answers_as_starlettes(host: bytes | None, status: int) -> None:
    check = HostCheck(Counting(), ALLOWED)
    for _ in range(2):  # the second time from what it remembers, if anything
        response = await call(check, host=host)
        assert response["status"] == status
        if status == 400:
            assert response["text"] == "Invalid host header"


async def test_only_admitted_hosts_are_remembered_and_at_most_a_few() -> None:
    check = HostCheck(Counting(), ALLOWED)
    for port in range(REMEMBERED + 10):
        assert (await call(check, host=f"localhost:{port}".encode()))["status"] == 200
        assert (await call(check, host=f"evil.test:{port}".encode()))["status"] == 400
    assert len(check._admitted) == REMEMBERED
    assert all(host.startswith(b"localhost:") for host in check._admitted)
    assert (await call(check, host=b"localhost:99999"))["status"] == 200  # checked in full


async def test_the_host_check_lets_the_lifespan_through() -> None:
    seen: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope["type"])

    async def receive() -> Message:
        return {"type": "lifespan.startup"}

    async def send(message: Message) -> None:
        pass

    await HostCheck(app, ALLOWED)({"type": "lifespan"}, receive, send)
    assert seen == ["lifespan"]


def endpoint(name: str) -> Any:
    async def answer(request: Request) -> Response:
        return PlainTextResponse(f"{name} {request.path_params}")

    return answer


def routes() -> list[BaseRoute]:
    return [
        Route("/metrics", endpoint("metrics")),
        Route("/admin/{key:path}", endpoint("admin")),
        Route("/", endpoint("page")),
        Route("/", endpoint("post"), methods=["POST"]),
        Mount("/static", app=Counting()),
        Route("/static/x", endpoint("shadowed by the mount")),
        WebSocketRoute("/ws", Counting()),
        Route("/admin/taken", endpoint("shadowed by admin")),
        Route("/v1/chat", endpoint("chat"), methods=["POST"]),
        Route("/v1/chat", endpoint("second chat"), methods=["POST", "PUT"]),
        Route("/v1/{rest:path}", endpoint("v1"), methods=["GET", "POST", "PUT", "DELETE"]),
    ]


def test_only_routes_no_earlier_route_takes_are_direct() -> None:
    assert set(direct_routes(routes())) == {
        ("/metrics", "GET"),
        ("/metrics", "HEAD"),
        ("/", "GET"),
        ("/", "HEAD"),
        ("/", "POST"),
        ("/v1/chat", "POST"),
        ("/v1/chat", "PUT"),
    }
    assert direct_routes(routes())[("/v1/chat", "POST")].path == "/v1/chat"


def test_the_table_stops_at_a_route_it_cannot_foresee() -> None:
    class Opaque(BaseRoute):
        pass

    listed = [Route("/a", endpoint("a")), Opaque(), Route("/b", endpoint("b"))]
    assert set(direct_routes(listed)) == {("/a", "GET"), ("/a", "HEAD")}


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/metrics"),
        ("POST", "/metrics"),
        ("GET", "/"),
        ("POST", "/"),
        ("DELETE", "/"),
        ("GET", "/admin/taken"),
        ("GET", "/static/x"),
        ("POST", "/v1/chat"),
        ("PUT", "/v1/chat"),
        ("GET", "/v1/chat"),
        ("PATCH", "/v1/chat"),
        ("GET", "/nowhere"),
        ("GET", "/metrics/"),
    ],
)
async def test_the_direct_router_answers_as_starlettes(method: str, path: str) -> None:
    mine = await call(DirectRouter(routes()), method, path)
    theirs = await call(Router(routes()), method, path)
    assert mine == theirs
