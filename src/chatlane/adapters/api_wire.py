"""The OpenAI wire format: reading chat-completion requests, writing responses and SSE events.

What stays true:

* A request either becomes a :class:`ChatRequest` or raises
  :class:`ApiRequestError` with an HTTP status and a message that says what is
  wrong — malformed JSON, wrong types and invalid Unicode never reach the
  gateway and never become a 500.
* Every body written here has exactly the shape OpenAI's own API uses, so the
  official clients parse it (``chat.completion``, ``chat.completion.chunk``,
  ``list`` of ``model``, ``{"error": {...}}``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from typing import Any
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from chatlane.errors import ChatlaneError, InvalidSessionName
from chatlane.identity import check_session_name

MAX_BODY = 1 << 20
"""Largest request body accepted (1 MiB); larger ones get 413."""
DEFAULT_MODEL = "chatlane"
JSON_MEDIA_TYPE = "application/json"
_DEFAULT_PORTS = {"http": 80, "https": 443}


class ApiRequestError(ChatlaneError):
    """A request the API answers with an error status instead of running it."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        code: str | None = None,
        *,
        allow: str = "",
        param: str | None = None,
        retry: bool = True,
        retry_after: int = 0,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.code = code
        self.allow = allow
        """For a 405: the method the path takes (the ``Allow`` header)."""
        self.param = param
        """The request field at fault, as OpenAI names it (``messages[2].content``)."""
        self.retry = retry
        """Whether sending the request again is safe. False once its message was taken
        and may still run (a 504, the 503 of a shutdown): the response then says
        ``x-should-retry: false``, which OpenAI's SDKs obey, since their own retry
        carries no ``Idempotency-Key`` and would run the message a second time. False
        too for a 429 an immediate retry cannot pass (``too_many_wrong_tokens``)."""
        self.retry_after = retry_after
        """Whole seconds to wait before sending it again (the ``Retry-After`` header); 0: no
        such wait is known."""

    def body(self) -> dict[str, Any]:
        """The OpenAI-shaped error body."""
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(message: str, param: str | None = None) -> ApiRequestError:
    """A 400 for a request that cannot be read; ``param`` names the body field at fault."""
    return ApiRequestError(400, message, "invalid_request_error", "invalid_request", param=param)


def model_not_found(name: str, known: Sequence[str]) -> ApiRequestError:
    """The 404 for a model this gateway does not serve, as OpenAI answers it."""
    served = ", ".join(repr(model) for model in known)
    return ApiRequestError(
        404,
        f"the model {name!r} does not exist here: this gateway serves {served} (GET /v1/models)",
        "invalid_request_error",
        "model_not_found",
        param="model",
    )


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """What chatlane takes from a chat-completion request: the session, the input, the mode."""

    session: str
    text: str
    stream: bool
    model: str
    busy_policy: str = ""
    """The busy policy the request asks for (``X-Chatlane-Busy``); empty: the session's."""
    idempotency_key: str = ""
    """The request's ``Idempotency-Key`` (empty: none): its retries get the same completion."""


def decode_json(body: bytes) -> object:
    """The JSON value of ``body``.

    :raises ApiRequestError: (400) if it is not UTF-8 JSON.
    """
    try:
        return json.loads(body)
    except (UnicodeDecodeError, ValueError) as error:
        raise invalid(f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise invalid("the request body is nested too deeply") from None


def parse_chat_request(data: object, session_header: str | None) -> ChatRequest:
    """Read a decoded chat-completion request; the header names the session before ``user``.

    :raises ApiRequestError: (400) naming the field that is missing or of the wrong type.
    """
    if not isinstance(data, dict):
        raise invalid("the request body must be a JSON object")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid("'stream' must be true or false", "stream")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("'model' must be a string", "model")
    model = (model or "").strip() or DEFAULT_MODEL
    session = _session_name(session_header, data.get("user"))
    return ChatRequest(session, last_user_text(data.get("messages")), stream, model)


def _session_name(header: str | None, user: object) -> str:
    """The header if it is non-empty, else ``user``: exactly as sent, or refused with a 400."""
    if user is not None and not isinstance(user, str):
        raise invalid("'user' must be a string", "user")
    if header:
        return _checked_name(header, "the X-Chatlane-Session header", None)
    if user:
        return _checked_name(user, "the 'user' field", "user")
    raise invalid(
        "name the session: send an X-Chatlane-Session header or set the 'user' field", "user"
    )


def _checked_name(name: str, what: str, param: str | None) -> str:
    try:
        return check_session_name(name, what)
    except InvalidSessionName as error:
        raise invalid(str(error), param) from None


def last_user_text(messages: object) -> str:
    """The text of the last ``user`` message (the gateway keeps the earlier history itself).

    :raises ApiRequestError: (400) if there is none, or it has no text.
    """
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list", "messages")
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if not isinstance(message, dict):
            raise invalid(f"messages[{index}] must be an object", f"messages[{index}]")
        if message.get("role") == "user":
            text = _content_text(message.get("content"), index)
            if not text.strip():
                what = f"messages[{index}]"
                raise invalid(f"{what} (the last user message) has no text", f"{what}.content")
            return _valid_unicode(text, f"messages[{index}].content")
    raise invalid("'messages' has no message with role 'user'", "messages")


def _content_text(content: object, index: int) -> str:
    """A string, or the text parts of a list of content parts joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        what = f"messages[{index}].content"
        raise invalid(f"{what} must be a string or a list of parts", what)
    texts: list[str] = []
    for part in content:
        if not isinstance(part, dict):
            raise _bad_part(index, content.index(part), " must hold objects", "")
        if part.get("type") == "text":
            text = part.get("text")
            if not isinstance(text, str):
                where = content.index(part)
                raise _bad_part(index, where, ": a text part needs a string 'text'", ".text")
            texts.append(text)
    return "\n".join(texts)


def _bad_part(index: int, number: int, problem: str, field: str) -> ApiRequestError:
    """The 400 for part ``number`` of ``messages[index].content`` (``field`` of it is at fault)."""
    what = f"messages[{index}].content"
    return invalid(what + problem, f"{what}[{number}]{field}")


def _valid_unicode(text: str, what: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(f"{what} is not valid Unicode (lone surrogate)", what) from None
    return text


# -- responses -------------------------------------------------------------------------


def completion(response_id: str, model: str, content: str) -> dict[str, Any]:
    """A whole ``chat.completion``."""
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }


_COMPLETION_PARTS = (
    '{"id": ',
    ', "object": "chat.completion", "created": ',
    ', "model": ',
    ', "choices": [{"index": 0, "message": {"role": "assistant", "content": ',
    '}, "finish_reason": "stop"}], "usage": '
    '{"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}',
)


def completion_body(response_id: str, model: str, content: str) -> bytes:
    """The JSON of :func:`completion`: the same bytes :func:`encode` makes of it, written
    straight from a template (only the three texts are encoded, by :mod:`json`'s own
    escaping), as every non-streamed answer is sent."""
    head, created, model_at, content_at, tail = _COMPLETION_PARTS
    return "".join(
        (
            head,
            encode_basestring_ascii(response_id),
            created,
            str(int(time.time())),
            model_at,
            encode_basestring_ascii(model),
            content_at,
            encode_basestring_ascii(content),
            tail,
        )
    ).encode()


def chunk(
    response_id: str, model: str, delta: dict[str, str], finish_reason: str | None = None
) -> dict[str, Any]:
    """One ``chat.completion.chunk`` of a streamed response."""
    return {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }


class ChunkEvents:
    """The ``data:`` events of one streamed completion, a ``chat.completion.chunk`` each.

    Each is the event :func:`sse_data` makes of :func:`chunk`, except that they
    share one ``created`` time, as the chunks of OpenAI's own streams do; the
    part they share is encoded once.
    """

    def __init__(self, response_id: str, model: str) -> None:
        shared = json.dumps(
            {
                "id": response_id,
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": model,
            }
        )
        self._head = f'data: {shared[:-1]}, "choices": [{{"index": 0, "delta": '.encode()

    def delta(self, delta: dict[str, str], finish_reason: str | None = None) -> bytes:
        """The event of a chunk holding ``delta`` (and ending with ``finish_reason``)."""
        rest = f', "finish_reason": {json.dumps(finish_reason)}}}]}}\n\n'
        return self._head + json.dumps(delta).encode() + rest.encode()

    def content(self, text: str) -> bytes:
        """The event of a chunk holding ``text`` (``{"content": text}``)."""
        content = json.dumps(text).encode()
        return b"".join((self._head, b'{"content": ', content, b'}, "finish_reason": null}]}\n\n'))


def model_list(names: list[str]) -> dict[str, Any]:
    """The ``GET /v1/models`` body."""
    return {"object": "list", "data": [model_entry(name) for name in names]}


def model_entry(name: str) -> dict[str, Any]:
    """One model, as ``GET /v1/models/{name}`` answers it."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "chatlane"}


_ROUTED = {"/v1/chat/completions": "POST", "/v1/models": "GET"}


def unrouted_error(method: str, path: str) -> ApiRequestError:
    """The error for ``method path`` under ``/v1`` that no route takes: 405 or 404."""
    allowed = _ROUTED.get(path) or ("GET" if path.startswith("/v1/models/") else None)
    if allowed is not None:
        message = f"{method} is not allowed on {path}; use {allowed}"
        kind = "invalid_request_error"
        return ApiRequestError(405, message, kind, "method_not_allowed", allow=allowed)
    return ApiRequestError(404, f"no such endpoint: {path}", "invalid_request_error", "not_found")


def encode(value: object) -> bytes:
    """JSON bytes, ASCII-escaped so any text an agent produced can be sent."""
    return json.dumps(value).encode()


def sse_data(value: object) -> bytes:
    """One ``data:`` event (JSON, or the literal ``[DONE]``)."""
    text = value if isinstance(value, str) else json.dumps(value)
    return f"data: {text}\n\n".encode()


def sse_comment(text: str) -> bytes:
    """An SSE comment (clients ignore it); every line of ``text`` is prefixed with ``:``."""
    lines = text.splitlines() or [""]
    return ("".join(f": {line}\n" for line in lines) + "\n").encode(errors="replace")


# -- HTTP ------------------------------------------------------------------------------


class AsgiEndpoint:
    """An ASGI callable as a route's endpoint: Starlette runs it as it is, with no
    :class:`Request` or :class:`Response` in between (a bound method it would wrap)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._app(scope, receive, send)


JSON_HEADERS = [(b"content-type", JSON_MEDIA_TYPE.encode())]
SSE_HEADERS = [
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
    (b"content-type", b"text/event-stream; charset=utf-8"),
]


async def send_json(send: Send, value: object) -> None:
    """Send ``value`` as a ``200`` JSON response (what :func:`json_response` sends)."""
    await send_json_body(send, encode(value))


COMPLETION_ID_HEADER = "x-chatlane-completion-id"
"""The response header naming a request's completion (``GET /v1/chat/completions/{id}``)."""


def completion_id_header(response_id: str) -> tuple[bytes, bytes]:
    """The :data:`COMPLETION_ID_HEADER` of the completion ``response_id``, as ASGI sends it."""
    return (COMPLETION_ID_HEADER.encode(), response_id.encode("ascii"))


async def send_json_body(
    send: Send, body: bytes, headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    """Send ``body``, JSON already encoded, as a ``200`` response (as :func:`send_json`)."""
    length = (b"content-length", str(len(body)).encode())
    start = [length, *JSON_HEADERS, *headers]
    await send({"type": "http.response.start", "status": 200, "headers": start})
    await send({"type": "http.response.body", "body": body})


class EventStream:
    """A ``text/event-stream`` response, sent through ``send`` as its events come.

    Each :meth:`send` is one write, however many events it holds; :meth:`end`
    sends the last of them with the end of the response.
    """

    def __init__(self, send: Send) -> None:
        self._send = send

    async def start(self, first: bytes, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
        """Send the headers (``headers`` besides the stream's own) and the first event."""
        start = [*SSE_HEADERS, *headers]
        await self._send({"type": "http.response.start", "status": 200, "headers": start})
        await self.send([first])

    async def send(self, events: list[bytes]) -> None:
        body = b"".join(events)
        await self._send({"type": "http.response.body", "body": body, "more_body": True})

    async def end(self, events: list[bytes]) -> None:
        await self._send({"type": "http.response.body", "body": b"".join(events)})


def require_json(request: Request) -> None:
    """Accept only a body declared as ``application/json`` (parameters such as charset allowed).

    A browser sends ``text/plain`` or form bodies cross-site without a CORS
    preflight; ``application/json`` always needs one, so no other page can post.

    :raises ApiRequestError: (415) for any other or a missing ``Content-Type``.
    """
    require_json_type(request.headers.get("content-type", ""))


def require_json_type(declared: str) -> None:
    """:func:`require_json` for the ``Content-Type`` header's value (``""`` if absent)."""
    if declared.partition(";")[0].strip().lower() != JSON_MEDIA_TYPE:
        raise ApiRequestError(
            415,
            f"the request body must be sent with Content-Type: {JSON_MEDIA_TYPE}",
            "invalid_request_error",
            "unsupported_media_type",
        )


def check_origin(request: Request) -> None:
    """Refuse a request a browser sent from another origin than the gateway's own.

    API clients send no ``Origin``; a browser sends it with every ``POST`` and
    every cross-origin ``fetch``, so a present ``Origin`` must equal the
    request's own scheme and ``Host`` (default ports filled in).

    :raises ApiRequestError: (403) for a foreign (or unreadable, or ``null``) origin.
    """
    origin = request.headers.get("origin")
    if origin is None:
        return
    check_origin_of(origin, request.url.scheme, request.headers.get("host", ""))


def check_origin_of(origin: str, scheme: str, host: str) -> None:
    """:func:`check_origin` for a present ``Origin`` and the request's scheme and ``Host``.

    :raises ApiRequestError: (403) for a foreign (or unreadable, or ``null``) origin.
    """
    own = _origin_key(f"{scheme}://{host}")
    if own is None or _origin_key(origin) != own:
        raise ApiRequestError(
            403,
            "cross-origin requests are refused: the Origin is not this gateway",
            "permission_error",
            "foreign_origin",
        )


def _origin_key(url: str) -> tuple[str, str, int] | None:
    """``(scheme, host, port)`` of ``url``, the default port filled in; ``None`` if unreadable."""
    try:
        parts = urlsplit(url.strip())
        scheme, host, port = parts.scheme.lower(), parts.hostname, parts.port
    except ValueError:
        return None
    if port is None:
        port = _DEFAULT_PORTS.get(scheme)
    if not host or port is None:
        return None
    return scheme, host.lower(), port


async def read_body(request: Request) -> bytes:
    """The request body, at most :data:`MAX_BODY` bytes.

    :raises ApiRequestError: (413) for a larger body, (400) if the client left
        before sending all of it.
    """
    return await receive_body(request.receive, request.headers.get("content-length", ""))


async def receive_body(receive: Receive, declared_length: str | bytes) -> bytes:
    """:func:`read_body` from ``receive``, given the ``Content-Length`` header (``""`` if absent).

    A body that arrives in one message (as a small one does) is returned as it came.
    """
    if declared_length.isdigit() and int(declared_length) > MAX_BODY:
        raise _too_large()
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise invalid("the client disconnected while sending the body")
        part: bytes = message.get("body", b"")
        size += len(part)
        if size > MAX_BODY:
            raise _too_large()
        if not message.get("more_body", False):
            if not parts:
                return part
            parts.append(part)
            return b"".join(parts)
        parts.append(part)


BUSY_HEADER_CHOICES = (
    "queue",
    "collect",
    "rollback",
    "interrupt",
    "redirect",
    "steer",
    "steer-backlog",
    "reject",
)
"""What ``X-Chatlane-Busy`` may name (``interrupt`` is ``rollback``'s former name,
``steer-backlog`` another name of ``steer``)."""
_OTHER_NAMES = {"interrupt": "rollback", "steer-backlog": "steer"}


def busy_header(value: bytes | None) -> str:
    """The busy policy an ``X-Chatlane-Busy`` header names (``""`` if absent).

    :raises ApiRequestError: (400) if it names none.
    """
    if value is None:
        return ""
    name = value.decode("latin-1").strip().lower()
    if name not in BUSY_HEADER_CHOICES:
        choices = ", ".join(BUSY_HEADER_CHOICES)
        raise invalid(f"the X-Chatlane-Busy header must be one of: {choices}")
    return _OTHER_NAMES.get(name, name)


def first_headers(scope: Scope) -> dict[bytes, bytes]:
    """Each header's first value by its name, as sent: the one Starlette's ``Headers`` reads.

    One pass over the request's headers, for an endpoint that reads several of them.
    """
    headers: list[tuple[bytes, bytes]] = list(scope["headers"])
    headers.reverse()
    return dict(headers)


def _too_large() -> ApiRequestError:
    return ApiRequestError(
        413,
        f"the request body is larger than {MAX_BODY} bytes",
        "invalid_request_error",
        "request_too_large",
    )


SHOULD_RETRY_HEADER = "x-should-retry"
"""The header OpenAI's SDKs read before retrying an error response on their own."""


def json_response(body: object, status: int = 200) -> Response:
    """A JSON response (ASCII-escaped, so any text can be sent)."""
    return Response(encode(body), status_code=status, media_type="application/json")


def error_response(error: ApiRequestError) -> Response:
    """The OpenAI-shaped error response for ``error``."""
    response = json_response(error.body(), error.status)
    if error.status == 401:
        response.headers["WWW-Authenticate"] = "Bearer"
    if error.allow:
        response.headers["Allow"] = error.allow
    if not error.retry:
        response.headers[SHOULD_RETRY_HEADER] = "false"
    if error.retry_after:
        response.headers["Retry-After"] = str(error.retry_after)
    return response


__all__ = [
    "COMPLETION_ID_HEADER",
    "MAX_BODY",
    "SHOULD_RETRY_HEADER",
    "ApiRequestError",
    "AsgiEndpoint",
    "ChatRequest",
    "ChunkEvents",
    "EventStream",
    "check_origin",
    "check_origin_of",
    "chunk",
    "completion",
    "completion_body",
    "completion_id_header",
    "decode_json",
    "encode",
    "error_response",
    "first_headers",
    "invalid",
    "json_response",
    "model_entry",
    "model_list",
    "model_not_found",
    "parse_chat_request",
    "read_body",
    "receive_body",
    "require_json",
    "require_json_type",
    "send_json",
    "send_json_body",
    "sse_comment",
    "sse_data",
    "unrouted_error",
]
