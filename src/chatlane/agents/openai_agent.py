"""The ``openai`` agent: any OpenAI-compatible chat-completions endpoint, streamed.

What stays true:

* Each turn sends the session's recent history from the store (the last
  ``config.history`` user and assistant entries of the current conversation)
  and then the turn's own input, which the transcript does not hold yet.
* The session's ``/model``, ``/reasoning`` and ``/fast`` choices apply to the
  turn that reads them: the model name (and endpoint, if one was chosen),
  ``reasoning_effort``, and ``service_tier`` (omitted by default, ``"default"``
  when fast mode is off, ``"priority"`` when on).
* The configured API key is only ever sent to the configured endpoint; a
  ``/model --base-url`` elsewhere is called without it, so no chat user can
  redirect the key to a server of their choice. The key is never logged and
  never part of ``repr``.
* An interrupted turn closes its HTTP stream at once — while waiting for the
  next chunk too — and yields nothing more.
* The upstream session is named by a hash of the session key (the
  ``X-Chatlane-Session`` header), so a chatlane upstream keeps one session per
  downstream session without learning chat or user ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any, Protocol

from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

from chatlane.config import OpenAIConfig
from chatlane.runtime.turn import Turn, TurnOverrides
from chatlane.state import SERVICE_TIER_UNSET
from chatlane.stores.base import TranscriptEntry
from chatlane.types import ModelChoice, SessionKey

log = logging.getLogger("chatlane.agents.openai")

SESSION_HEADER = "X-Chatlane-Session"
NO_KEY = "none"
"""Sent (as the SDK needs some key) to endpoints that must not see the configured one."""
_HISTORY_ROLES = frozenset({"user", "assistant"})


class TranscriptSource(Protocol):
    """Where the agent reads history; every :class:`~chatlane.stores.Store` is one."""

    async def transcript(
        self, key: SessionKey, conversation_id: str | None = None, limit: int = 100
    ) -> list[TranscriptEntry]: ...


class OpenAIAgent:
    """Answers turns through an OpenAI-compatible endpoint (see the module docstring).

    :param config: endpoint, default model, API key source and history length.
    :param store: where history is read; may be given later with :meth:`bind`.
        Without one, each turn sends only its own input.
    :param environ: where the API key's environment variable is read (default ``os.environ``).
    """

    accepts_steering = False

    def __init__(
        self,
        config: OpenAIConfig,
        store: TranscriptSource | None = None,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config
        self._api_key = config.api_key.read(os.environ if environ is None else environ)
        self._store = store
        self._clients: dict[str, AsyncOpenAI] = {}

    def bind(self, store: TranscriptSource) -> None:
        """Read history from ``store`` from now on (the gateway's store, once it is open)."""
        self._store = store

    def __repr__(self) -> str:
        return f"<OpenAIAgent {self.config.model!r} at {self.config.base_url!r}>"

    def __call__(self, turn: Turn) -> AsyncIterator[str]:
        return self._reply(turn)

    async def _reply(self, turn: Turn) -> AsyncIterator[str]:
        messages = await self.messages(turn)
        client, model = self._endpoint(turn.overrides.model)
        stream = await client.chat.completions.create(
            model=model,
            messages=messages,
            stream=True,
            extra_headers={SESSION_HEADER: upstream_session(turn.session_key)},
            **request_options(turn.overrides),
        )
        async with (
            stream,
            contextlib.aclosing(until_interrupted(stream, turn.interrupted)) as chunks,
        ):
            async for chunk in chunks:
                text = delta_text(chunk)
                if text:
                    yield text

    async def messages(self, turn: Turn) -> list[ChatCompletionMessageParam]:
        """The history of ``turn``'s conversation, then its input."""
        history: list[ChatCompletionMessageParam] = []
        if self._store is not None and self.config.history > 0:
            entries = await self._store.transcript(turn.session_key, limit=self.config.history)
            history = [_message(e.role, e.content) for e in entries if e.role in _HISTORY_ROLES]
        return [*history, {"role": "user", "content": turn.text}]

    def _endpoint(self, choice: ModelChoice | None) -> tuple[AsyncOpenAI, str]:
        """The client for the turn's endpoint and the model name to ask for."""
        base_url = _normal(choice.base_url if choice and choice.base_url else self.config.base_url)
        client = self._clients.get(base_url)
        if client is None:
            trusted = base_url == _normal(self.config.base_url)
            key = self._api_key if trusted and self._api_key else NO_KEY
            client = self._clients[base_url] = AsyncOpenAI(base_url=base_url, api_key=key)
        return client, choice.name if choice else self.config.model

    async def aclose(self) -> None:
        """Close every HTTP client this agent opened."""
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()


def request_options(overrides: TurnOverrides) -> dict[str, Any]:
    """``reasoning_effort`` and ``service_tier`` as the session chose them (absent by default)."""
    options: dict[str, Any] = {}
    if overrides.reasoning:
        options["reasoning_effort"] = overrides.reasoning
    tier = overrides.service_tier
    if tier is not SERVICE_TIER_UNSET:
        options["service_tier"] = "default" if tier is None else tier
    return options


def upstream_session(key: SessionKey) -> str:
    """A stable name for ``key`` that reveals none of its ids."""
    return "cl-" + hashlib.sha256(key.encode()).hexdigest()[:32]


def delta_text(chunk: ChatCompletionChunk) -> str:
    """The text a streamed chunk adds (empty for role-only and final chunks)."""
    if not chunk.choices:
        return ""
    return chunk.choices[0].delta.content or ""


async def until_interrupted(
    chunks: AsyncIterator[ChatCompletionChunk], interrupted: asyncio.Event
) -> AsyncGenerator[ChatCompletionChunk, None]:
    """``chunks`` until they end or ``interrupted`` is set, even mid-wait for the next one."""
    iterator = aiter(chunks)
    stop = asyncio.ensure_future(interrupted.wait())
    try:
        while not interrupted.is_set():
            following = asyncio.ensure_future(anext(iterator))
            await asyncio.wait({following, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not following.done():
                following.cancel()
                await asyncio.gather(following, return_exceptions=True)
                return
            try:
                chunk = following.result()
            except StopAsyncIteration:
                return
            yield chunk
    finally:
        stop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stop


def _message(role: str, content: str) -> ChatCompletionMessageParam:
    if role == "assistant":
        return {"role": "assistant", "content": content}
    return {"role": "user", "content": content}


def _normal(url: str) -> str:
    return url.strip().rstrip("/")


__all__ = ["OpenAIAgent", "TranscriptSource", "request_options", "upstream_session"]
