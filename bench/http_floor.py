"""The floor of ``bench.http``: an OpenAI-shaped chat endpoint on bare Starlette and uvicorn.

It answers ``POST /v1/chat/completions`` as chatlane's API answers the demo
agent, and does nothing else. What stays true:

* Per request it checks the bearer token (in constant time), reads the JSON
  body, takes the last ``user`` message, and answers ``echo: <text>``: a
  ``chat.completion``, or for ``"stream": true`` the same server-sent events
  chatlane sends (a role chunk, the echo in the demo agent's chunks, a stop
  chunk, ``data: [DONE]``), encoded with :func:`json.dumps` as chatlane does.
  ``tokens <n>`` is answered as the demo agent answers it: ``n`` chunks, each
  after one more pass of the event loop.
* No session, store, turn, queue or middleware: whatever chatlane costs
  beyond this is the cost of being a gateway.
* uvicorn runs it as ``chatlane serve`` runs chatlane: h11, the default event
  loop, chatlane's idle keep-alive, log level ``warning`` (no access log). Only
  the protocol class differs: uvicorn's own, without chatlane's header deadline
  and connection cap.

Run as ``python -m bench.http_floor --port PORT --token-file PATH`` (``bench.http`` does).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from chatlane.agents.demo import token_chunks
from chatlane.config import ServerConfig

DEFAULT_MODEL = "chatlane"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def build_app(token: bytes) -> Starlette:
    """The floor's app: one route, whose requests must carry ``token`` as a bearer token."""

    async def chat_completions(request: Request) -> Response:
        scheme, _, presented = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(presented.encode(), token):
            return error(401, "missing or invalid bearer token")
        try:
            data = json.loads(await request.body())
            text = last_user_text(data["messages"])
        except (ValueError, KeyError, TypeError):
            return error(400, "not a chat completion request")
        model = data.get("model") or DEFAULT_MODEL
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        pieces, paced = answer(text)
        if data.get("stream"):
            events = stream(response_id, model, pieces, paced)
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        return json_response(completion(response_id, model, "".join(pieces)))

    return Starlette(routes=[Route("/v1/chat/completions", chat_completions, methods=["POST"])])


def last_user_text(messages: list[dict[str, Any]]) -> str:
    """:raises ValueError: unless some message has the role ``user`` and string content."""
    for message in reversed(messages):
        if message["role"] == "user" and isinstance(message["content"], str):
            return message["content"]
    raise ValueError("no user message")


def answer(text: str) -> tuple[list[str], bool]:
    """The demo agent's chunks for ``text``, and whether they come one loop pass apart."""
    command, _, rest = text.partition(" ")
    if command == "tokens" and rest.isdecimal():
        return token_chunks(int(rest)), True
    return echo_chunks(f"echo: {text}"), False


def echo_chunks(text: str) -> list[str]:
    """``text`` cut as the demo agent cuts its echo: into pieces of a third of its length."""
    size = max(1, len(text) // 3)
    return [text[start : start + size] for start in range(0, len(text), size)]


async def stream(
    response_id: str, model: str, pieces: list[str], paced: bool
) -> AsyncIterator[bytes]:
    yield sse(chunk(response_id, model, {"role": "assistant", "content": ""}))
    for number, piece in enumerate(pieces):
        if paced and number:
            await asyncio.sleep(0)
        yield sse(chunk(response_id, model, {"content": piece}))
    yield sse(chunk(response_id, model, {}, "stop"))
    yield sse("[DONE]")


def completion(response_id: str, model: str, content: str) -> dict[str, Any]:
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


def chunk(
    response_id: str, model: str, delta: dict[str, str], finish_reason: str | None = None
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }


def sse(value: object) -> bytes:
    text = value if isinstance(value, str) else json.dumps(value)
    return f"data: {text}\n\n".encode()


def json_response(body: object, status: int = 200) -> Response:
    return Response(json.dumps(body).encode(), status_code=status, media_type="application/json")


def error(status: int, message: str) -> Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None}}
    return json_response(body, status)


def uvicorn_config(app: Starlette, port: int) -> uvicorn.Config:
    """``chatlane serve``'s uvicorn settings (see :func:`chatlane.serve.uvicorn_config`),
    with uvicorn's own h11 protocol."""
    return uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        http="h11",
        timeout_keep_alive=ServerConfig().keep_alive,
        log_level="warning",
        lifespan="on",
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-file", type=Path, required=True)
    args = parser.parse_args(argv)
    token = args.token_file.read_bytes().strip()
    uvicorn.Server(uvicorn_config(build_app(token), args.port)).run()


if __name__ == "__main__":
    main()
