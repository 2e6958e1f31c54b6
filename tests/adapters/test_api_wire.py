"""The API's wire helpers on the hot path, and the chat endpoint's checks, without a server."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from starlette.datastructures import Headers
from starlette.types import Message

from chatlane.access import AccessToken
from chatlane.adapters.api import ApiAdapter
from chatlane.adapters.api_wire import (
    MAX_BODY,
    ApiRequestError,
    completion,
    completion_body,
    encode,
    first_headers,
    receive_body,
)
from chatlane.config import Config, Secret
from chatlane.secrets import TokenSource

TOKEN = "s3cret-token"
TEXTS = ["echo: hi", 'quote " and \\ slash', "ünï\ncødé 👋", "\ud800", "", "\x00\x1f\x7f"]


@pytest.mark.parametrize("text", TEXTS)
def test_the_completion_body_is_the_bytes_json_encodes(
    text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.75)
    for model in ("chatlane", 'model "ü"', text):
        body = completion_body("chatcmpl-1", model, text)
        assert body == encode(completion("chatcmpl-1", model, text))
        assert json.loads(body)["choices"][0]["message"]["content"] == text


def receiver(*messages: Message) -> Any:
    queue = list(messages)

    async def receive() -> Message:
        return queue.pop(0)

    return receive


def part(body: bytes, more: bool = False) -> Message:
    return {"type": "http.request", "body": body, "more_body": more}


async def test_a_body_in_one_message_or_several_is_read_whole() -> None:
    assert await receive_body(receiver(part(b'{"a": 1}')), b"8") == b'{"a": 1}'
    parts = receiver(part(b'{"a"', True), part(b"", True), part(b": 1}"))
    assert await receive_body(parts, "") == b'{"a": 1}'
    assert await receive_body(receiver({"type": "http.request"}), b"") == b""


@pytest.mark.parametrize("declared", [b"", str(MAX_BODY).encode(), "", "12"])
async def test_a_body_over_the_limit_is_413_however_it_arrives(declared: bytes | str) -> None:
    half = b"x" * (MAX_BODY // 2 + 1)
    with pytest.raises(ApiRequestError) as caught:
        await receive_body(receiver(part(half, True), part(half)), declared)
    assert caught.value.status == 413


async def test_a_declared_length_over_the_limit_is_413_before_reading() -> None:
    with pytest.raises(ApiRequestError) as caught:
        await receive_body(receiver(), str(MAX_BODY + 1).encode())
    assert caught.value.status == 413


async def test_a_client_gone_while_sending_the_body_is_400() -> None:
    with pytest.raises(ApiRequestError) as caught:
        await receive_body(receiver(part(b"{", True), {"type": "http.disconnect"}), b"")
    assert caught.value.status == 400


def test_first_headers_reads_what_starlette_reads() -> None:
    raw = [
        (b"authorization", b"Bearer first"),
        (b"host", b"a.example"),
        (b"authorization", b"Bearer second"),
        (b"x-chatlane-session", b"s\xc3\xbc"),
    ]
    scope = {"type": "http", "headers": raw}
    headers = first_headers(scope)
    starlette = Headers(scope=scope)
    for name, _ in raw:
        assert headers[name].decode("latin-1") == starlette[name.decode()]
    assert b"origin" not in headers


# -- the chat endpoint, driven as an ASGI app --------------------------------------------


def adapter() -> ApiAdapter:
    """The API adapter with an access token, and no gateway."""
    return ApiAdapter(Config(), access=AccessToken(TokenSource(Secret(), TOKEN)))


async def post(
    api: ApiAdapter, headers: list[tuple[bytes, bytes]], body: bytes = b""
) -> tuple[int, dict[str, Any]]:
    """Send one chat completion to the endpoint (with no gateway started)."""
    scope = {
        "type": "http",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "headers": headers,
    }
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    await api.chat_completions(scope, receiver(part(body)), send)
    return sent[0]["status"], json.loads(sent[1]["body"])


BODY = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()


def request_headers(*extra: tuple[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    return [
        (b"host", b"127.0.0.1:8080"),
        *extra,
        (b"content-type", b"application/json"),
        (b"x-chatlane-session", b"s"),
    ]


async def test_the_first_authorization_header_is_the_one_checked() -> None:
    api = adapter()
    good, bad = (b"authorization", f"Bearer {TOKEN}".encode()), (b"authorization", b"Bearer x")
    status, answer = await post(api, request_headers(bad, good), BODY)
    assert status == 401
    assert answer["error"]["code"] == "invalid_api_key"
    status, answer = await post(api, request_headers(good, bad), BODY)
    assert status == 503  # past every check: no gateway runs here
    assert answer["error"]["message"] == "the gateway is not running"


@pytest.mark.parametrize(
    ("extra", "status", "code"),
    [
        ((b"origin", b"http://evil.example"), 403, "foreign_origin"),
        ((b"origin", b"null"), 403, "foreign_origin"),
        ((b"origin", b"http://127.0.0.1:8080"), 503, None),
        ((b"x-chatlane-session", b"\xff"), 400, "invalid_request"),
        ((b"content-type", b"text/plain"), 415, "unsupported_media_type"),
        ((b"content-length", str(MAX_BODY + 1).encode()), 413, "request_too_large"),
    ],
)
async def test_the_endpoint_checks_its_headers_in_one_pass(
    extra: tuple[bytes, bytes], status: int, code: str | None
) -> None:
    api = adapter()
    auth = (b"authorization", f"Bearer {TOKEN}".encode())
    got, answer = await post(api, [extra, *request_headers(auth)], BODY)
    assert got == status
    assert answer["error"]["code"] == code
