"""The OpenAI-compatible HTTP API: ``POST /v1/chat/completions`` and ``GET /v1/models``.

What stays true:

* The session is named by the ``X-Chatlane-Session`` header, else the
  request's ``user`` field; the gateway keeps the history, so only the last
  user message of ``messages`` is sent to it. ``X-Chatlane-Busy`` asks for
  one busy policy for this request's message, over the session's.
* Each request's message gets its own id and a waiter registered under that
  id *before* it is dispatched, and the response is the answer of the turn that
  ran that message — never an acknowledgement, never another request's reply.
* Every request is answered: with the turn's reply — or, when another
  process adopted and answered its message, the answer committed there; with
  a notice when its turn failed, was interrupted or stopped, or its message
  was dropped (never while the store still holds it queued); with
  409 (``reject`` policy, also when the session turns out busy in another
  process), 429 (queue full), 403 (not on the allowlist), 504
  (no progress for the ceiling) or 503 (shutting down). Bad input gets a 400
  (``param`` naming the field), 413 or 415 JSON error, a model that
  ``GET /v1/models`` does not list a 404 ``model_not_found``, a bad token
  401, and any token from a client address blocked for wrong tokens 429
  (code ``too_many_wrong_tokens``, with ``Retry-After``) — never a 500.
* No web page can drive a session: a chat completion must be sent as
  ``application/json`` (which a browser never posts cross-site without a CORS
  preflight, and none is granted), and a request whose ``Origin`` is not the
  gateway's own gets 403.
* When an access token is configured every route needs it as a bearer token,
  compared in constant time against the :class:`~chatlane.access.AccessToken`
  given (``chatlane serve`` gives the hub's, so a reload reaches the API too).
  With ``[api.clients]`` every route needs a client's token instead, and a
  client names only its own sessions (:mod:`chatlane.adapters.api_clients`).
  Wrong tokens, the access token's or a client's, count against the client
  address with the access token's count (:class:`~chatlane.access.GuessLimiter`).
* A message refused by a process-wide limit gets 503, code ``gateway_full``.
* A request's completion id (``chatcmpl-…``) is its message's
  (:mod:`chatlane.adapters.api_ids`): the first event of a stream carries it,
  and every answer after dispatch — a 504 or 503 too — names it in the
  ``X-Chatlane-Completion-Id`` header. ``GET /v1/chat/completions/{id}``
  returns the stored answer to the client that sent the request, from any
  process sharing the store; anyone else gets 404.
* Requests with one ``Idempotency-Key`` (from one client, to one session)
  name one message: a retry gets the answer already committed, waits beside
  the first request if that one still waits here, and is otherwise dispatched
  under the same id, so the store holds it once and its turn replays an
  answer committed meanwhile instead of running the agent again.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from starlette.requests import HTTPConnection, Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from chatlane.access import AccessToken, TooManyGuesses, bearer_token, client_address
from chatlane.adapters.api_clients import ApiClient, ApiClients
from chatlane.adapters.api_ids import (
    check_key,
    completion_id,
    keyed_message_id,
    message_of,
    new_message_id,
)
from chatlane.adapters.api_waiters import EventKind, Ticker, Waiter, WaiterEvent
from chatlane.adapters.api_wire import (
    COMPLETION_ID_HEADER,
    ApiRequestError,
    AsgiEndpoint,
    ChatRequest,
    ChunkEvents,
    EventStream,
    busy_header,
    check_origin,
    check_origin_of,
    completion_body,
    completion_id_header,
    decode_json,
    error_response,
    first_headers,
    invalid,
    json_response,
    model_entry,
    model_list,
    model_not_found,
    parse_chat_request,
    receive_body,
    require_json_type,
    send_json_body,
    sse_comment,
    sse_data,
    unrouted_error,
)
from chatlane.config import Config
from chatlane.errors import (
    ChatlaneError,
    GatewayFull,
    MessageTooLarge,
    TakenElsewhere,
    shown_to_users,
)
from chatlane.gateway import DispatchResult
from chatlane.identity import ChatType, SessionSource
from chatlane.runtime.busy import BusyOutcome
from chatlane.runtime.outcomes import MessageOutcome
from chatlane.secrets import Secrets, TokenSource, read_client_tokens
from chatlane.stores.records import AnsweredMark
from chatlane.types import InboundMessage, Outbound, SessionKey

if TYPE_CHECKING:
    from chatlane.hub import Hub

log = logging.getLogger("chatlane.adapters.api")

SESSION_HEADER = "x-chatlane-session"
_EVERY_METHOD = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
Disconnected = Callable[[], Awaitable[bool]]


class ApiAdapter:
    """The ``api`` platform: OpenAI-compatible chat completions over HTTP.

    :param config: the gateway configuration (token, timeouts, agent).
    :param wait_timeout: seconds a request may wait without progress in its
        session before it gets 504; default ``turn_timeout + interrupt_grace + 30``.
    :param tick: how often a quiet request checks its ceiling and whether the
        gateway is closing (its answer itself arrives as its message's outcome).
    :param keepalive: seconds of silence after which a stream gets an SSE comment.
    :param access: the token to check (the hub's, so a reload reaches this adapter).
    :param secrets: read at start, for the token (without ``access``) and the
        ``[api.clients]`` tokens; without them, both are read here (:mod:`chatlane.secrets`).
    """

    platform = "api"

    def __init__(
        self,
        config: Config,
        *,
        wait_timeout: float | None = None,
        tick: float = 0.2,
        keepalive: float = 15.0,
        access: AccessToken | None = None,
        secrets: Secrets | None = None,
    ) -> None:
        if access is None:
            source = secrets.access_token if secrets else TokenSource.read(config.server.token)
            access = AccessToken(source)
        self._access = access
        tokens = secrets.api_client_tokens if secrets else read_client_tokens(config)
        self.clients = ApiClients.from_config(config, tokens)
        self._models = _model_names(config)
        self._served = frozenset(self._models)
        self.wait_timeout = _default_ceiling(config) if wait_timeout is None else wait_timeout
        self.tick = tick
        self.keepalive = keepalive
        self._waiters: dict[str, list[Waiter]] = {}
        """The requests waiting, by their message's id (retries of one request share it)."""
        self._ticker = Ticker(self._all_waiters, tick)
        self._hub: Hub | None = None
        self._closed = False

    @property
    def waiting(self) -> int:
        """How many requests wait for an answer right now."""
        return sum(len(waiters) for waiters in self._waiters.values())

    def _all_waiters(self) -> list[Waiter]:
        return [waiter for waiters in self._waiters.values() for waiter in waiters]

    def routes(self) -> Sequence[BaseRoute]:
        return [
            Route("/v1/chat/completions", AsgiEndpoint(self.chat_completions), methods=["POST"]),
            Route("/v1/chat/completions/{completion}", self.stored_completion, methods=["GET"]),
            Route(
                "/v1/chat/completions/{completion}/cancel", self.cancel_waiting, methods=["POST"]
            ),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/{rest:path}", self.unrouted, methods=_EVERY_METHOD),
        ]

    async def start(self, hub: Hub) -> None:
        self._hub = hub

    async def deliver(self, outbound: Outbound) -> None:
        """Hand ``outbound`` to the requests waiting for the messages it answers."""
        taken = False
        for message_id in outbound.in_reply_to:
            for waiter in self._waiters.get(message_id, ()):
                waiter.take(outbound)
                taken = True
        if not taken:
            log.debug("no request waits for %s to %s; dropped", outbound.kind, outbound.session_key)

    def outcome(self, outcome: MessageOutcome) -> None:
        """Finish the requests waiting for ``outcome``'s message, if any do."""
        for waiter in self._waiters.get(outcome.message_id, ()):
            waiter.end(outcome)

    async def aclose(self) -> None:
        """Answer every waiting request with 503; their messages stay queued in the store."""
        self._closed = True
        for waiter in self._all_waiters():
            waiter.push(WaiterEvent(EventKind.SHUTDOWN))

    # -- routes ------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        try:
            self._authenticate(request)
            check_origin(request)
        except ApiRequestError as error:
            return error_response(error)
        return json_response(model_list(self._models))

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        try:
            self._authenticate(request)
            check_origin(request)
            if name not in self._served:
                raise model_not_found(name, self._models)
        except ApiRequestError as error:
            return error_response(error)
        return json_response(model_entry(name))

    async def unrouted(self, request: Request) -> Response:
        """Any other ``/v1`` request: an OpenAI-shaped 404, or 405 for a known path."""
        try:
            self._authenticate(request)
            check_origin(request)
            raise unrouted_error(request.method, request.url.path)
        except ApiRequestError as error:
            return error_response(error)

    async def chat_completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/chat/completions``, as an ASGI app: the answer is sent as it comes."""
        request = Request(scope, receive)
        try:
            chat, client = await self._read(scope, receive)
            waiter = await self._submit(chat, client)
        except ApiRequestError as error:
            await error_response(error)(scope, receive, send)
            return
        response_id = completion_id(waiter.message_id)
        named = (completion_id_header(response_id),)
        if chat.stream:
            try:
                await self._stream(waiter, chat, response_id, request.is_disconnected, send)
            finally:
                self._forget(waiter)
            return
        try:
            event = await self._last_event(waiter, request.is_disconnected)
        finally:
            self._forget(waiter)
        if event is None:
            await Response(status_code=499)(scope, receive, send)
        elif event.kind is EventKind.FINAL:
            await send_json_body(send, completion_body(response_id, chat.model, event.text), named)
        else:
            response = error_response(_ending_error(event, chat.session))
            response.headers[COMPLETION_ID_HEADER] = response_id  # it may still be answered
            await response(scope, receive, send)

    async def stored_completion(self, request: Request) -> Response:
        """``GET /v1/chat/completions/{id}``: a completion answered before, from any process.

        Only to the client whose request it answered; anyone else — and anyone
        asking before it was answered, or after the store forgot the answer —
        gets 404.
        """
        wanted = request.path_params["completion"]
        try:
            client = self._authenticate(request)
            check_origin(request)
            message_id = message_of(wanted, "" if client is None else client.name)
            answer = None if message_id is None else await self._earlier_answer(message_id)
            if answer is None:
                message = "no completion with that id is stored for you"
                raise ApiRequestError(404, message, "invalid_request_error", "completion_not_found")
        except ApiRequestError as error:
            return error_response(error)
        body = completion_body(wanted, self._models[0], answer)  # the gateway's own model name
        return Response(body, media_type="application/json")

    async def cancel_waiting(self, request: Request) -> Response:
        """``POST /v1/chat/completions/{id}/cancel``: take a request that still waits in
        its session's queue out of it; the request itself is then answered as cancelled.

        Only the client that sent the request may cancel it, in the gateway process it
        waits on. A request whose turn has started is not cancelled (409: ``/stop``
        stops a turn); one that waits nowhere here is 404.
        """
        wanted = request.path_params["completion"]
        try:
            client = self._authenticate(request)
            check_origin(request)
            message_id = message_of(wanted, "" if client is None else client.name)
            waiters = self._waiters.get(message_id or "")
            if message_id is None or not waiters:
                message = "no request with that id waits in this gateway for you"
                raise ApiRequestError(404, message, "invalid_request_error", "completion_not_found")
            await self._take_out(waiters[0].session_key, message_id)
        except ApiRequestError as error:
            return error_response(error)
        return json_response({"id": wanted, "object": "chat.completion.cancellation"})

    async def _take_out(self, key: SessionKey, message_id: str) -> None:
        """:raises ApiRequestError: unless ``message_id`` was taken out of ``key``'s queue."""
        hub = self._hub
        if hub is None:
            raise ApiRequestError(503, "the gateway is not running", "service_unavailable")
        try:
            taken = await hub.gateway.engine.cancel_waiting(key, message_id)
        except TakenElsewhere:
            message = "the turn another gateway process runs took it in first; it is answered there"
            error_type, code = "invalid_request_error", "completion_running"
            raise ApiRequestError(409, message, error_type, code) from None
        except ChatlaneError as error:
            log.warning("could not cancel %s: %s", message_id, error)
            message = f"the gateway could not cancel it: {shown_to_users(error)}; it still waits"
            raise ApiRequestError(503, message, "server_error") from None
        if taken is None:
            message = "its turn has started (stop it with /stop in its session)"
            raise ApiRequestError(409, message, "invalid_request_error", "completion_running")

    async def _read(self, scope: Scope, receive: Receive) -> tuple[ChatRequest, ApiClient | None]:
        """The checked request, and the client that sent it (with ``[api.clients]``).

        The checks of every other route, in the same order, on headers read in one pass.

        :raises ApiRequestError: for a bad token (401), a foreign origin (403), a
            body not sent as JSON (415), too large (413) or unreadable (400), or
            a session the client may not name (403).
        """
        headers = first_headers(scope)
        authorization = headers.get(b"authorization", b"").decode("latin-1")
        client = self._authenticated(authorization, client_address(HTTPConnection(scope)))
        origin = headers.get(b"origin")
        if origin is not None:
            host = headers.get(b"host", b"").decode("latin-1")
            check_origin_of(origin.decode("latin-1"), scope.get("scheme", "http"), host)
        require_json_type(headers.get(b"content-type", b"").decode("latin-1"))
        data = decode_json(await receive_body(receive, headers.get(b"content-length", b"")))
        chat = parse_chat_request(data, _session_header(headers.get(b"x-chatlane-session")))
        if chat.model not in self._served:
            raise model_not_found(chat.model, self._models)
        busy = headers.get(b"x-chatlane-busy")
        if busy is not None:
            chat = dataclasses.replace(chat, busy_policy=busy_header(busy))
        key = headers.get(b"idempotency-key")
        if key is not None:
            chat = dataclasses.replace(chat, idempotency_key=_idempotency_key(key))
        if client is not None:
            client.check_session(chat.session)
        return chat, client

    def _authenticate(self, request: Request) -> ApiClient | None:
        """The client the request's token names (``None`` without ``[api.clients]``).

        :raises ApiRequestError: (401) unless the token is a client's, or without
            clients the access token (when one is set); (429) for any token while the
            request's client address is blocked for wrong tokens.
        """
        authorization = request.headers.get("authorization", "")
        return self._authenticated(authorization, client_address(request))

    def _authenticated(self, authorization: str, address: str) -> ApiClient | None:
        """:meth:`_authenticate`, given the ``Authorization`` header (``""`` if absent) and
        the client address it came from."""
        try:
            if self.clients.enabled:
                return self._client(authorization, address)
            if not self._access.check_authorization(authorization, address):
                raise _unauthenticated()
        except TooManyGuesses as blocked:
            raise _too_many_guesses(blocked) from None
        return None

    def _client(self, authorization: str, address: str) -> ApiClient:
        """The client whose token the ``Authorization`` header carries (clients are configured);
        a wrong token counts against ``address``.

        :raises ApiRequestError: (401) if the token is none of theirs.
        :raises TooManyGuesses: for a token sent while ``address`` is blocked.
        """
        given = bearer_token(authorization)
        if given is None:
            raise _unauthenticated()  # nothing presented, nothing guessed
        client = self._access.guesses.judge(address, given, lambda: self.clients.identify(given))
        if client is None:
            raise _unauthenticated()
        return client

    # -- dispatch ------------------------------------------------------------------------

    async def _submit(self, chat: ChatRequest, client: ApiClient | None) -> Waiter:
        """Register a waiter, then dispatch its message (sent by ``client``, when there is one).

        :raises ApiRequestError: if the message will not run (403, 409, 429, 503).
        """
        hub = self._hub
        if hub is None or self._closed:
            raise ApiRequestError(503, "the gateway is not running", "service_unavailable")
        sender = chat.session if client is None else client.name
        source = SessionSource("api", chat_id=chat.session, user_id=sender, chat_type=ChatType.DM)
        message_id = _message_id(chat, client)
        if chat.idempotency_key:
            retried = await self._retried(message_id, chat.stream)
            if retried is not None:
                return retried
        message = InboundMessage(
            source,
            chat.text,
            id=message_id,
            busy_policy=chat.busy_policy,
            idempotent=bool(chat.idempotency_key),
            whole_reply=not chat.stream,
        )
        waiter = self._register(Waiter(message.id, stream=chat.stream))
        try:
            result = await _dispatch(hub, message, chat.session)
        except BaseException:
            self._forget(waiter)
            raise
        waiter.session_key = result.session_key
        return waiter

    def _register(self, waiter: Waiter) -> Waiter:
        self._waiters.setdefault(waiter.message_id, []).append(waiter)
        self._ticker.start()
        return waiter

    def _forget(self, waiter: Waiter) -> None:
        waiters = self._waiters.get(waiter.message_id, [])
        if waiter in waiters:
            waiters.remove(waiter)
        if not waiters:
            self._waiters.pop(waiter.message_id, None)

    async def _retried(self, message_id: str, stream: bool) -> Waiter | None:
        """A retry's waiter, if its request was seen before: ``None`` if it must be dispatched.

        Answered before (here or in any process sharing the store): a waiter
        holding that answer — or, if its turn failed, the notice its sender got, as
        the failed outcome gives it (not marked as the answer). Still waited for
        here: a waiter beside the first request's, ended by the same outcome.
        Otherwise the message is dispatched under the same id: the store keeps one
        record of it, and its turn replays an answer committed meanwhile instead of running again.

        :raises ApiRequestError: (503) the store could not say.
        """
        mark = await self._earlier_mark(message_id)
        if mark is not None:
            waiter = Waiter(message_id, stream=stream)
            waiter.push(WaiterEvent(EventKind.FINAL, mark.answer, answer=not mark.failure))
            return waiter
        first = self._waiters.get(message_id)
        if not first:
            return None
        waiter = self._register(Waiter(message_id, stream=stream))
        waiter.session_key = first[0].session_key
        return waiter

    async def _earlier_answer(self, message_id: str) -> str | None:
        """The answer (or failure notice) the store holds for ``message_id``, if any.

        :raises ApiRequestError: (503) the gateway is not running, or its store could not say.
        """
        mark = await self._earlier_mark(message_id)
        return None if mark is None else mark.answer

    async def _earlier_mark(self, message_id: str) -> AnsweredMark | None:
        """The answered mark the store holds for ``message_id``, if any.

        :raises ApiRequestError: (503) the gateway is not running, or its store could not say.
        """
        hub = self._hub
        if hub is None:
            raise ApiRequestError(503, "the gateway is not running", "service_unavailable")
        try:
            return await hub.store.mark(message_id)
        except ChatlaneError as error:
            log.warning("could not read an earlier answer: %s", error)
            message = f"the gateway could not read an earlier answer: {shown_to_users(error)}"
            raise ApiRequestError(503, message, "server_error") from None

    async def _checked(self, waiter: Waiter, disconnected: Disconnected) -> bool:
        """On a tick: end a request whose gateway is closing or whose ceiling passed
        (its last event is then queued); whether its client is gone."""
        hub = self._hub
        if hub is not None and hub.gateway.engine.closed:
            waiter.push(WaiterEvent(EventKind.SHUTDOWN))  # its message stays queued
        elif hub is not None:
            waiter.expire(self.wait_timeout, hub.gateway.engine.last_progress(waiter.session_key))
        if await disconnected():
            log.debug("client gone; no longer waiting for %s", waiter.message_id)
            return True
        return False

    # -- answers --------------------------------------------------------------------------

    async def _last_event(self, waiter: Waiter, disconnected: Disconnected) -> WaiterEvent | None:
        """What a request that does not stream is answered by; ``None`` if its client left.

        Such a waiter queues only its last event, so it wakes for that (or for a tick).
        """
        while True:
            events, ticked = await waiter.wait()
            if events:
                return events[-1]
            if ticked and await self._checked(waiter, disconnected):
                return None

    async def _stream(
        self,
        waiter: Waiter,
        chat: ChatRequest,
        response_id: str,
        disconnected: Disconnected,
        send: Send,
    ) -> None:
        """The streaming answer: chunks as they come, the final rest, then ``[DONE]``.

        What arrived together is sent together, in one write; a comment keeps a
        quiet stream alive after ``keepalive`` seconds.
        """
        chunks = ChunkEvents(response_id, chat.model)
        stream = EventStream(send)
        named = (completion_id_header(response_id),)
        await stream.start(chunks.delta({"role": "assistant", "content": ""}), named)
        streamed = ""
        quiet_until = time.monotonic() + self.keepalive
        while True:
            events, ticked = await waiter.wait()
            data: list[bytes] = []
            for event in events:
                if event.kind is EventKind.CHUNK:
                    streamed += event.text
                    data.append(chunks.content(event.text))
                elif event.kind is EventKind.COMMENT:
                    data.append(sse_comment(event.text))
                else:
                    data += _stream_end(event, streamed, chunks, chat.session)
                    await stream.end(data)
                    return
            if ticked and await self._checked(waiter, disconnected):
                return
            if not data and time.monotonic() >= quiet_until:
                data.append(sse_comment("waiting for the turn"))
            if data:
                quiet_until = time.monotonic() + self.keepalive
                await stream.send(data)


def _unauthenticated() -> ApiRequestError:
    return ApiRequestError(
        401, "missing or invalid bearer token", "authentication_error", "invalid_api_key"
    )


def _too_many_guesses(blocked: TooManyGuesses) -> ApiRequestError:
    """429 ``too_many_wrong_tokens`` with ``Retry-After``, and ``x-should-retry: false``: an
    SDK's own retry (OpenAI's waits out ``Retry-After`` twice, up to two minutes) would only
    hang a call that no token can pass until the wait is over."""
    return ApiRequestError(
        429,
        f"{blocked} (no token from this address is checked meanwhile)",
        "rate_limit_error",
        "too_many_wrong_tokens",
        retry=False,
        retry_after=blocked.seconds,
    )


KEPT_SEPARATOR = "\n\n[The answer above was interrupted; the answer that was kept:]\n\n"
"""Sent between a fenced run's streamed chunks and the different answer the store kept."""


def _stream_end(
    event: WaiterEvent, streamed: str, chunks: ChunkEvents, session: str
) -> list[bytes]:
    """The last events of a stream: the rest of the answer and a stop chunk, or an error."""
    if event.kind is not EventKind.FINAL:
        return [sse_data(_ending_error(event, session).body()), sse_data("[DONE]")]
    rest = _rest(event, streamed)
    out = [chunks.content(rest)] if rest else []
    out.append(chunks.delta({}, "stop"))
    out.append(sse_data("[DONE]"))
    return out


def _rest(event: WaiterEvent, streamed: str) -> str:
    """What is still to be streamed of the final ``event`` after ``streamed``.

    The answer itself when it extends what was streamed; else, for an answer
    the store kept (another run's), a separator and that whole answer — so a
    client that read a fenced run's chunks is told they were not the answer.
    """
    if event.text.startswith(streamed):
        return event.text[len(streamed) :]
    if event.answer:
        return KEPT_SEPARATOR + event.text
    return "\n" + event.text


def _ending_error(event: WaiterEvent, session: str) -> ApiRequestError:
    if event.kind is EventKind.REFUSED:
        refusal = _busy_refusal(_busy_outcome(event.text), session)
        if refusal is not None:
            return refusal
    if event.kind is EventKind.TIMEOUT:
        return ApiRequestError(
            504, "no answer in time; the message may still run", "timeout", "timeout", retry=False
        )
    return ApiRequestError(
        503,
        "the gateway is shutting down; the message stays queued",
        "service_unavailable",
        "service_unavailable",
        retry=False,
    )


async def _dispatch(hub: Hub, message: InboundMessage, session: str) -> DispatchResult:
    """Submit ``message``; return how the gateway took it.

    :raises ApiRequestError: a refused user (403), a busy session (409), a full
        queue (429), a process-wide limit (503, code ``gateway_full``), or a
        gateway that could not take it (503).
    """
    try:
        result = await hub.submit(message)
    except MessageTooLarge as error:
        log.warning("refused: %s", error)
        raise ApiRequestError(
            413, str(error), "invalid_request_error", "message_too_large"
        ) from None
    except GatewayFull as error:
        log.warning("refused: %s", error)
        raise ApiRequestError(503, str(error), "service_unavailable", "gateway_full") from None
    except ChatlaneError as error:
        log.warning("dispatch failed: %s", error)
        told = f"the gateway could not take the message: {shown_to_users(error)}"
        raise ApiRequestError(503, told, "server_error") from None
    if result.refused:
        raise ApiRequestError(
            403, "you are not allowed to use this assistant", "permission_error", "not_allowed"
        )
    refusal = _busy_refusal(result.outcome, session)
    if refusal is not None:
        raise refusal
    return result


def _busy_outcome(reason: str) -> BusyOutcome | None:
    try:
        return BusyOutcome(reason)
    except ValueError:
        return None


def _busy_refusal(outcome: BusyOutcome | None, session: str) -> ApiRequestError | None:
    """409 for a session that rejects messages while busy, 429 for a full queue."""
    if outcome is BusyOutcome.REJECTED:
        return ApiRequestError(
            409,
            f"session {session!r} is busy and its busy policy is reject; the message was not run",
            "session_busy",
            "session_busy",
        )
    if outcome is BusyOutcome.QUEUE_FULL:
        return ApiRequestError(
            429,
            f"session {session!r} has a full queue; the message was not run",
            "queue_full",
            "queue_full",
        )
    return None


def session_header(request: Request) -> str | None:
    """The ``X-Chatlane-Session`` header, read as UTF-8 (HTTP hands it over as Latin-1).

    :raises ApiRequestError: (400) if its bytes are not UTF-8.
    """
    value = request.headers.get(SESSION_HEADER)
    return None if value is None else _session_header(value.encode("latin-1"))


def _session_header(value: bytes | None) -> str | None:
    """:func:`session_header` for the header's bytes (``None`` if absent)."""
    if value is None:
        return None
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise invalid("the X-Chatlane-Session header is not UTF-8") from None


def _message_id(chat: ChatRequest, client: ApiClient | None) -> str:
    """The id of ``chat``'s message: named by its idempotency key, if it has one (see api_ids)."""
    name = "" if client is None else client.name
    if chat.idempotency_key:
        return keyed_message_id(name, chat.session, chat.idempotency_key)
    return new_message_id(name)


def _idempotency_key(value: bytes) -> str:
    """:raises ApiRequestError: (400) unless the header is a valid key (:func:`check_key`)."""
    try:
        return check_key(value)
    except ValueError as error:
        raise invalid(str(error)) from None


def _model_names(config: Config) -> list[str]:
    """What ``model`` may name: ``chatlane``, the ``openai`` agent's model, ``api.models``."""
    names = ["chatlane"]
    if config.agent.name == "openai":
        names.append(config.agent.openai.model)
    names.extend(config.api.models)
    return list(dict.fromkeys(name for name in names if name.strip()))


def _default_ceiling(config: Config) -> float:
    runtime = config.runtime
    return (runtime.turn_timeout or 3600.0) + runtime.interrupt_grace + 30.0


__all__ = ["ApiAdapter"]
