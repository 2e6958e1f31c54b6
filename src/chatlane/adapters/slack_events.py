"""What Slack sends the app, however it arrives: checked, answered, then handled in order.

Slack reaches the app by its Request URLs (the Events API over HTTP,
:class:`Inbox`) or by Socket Mode (:mod:`~chatlane.adapters.slack_socket`);
both hand what they receive to one :class:`Intake`. What stays true:

* An event (the ``event`` of an ``event_callback``) and a button press are
  handled by the same code whichever way they came (:meth:`Intake.event`,
  :meth:`Intake.interaction`), and handed on once: a retry of an event seen
  before (its ``event_id``) is not handed on again; nor is a repeated button
  press. A copy is answered only once the first copy's job is done (or after
  :data:`ANSWER_WITHIN` seconds, as any request), so Slack never has its
  answer while the message it carries is not held yet; if that job failed,
  the copy is handed on as if it were the first (:class:`Jobs`).
* What they ask for runs in the background (:class:`Lanes`): in arrival order
  within one conversation, and in parallel across conversations. Slack is
  answered once that is done — the message accepted by chatlane (durably
  queued, or refused), or ignored — or after :data:`ANSWER_WITHIN` seconds,
  whichever comes first (Slack wants its answer within three). So a process
  that dies before chatlane holds the message has not answered, and Slack
  sends the event again.
* A request to a Request URL is handled only if its signature is Slack's:
  ``X-Slack-Signature`` is the HMAC-SHA256 of ``v0:<timestamp>:<body>`` with
  the signing secret, and ``X-Slack-Request-Timestamp`` is within five
  minutes of this host's clock (slack-sdk's
  :class:`~slack_sdk.signature.SignatureVerifier`). A missing, malformed,
  wrong or stale one gets 401, never an exception. A body over
  :data:`MAX_BODY` bytes is refused with 413 before it is read whole.
  ``url_verification`` is answered with its challenge.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Hashable, Mapping
from typing import Any

from slack_sdk.signature import SignatureVerifier
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Route

from chatlane.adapters.lanes import Job, Lanes
from chatlane.adapters.slack_wire import Press, read_interaction, read_press
from chatlane.errors import ChatlaneError

__all__ = [
    "EVENTS_PATH",
    "INTERACTIONS_PATH",
    "MAX_BODY",
    "Inbox",
    "Intake",
    "Lanes",
    "RequestRefused",
    "json_object",
    "read_body",
    "signed_by_slack",
]

log = logging.getLogger("chatlane.adapters.slack")

EVENTS_PATH = "/slack/events"
INTERACTIONS_PATH = "/slack/interactions"
MAX_BODY = 1 << 20
"""Largest request body read (1 MiB); Slack's events and interactions are far smaller."""
ANSWER_WITHIN = 2.0
"""Most seconds Slack's answer (a request's response, an envelope's acknowledgement)
waits for what Slack asks for to be handled; Slack is answered then anyway."""
SEEN_KEPT = 8192
"""Event ids and presses remembered with their jobs, so a retry or a repeat is not handed on
again."""

OnEvent = Callable[[dict[str, Any]], Job]
OnPress = Callable[[Press], Job]


class Intake:
    """What Slack sends, from either way in: handed on in order, a copy of what was handed on
    before not again (it waits for the first copy's job instead).

    :param on_event: what an event (the ``event`` of an ``event_callback``) asks for.
    :param on_press: what a press of a button asks for.
    """

    def __init__(self, on_event: OnEvent, on_press: OnPress) -> None:
        self._on_event = on_event
        self._on_press = on_press
        self._jobs = Jobs(SEEN_KEPT)
        self.lanes = Lanes("Slack")

    async def event(self, envelope: Mapping[str, Any]) -> None:
        """Hand on the event of ``envelope`` (an ``event_callback``, as Slack wraps every
        event) unless a copy of it was handed on before; return once it (or that copy) is
        handled, or after :data:`ANSWER_WITHIN` seconds. Anything else is ignored."""
        event = envelope.get("event")
        if envelope.get("type") != "event_callback" or not isinstance(event, dict):
            return
        event_id = envelope.get("event_id")
        key = ("event", event_id) if isinstance(event_id, str) else None
        lane = str(event.get("channel", ""))
        await _within(self._handing_on(key, lane, lambda: self._on_event(event)))

    async def interaction(self, payload: Mapping[str, Any]) -> None:
        """Hand on the button press ``payload`` carries unless it was handed on before;
        return once it (or that copy) is handled, or after :data:`ANSWER_WITHIN` seconds.
        Anything else is ignored."""
        press = read_press(payload)
        if press is not None:
            key = ("press", press.user, press.action_ts)
            await _within(self._handing_on(key, press.channel, lambda: self._on_press(press)))

    async def _handing_on(self, key: Hashable | None, lane: str, job: Callable[[], Job]) -> None:
        """Run ``job`` in ``lane`` and wait for it to end; unless a copy (the same ``key``)
        was handed on and did not fail: then wait for that copy's job instead."""
        earlier = self._jobs.of(key)
        while earlier is not None and not earlier.done():
            await asyncio.wait([earlier])
            earlier = self._jobs.of(key)  # None if it failed
        if earlier is not None:
            return
        running = self.lanes.run(lane, job())
        self._jobs.note(key, running)
        await asyncio.wait([running])

    async def aclose(self, within: float = 0.0) -> None:
        """Wait up to ``within`` seconds for what earlier events asked for (and what is
        handed on meanwhile) to be done, then cancel what is not and wait until it ended;
        what is cancelled after such a wait is logged."""
        await self.lanes.aclose(within)


class Inbox:
    """The app's Request URLs: Slack's signed requests checked, answered, given to ``intake``."""

    def __init__(self, intake: Intake) -> None:
        self._intake = intake
        self._verifier: SignatureVerifier | None = None

    def routes(self) -> list[BaseRoute]:
        return [
            Route(EVENTS_PATH, self._events, methods=["POST"]),
            Route(INTERACTIONS_PATH, self._interactions, methods=["POST"]),
        ]

    def open(self, signing_secret: str) -> None:
        """Take requests signed with ``signing_secret`` from now on (before: 503)."""
        self._verifier = SignatureVerifier(signing_secret)

    def close(self) -> None:
        """Refuse requests from now on (503)."""
        self._verifier = None

    async def _events(self, request: Request) -> Response:
        try:
            envelope = json_object(await self._signed_body(request))
        except RequestRefused as refused:
            return PlainTextResponse(str(refused), refused.status)
        if envelope.get("type") == "url_verification":
            return JSONResponse({"challenge": str(envelope.get("challenge", ""))})
        await self._intake.event(envelope)
        return Response(status_code=200)

    async def _interactions(self, request: Request) -> Response:
        try:
            payload = read_interaction(await self._signed_body(request))
        except RequestRefused as refused:
            return PlainTextResponse(str(refused), refused.status)
        except ValueError as error:
            return PlainTextResponse(f"unreadable interaction: {error}", 400)
        await self._intake.interaction(payload)
        return Response(status_code=200)

    async def _signed_body(self, request: Request) -> bytes:
        """The body of a request Slack signed.

        :raises RequestRefused: 503 while closed, 413 for a large body, 401 for
            a missing, wrong or stale signature.
        """
        verifier = self._verifier
        if verifier is None:
            raise RequestRefused(503, "slack is not running")
        body = await read_body(request)
        if not signed_by_slack(verifier, body, request.headers):
            log.info("refused a request to %s: no valid Slack signature", request.url.path)
            raise RequestRefused(401, "invalid or stale Slack signature")
        return body


async def _within(handing_on: Coroutine[Any, Any, None]) -> None:
    """Wait for ``handing_on`` at most :data:`ANSWER_WITHIN` seconds; the job it waits for
    goes on after that, and its failure is the lane's to log, not the request's."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(ANSWER_WITHIN):
            await handing_on


class Jobs:
    """The job that handles each event or press, for the ``kept`` ones handed on last.

    A job that failed (raised, or was cancelled) counts as none: a copy of what it
    handled is handed on again.
    """

    def __init__(self, kept: int) -> None:
        self._kept = kept
        self._jobs: OrderedDict[Hashable, asyncio.Task[None]] = OrderedDict()

    def of(self, key: Hashable | None) -> asyncio.Task[None] | None:
        """The job that handles or handled ``key`` without failing, if any (never for
        None: what has no key is never a copy)."""
        job = None if key is None else self._jobs.get(key)
        return None if job is None or _failed(job) else job

    def note(self, key: Hashable | None, job: asyncio.Task[None]) -> None:
        """``job`` handles ``key`` (as the newest); the oldest are forgotten past ``kept``."""
        if key is None:
            return
        self._jobs.pop(key, None)
        self._jobs[key] = job
        while len(self._jobs) > self._kept:
            self._jobs.popitem(last=False)


def _failed(job: asyncio.Task[None]) -> bool:
    """Whether ``job`` ended without doing its work: cancelled, or raised."""
    return job.done() and (job.cancelled() or job.exception() is not None)


class RequestRefused(ChatlaneError):
    """A request to a Slack route that is not handled, and the HTTP status that says why."""

    def __init__(self, status: int, reason: str) -> None:
        self.status = status
        super().__init__(reason)


async def read_body(request: Request) -> bytes:
    """The request's body, at most :data:`MAX_BODY` bytes.

    :raises RequestRefused: (413) for a larger one, (400) if the client left
        before sending all of it.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise RequestRefused(413, f"the body is larger than {MAX_BODY} bytes")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY:
                raise RequestRefused(413, f"the body is larger than {MAX_BODY} bytes")
    except ClientDisconnect:
        raise RequestRefused(400, "the client left before sending the body") from None
    return bytes(body)


def json_object(body: bytes) -> dict[str, Any]:
    """``body`` read as a JSON object.

    :raises RequestRefused: (400) for anything else.
    """
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # nested past the parser's depth: no event
        value = None
    if not isinstance(value, dict):
        raise RequestRefused(400, "the body is not a JSON object")
    return value


def signed_by_slack(verifier: SignatureVerifier, body: bytes, headers: Mapping[str, str]) -> bool:
    """Whether ``body`` carries a valid, fresh signature (see the module docstring)."""
    timestamp = headers.get("x-slack-request-timestamp")
    signature = headers.get("x-slack-signature")
    try:
        return verifier.is_valid(body, timestamp, signature)
    except ValueError:  # a timestamp that is no number, a body that is no UTF-8
        return False
    except TypeError:  # a signature of other than ASCII, which no digest compares with
        return False
