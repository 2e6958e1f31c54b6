"""The ``openai`` agent: any OpenAI-compatible chat-completions endpoint, streamed.

What stays true:

* Each turn sends the session's recent history from the store (the last
  ``config.history`` user, assistant and context entries of the current conversation)
  and then the turn's own input, which the transcript does not hold yet.
* The session's ``/model``, ``/reasoning`` and ``/fast`` choices apply to the
  turn that reads them: the model name (and endpoint, if one was chosen),
  ``reasoning_effort``, and ``service_tier`` (omitted by default, ``"default"``
  when fast mode is off, ``"priority"`` when on).
* The configured API key is only ever sent to the configured endpoint; a
  ``/model --base-url`` elsewhere is called without it, so no chat user can
  redirect the key to a server of their choice. The key is never logged and
  never part of ``repr``.
* A chat-chosen endpoint is called only if :attr:`OpenAIAgent.endpoints`
  allows it at the turn that uses it (see :mod:`chatlane.endpoints`). No
  endpoint's redirect is followed: a listed endpoint answering 3xx could
  otherwise send the gateway to any address (another port, loopback, a cloud
  metadata service) and the answer back to the chat; a 3xx fails the turn.
* Whatever goes wrong with an endpoint — refused, unreachable, an error
  status, a broken stream — the turn fails with one :class:`EndpointFailed`,
  logged in one line with the endpoint's URL and the cause, URLs redacted.
  The chat is told what went wrong in words (:class:`EndpointTrouble`: the
  key refused, the model unknown, the endpoint unreachable) only for the
  configured endpoint; a chat-chosen one fails with the same words whatever
  the cause, so a chat learns nothing about which ports answer.
* At most :data:`CLIENT_CACHE_SIZE` HTTP clients are kept, one per endpoint,
  the least recently used closed first.
* An interrupted turn closes its HTTP stream at once — while waiting for the
  next chunk too — and yields nothing more.
* The upstream session is named by a hash of the session key (the
  ``X-Chatlane-Session`` header), so a chatlane upstream keeps one session per
  downstream session without learning chat or user ids.
* What a chat said without mentioning the bot before the turn
  (:attr:`~chatlane.runtime.turn.Turn.context`) is sent as a user message of
  its own before the turn's input, labelled "Earlier in this chat, not
  addressed to you:" (:func:`~chatlane.overheard.render`); history holds it
  the same way (the transcript's ``context`` entries).
* Attachments are described in the text of their message, one line for all
  (:func:`~chatlane.attachments.summary`), in the turn's input and in history
  alike; an image whose reference is an http(s) URL is sent too, as an
  ``image_url`` part of the turn's input (never of history). A platform's file
  id is never sent as a URL: the endpoint could not fetch it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, Protocol

from openai import (
    APIConnectionError,
    AsyncOpenAI,
    AuthenticationError,
    DefaultAsyncHttpxClient,
    NotFoundError,
    OpenAIError,
    PermissionDeniedError,
)
from openai.types.chat import (
    ChatCompletionChunk,
    ChatCompletionContentPartParam,
    ChatCompletionMessageParam,
    ChatCompletionUserMessageParam,
)

from chatlane.agents.clients import ClientCache
from chatlane.attachments import summary
from chatlane.config import OpenAIConfig
from chatlane.endpoints import EndpointPolicy, EndpointRefused, Resolver, system_resolver
from chatlane.errors import AgentFailed, ChatlaneError
from chatlane.overheard import CONTEXT_ROLE, render
from chatlane.redaction import redact_client_logs, redact_urls
from chatlane.runtime.turn import Turn, TurnOverrides
from chatlane.secrets import read_secret
from chatlane.state import SERVICE_TIER_UNSET
from chatlane.stores.base import TranscriptEntry
from chatlane.types import Attachment, AttachmentKind, ModelChoice, SessionKey, clipped

SESSION_HEADER = "X-Chatlane-Session"
NO_KEY = "none"
"""Sent (as the SDK needs some key) to endpoints that must not see the configured one."""
_HISTORY_ROLES = frozenset({"user", "assistant", CONTEXT_ROLE})
CLIENT_CACHE_SIZE = 8
"""HTTP clients kept at once (each holds a connection pool); the least recently used goes."""


class EmptyCompletion(ChatlaneError):
    """The endpoint answered, but with no completion chunk at all."""


class EndpointTrouble(enum.Enum):
    """What went wrong with a model endpoint, in the words its chat is told."""

    KEY_REFUSED = "the model endpoint refused the API key"
    UNKNOWN_MODEL = "the model endpoint does not know the model"
    UNREACHABLE = "the model endpoint could not be reached"
    FAILED = "the model endpoint could not be used"
    """Anything else; and whatever happened at an endpoint a chat chose."""


class EndpointFailed(AgentFailed):
    """The model endpoint could not be used for a turn: ``trouble`` says how, in words a
    chat may read; ``detail`` (for the log) names the endpoint and the cause."""

    def __init__(self, trouble: EndpointTrouble = EndpointTrouble.FAILED, detail: str = "") -> None:
        super().__init__(trouble.value, detail)
        self.trouble = trouble


def trouble_of(error: Exception, model: str) -> EndpointTrouble:
    """What ``error``, from asking the endpoint for ``model``, says went wrong."""
    if isinstance(error, AuthenticationError | PermissionDeniedError):
        return EndpointTrouble.KEY_REFUSED
    if isinstance(error, NotFoundError) and (
        error.code == "model_not_found" or model in str(error)
    ):
        return EndpointTrouble.UNKNOWN_MODEL
    if isinstance(error, APIConnectionError):
        return EndpointTrouble.UNREACHABLE
    return EndpointTrouble.FAILED


CAUSE_SHOWN = 200
"""Characters of an endpoint's error the log line keeps (an error page can be long)."""


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
    :param api_key: the key, read at start (:func:`~chatlane.secrets.resolve_secrets`);
        default: read now from ``config.api_key`` (:func:`~chatlane.secrets.read_secret`).
    :param resolve: how chat-chosen endpoints' host names are resolved (the system's by default).
    :raises EndpointRefused: for an entry of ``config.allowed_base_urls`` that is not a plain URL.
    """

    accepts_steering = False

    def __init__(
        self,
        config: OpenAIConfig,
        store: TranscriptSource | None = None,
        *,
        api_key: str | None = None,
        resolve: Resolver = system_resolver,
    ) -> None:
        self.config = config
        self.endpoints = EndpointPolicy.of(config.base_url, config.allowed_base_urls, resolve)
        """Which endpoints a chat may choose; the ``/model`` command applies it too."""
        self._api_key = read_secret(config.api_key) if api_key is None else api_key
        self._store = store
        self._clients = ClientCache(self._client, CLIENT_CACHE_SIZE)
        redact_client_logs()

    @property
    def default_model(self) -> str:
        """The model asked for where a conversation chose none (``/model`` names it)."""
        return self.config.model

    @property
    def has_key(self) -> bool:
        """Whether an API key was configured (a local server may need none)."""
        return bool(self._api_key)

    def bind(self, store: TranscriptSource) -> None:
        """Read history from ``store`` from now on (the gateway's store, once it is open)."""
        self._store = store

    def __repr__(self) -> str:
        return f"<OpenAIAgent {self.config.model!r} at {self.config.base_url!r}>"

    def __call__(self, turn: Turn) -> AsyncIterator[str]:
        return self._reply(turn)

    async def _reply(self, turn: Turn) -> AsyncIterator[str]:
        messages = await self.messages(turn)
        choice = turn.overrides.model
        base_url = choice.base_url if choice and choice.base_url else self.endpoints.configured
        model = choice.name if choice else self.config.model
        try:
            base_url, model = await self._endpoint(choice)
            async with self._clients.use(base_url) as client:
                async for text in _stream(client, model, messages, turn):
                    yield text
        except (OpenAIError, EndpointRefused, EmptyCompletion) as error:
            raise self._failed(base_url, model, error) from error

    def _failed(self, base_url: str, model: str, error: Exception) -> EndpointFailed:
        """``error`` from ``base_url`` as the turn fails with it: its trouble told in words
        only if ``base_url`` is the configured endpoint."""
        found = trouble_of(error, model)
        configured = base_url == self.endpoints.configured
        where = redact_urls(base_url) + ("" if configured else " (chosen in the chat)")
        what = found.value.removeprefix("the model endpoint ")
        cause = clipped(" ".join(f"{type(error).__name__}: {error}".split()), CAUSE_SHOWN)
        detail = f"the model endpoint {where} {what}: {cause}"
        return EndpointFailed(found if configured else EndpointTrouble.FAILED, detail)

    async def messages(self, turn: Turn) -> list[ChatCompletionMessageParam]:
        """The history of ``turn``'s conversation, then its context and its input."""
        history: list[ChatCompletionMessageParam] = []
        if self._store is not None and self.config.history > 0:
            entries = await self._store.transcript(turn.session_key, limit=self.config.history)
            history = [_message(e) for e in entries if e.role in _HISTORY_ROLES]
        overheard: list[ChatCompletionMessageParam] = []
        if turn.context:
            overheard.append({"role": "user", "content": render(turn.context)})
        return [*history, *overheard, user_input(turn.text, turn.attachments)]

    async def _endpoint(self, choice: ModelChoice | None) -> tuple[str, str]:
        """The turn's endpoint and the model name to ask for.

        :raises EndpointRefused: if a chat chose an endpoint the policy does not allow (now).
        """
        base_url = self.endpoints.configured
        if choice is not None and choice.base_url:
            base_url = await self.endpoints.check(choice.base_url)
        return base_url, choice.name if choice else self.config.model

    def _client(self, base_url: str) -> AsyncOpenAI:
        """A client for ``base_url``: with the API key only if it is the configured endpoint."""
        trusted = base_url == self.endpoints.configured
        key = self._api_key if trusted and self._api_key else NO_KEY
        unredirected = DefaultAsyncHttpxClient(follow_redirects=False)
        return AsyncOpenAI(base_url=base_url, api_key=key, http_client=unredirected)

    def open_endpoints(self) -> list[str]:
        """The endpoints with an open client, least recently used first."""
        return self._clients.urls()

    async def aclose(self) -> None:
        """Close every HTTP client this agent opened."""
        await self._clients.aclose()


async def _stream(
    client: AsyncOpenAI, model: str, messages: list[ChatCompletionMessageParam], turn: Turn
) -> AsyncIterator[str]:
    """The text of one streamed completion, until it ends or ``turn`` is interrupted.

    :raises EmptyCompletion: if the endpoint answered without a single completion chunk
        (as any HTTP server that is not a model endpoint does).
    """
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
        received = False
        async for chunk in chunks:
            received = True
            text = delta_text(chunk)
            if text:
                yield text
    if not received and not turn.interrupted.is_set():
        raise EmptyCompletion


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


def user_input(text: str, attachments: Sequence[Attachment]) -> ChatCompletionUserMessageParam:
    """A user message of ``text`` and its ``attachments``: described in the text, and each
    image with a public http(s) URL as an ``image_url`` part after it (a ``private``
    one would need the platform's token, which the model's provider never gets)."""
    if not attachments:
        return {"role": "user", "content": text}
    described = with_attachments(text, attachments)
    urls = [a.ref for a in attachments if a.kind is AttachmentKind.IMAGE and a.is_public_url]
    if not urls:
        return {"role": "user", "content": described}
    parts: list[ChatCompletionContentPartParam] = [{"type": "text", "text": described}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return {"role": "user", "content": parts}


def with_attachments(text: str, attachments: Sequence[Attachment]) -> str:
    """``text``, then ``[2 attachments: …]`` on a line of its own ("" text: that line alone)."""
    line = f"[{summary(attachments)}]"
    return f"{text}\n{line}" if text else line


def _message(entry: TranscriptEntry) -> ChatCompletionMessageParam:
    if entry.role == "assistant":
        return {"role": "assistant", "content": entry.content}
    if entry.attachments:
        return {"role": "user", "content": with_attachments(entry.content, entry.attachments)}
    return {"role": "user", "content": entry.content}


__all__ = [
    "CLIENT_CACHE_SIZE",
    "EndpointFailed",
    "EndpointTrouble",
    "OpenAIAgent",
    "TranscriptSource",
    "request_options",
    "upstream_session",
    "user_input",
    "with_attachments",
]
