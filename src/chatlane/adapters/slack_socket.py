"""Slack's Socket Mode: events and button presses over a WebSocket the app opens.

The connection is slack-sdk's :class:`~slack_sdk.socket_mode.aiohttp.SocketModeClient`
(on aiohttp): it asks ``apps.connections.open``, with the app-level token, for a
``wss://`` URL, connects to it, pings, and opens a new connection when one drops
or Slack sends a ``disconnect`` envelope. What stays true:

* The start asks for the first URL itself (:func:`open_url`), so an app token
  Slack rejects, or a Web API that fails, stops the start with a one-line
  :class:`~chatlane.errors.ConfigError` (slack-sdk alone would retry for
  ever); a first connection that is not open within :data:`START_WAIT`
  seconds stops it too.
* An ``events_api`` envelope's payload goes to
  :meth:`~chatlane.adapters.slack_events.Intake.event` and an ``interactive``
  one's to :meth:`~chatlane.adapters.slack_events.Intake.interaction`: the
  same handling as the Request URLs', a retried event dropped by its
  ``event_id``. Other types (slash commands …) are ignored.
* Every envelope is acknowledged by its ``envelope_id`` once the intake holds
  what it carries (accepted by chatlane, refused or ignored), at most
  :data:`~chatlane.adapters.slack_events.ANSWER_WITHIN` seconds after it
  arrived — before any turn runs. So Slack sends again only what a process
  did not take; an acknowledgement that cannot be sent is logged, and the
  copy Slack sends is acknowledged once the first copy is held, and not
  handed on again. An envelope that arrives while the connection closes is
  not acknowledged: Slack sends it again.
* A ``disconnect`` envelope is logged with its reason; slack-sdk then opens a
  new connection.
* :meth:`SocketMode.aclose` stops the envelopes being handled, closes the
  WebSocket and waits until the client's tasks ended.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
from slack_sdk.socket_mode.aiohttp import SocketModeClient
from slack_sdk.socket_mode.async_client import AsyncBaseSocketModeClient
from slack_sdk.socket_mode.request import SocketModeRequest
from slack_sdk.socket_mode.response import SocketModeResponse
from slack_sdk.web.async_client import AsyncWebClient

from chatlane.adapters.slack_delivery import checked
from chatlane.adapters.slack_events import Intake
from chatlane.errors import ConfigError

__all__ = ["START_WAIT", "SocketMode", "open_url"]

log = logging.getLogger("chatlane.adapters.slack")

START_WAIT = 30.0
"""Seconds the start waits for the first connection to open."""


async def open_url(web_client: AsyncWebClient, app_token: str, api_url: str) -> str:
    """A WebSocket URL from ``apps.connections.open``: the check of the app token at start.

    :raises ConfigError: the Web API rejected the token, failed, could not be
        reached, or named no ``ws(s)://`` URL.
    """
    opened = await checked(
        web_client.apps_connections_open(app_token=app_token), api_url, "app token"
    )
    url = opened.get("url")
    if not isinstance(url, str) or not url.startswith(("wss://", "ws://")):
        message = f"the Slack Web API at {api_url} named no WebSocket URL (apps.connections.open)"
        raise ConfigError(message)
    return url


class SocketMode:
    """The app's Socket Mode connection: envelopes given to ``intake``, then acknowledged."""

    def __init__(self, intake: Intake) -> None:
        self._intake = intake
        self._client: SocketModeClient | None = None
        self._handling: set[asyncio.Task[Any]] = set()
        self._closing = False

    async def open(self, web_client: AsyncWebClient, app_token: str, api_url: str) -> None:
        """Connect with ``app_token``, asking the Web API of ``web_client`` for the URL.

        :raises ConfigError: see :func:`open_url`, or the first connection did not
            open within :data:`START_WAIT` seconds.
        """
        url = await open_url(web_client, app_token, api_url)
        client = SocketModeClient(app_token, web_client=web_client, on_message_listeners=[_heard])
        client.socket_mode_request_listeners.append(self._on_request)
        client.wss_uri = url  # connect() asks for a URL only when it has none
        self._client = client
        try:
            async with asyncio.timeout(START_WAIT):
                await client.connect()  # type: ignore[no-untyped-call]  # slack-sdk: unannotated
        except TimeoutError:
            await self.aclose()
            raise ConfigError(
                f"the Slack Socket Mode WebSocket (from apps.connections.open at {api_url}) "
                f"did not open within {START_WAIT:g} s"
            ) from None

    async def _on_request(
        self, client: AsyncBaseSocketModeClient, request: SocketModeRequest
    ) -> None:
        """Hand on what ``request`` carries, then acknowledge it (see the module docstring).

        Runs in a task of slack-sdk's own for each envelope, started in arrival order.
        """
        task = asyncio.current_task()
        if self._closing or task is None:
            return
        self._handling.add(task)
        try:
            if request.type == "events_api":
                await self._intake.event(request.payload)
            elif request.type == "interactive":
                await self._intake.interaction(request.payload)
            await _acknowledge(client, request.envelope_id)
        finally:
            self._handling.discard(task)

    async def aclose(self) -> None:
        """Stop handling envelopes (unacknowledged), close the WebSocket, end the client's tasks."""
        self._closing = True
        client, self._client = self._client, None
        handling = list(self._handling)
        for task in handling:
            task.cancel()
        await asyncio.gather(*handling, return_exceptions=True)
        if client is None:
            return
        await client.close()  # type: ignore[no-untyped-call]  # slack-sdk: unannotated
        tasks = (client.message_processor, client.current_session_monitor, client.message_receiver)
        await asyncio.gather(*(t for t in tasks if t is not None), return_exceptions=True)


async def _acknowledge(client: AsyncBaseSocketModeClient, envelope_id: str) -> None:
    """Tell Slack the envelope arrived; a failure is logged (Slack sends it again)."""
    try:
        await client.send_socket_mode_response(SocketModeResponse(envelope_id=envelope_id))
    except (ConnectionError, aiohttp.ClientError) as error:
        log.warning("slack envelope %s could not be acknowledged: %s", envelope_id, error)


async def _heard(message: aiohttp.WSMessage) -> None:
    """Log why Slack asks for a new connection (a ``disconnect`` envelope); slack-sdk opens it."""
    data = message.data
    if not isinstance(data, str) or not data.startswith("{"):
        return
    try:
        envelope = json.loads(data)
    except (ValueError, RecursionError):
        return
    if not isinstance(envelope, dict) or envelope.get("type") != "disconnect":
        return
    reason = str(envelope.get("reason", ""))
    if reason == "link_disabled":
        log.warning("Slack turned Socket Mode off for the app (link_disabled): turn it on again")
    else:
        log.info("slack asks for a new Socket Mode connection (%s)", reason or "no reason given")
