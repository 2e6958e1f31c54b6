"""discord.py's client, pointed at the configured API, its events handed to the adapter.

What stays true:

* Every REST request goes to ``discord.api_url`` (discord.py's own address is
  replaced per request, for this client alone: nothing process-wide changes),
  and the gateway is the one the API names at ``GET /gateway/bot``, as
  Discord asks bots to look it up. Resumes go where the gateway's ``READY``
  said (``resume_gateway_url``), as discord.py does.
* The bot asks for the intents it reads: servers and their channels (to tell
  a thread from a channel), server and DM messages, and — unless
  ``discord.message_content = false`` — the privileged Message Content intent.
* Messages are not cached (chatlane reads each once), and no server's member
  list is requested.
* A 429 asking for at most :data:`RATE_LIMIT_IN_PLACE` seconds is waited out
  in place by discord.py; a longer one is raised as :class:`discord.RateLimited`
  for the delivery ledger to wait out without holding the send.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import discord
from discord.gateway import DiscordWebSocket
from discord.http import HTTPClient, Route

__all__ = ["RATE_LIMIT_IN_PLACE", "Events", "GatewayClient", "RoutedHTTP", "answer_interaction"]

RATE_LIMIT_IN_PLACE = 30.0
"""The longest 429 discord.py waits out in place (the least it allows)."""


class RoutedHTTP(HTTPClient):
    """discord.py's HTTP client, sending to ``api_url`` and connecting to the gateway the
    API names."""

    def __init__(self, api_url: str, loop: Any, **options: Any) -> None:
        super().__init__(loop, **options)
        self.api_url = api_url.rstrip("/")
        self.gateway_url: str | None = None
        """The gateway ``GET /gateway/bot`` named, once logged in."""

    async def request(
        self,
        route: Route,
        *,
        files: Sequence[discord.File] | None = None,
        form: Iterable[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> Any:
        if route.url.startswith(Route.BASE):
            route.url = self.api_url + route.url[len(Route.BASE) :]
        return await super().request(route, files=files, form=form, **kwargs)

    async def static_login(self, token: str) -> Any:
        """Check ``token`` (``GET /users/@me``), then ask where the gateway is.

        :raises discord.LoginFailure: the token was rejected.
        :raises discord.GatewayNotFound: the API did not say where the gateway is.
        """
        user = await super().static_login(token)
        _, url, _ = await self.get_bot_gateway()
        self.gateway_url = str(url).rstrip("/") + "/"
        return user

    async def ws_connect(self, url: str, *, compress: int = 0) -> aiohttp.ClientWebSocketResponse:
        default = str(DiscordWebSocket.DEFAULT_GATEWAY)
        if self.gateway_url is not None and url.startswith(default):
            url = self.gateway_url + url[len(default) :]
        return await super().ws_connect(url, compress=compress)


@dataclass(frozen=True, slots=True)
class Events:
    """What the adapter does with the gateway's events."""

    message: Callable[[discord.Message], Awaitable[None]]
    interaction: Callable[[discord.Interaction], Awaitable[None]]
    connected: Callable[[], None]
    """A ``READY``: a new session with the gateway (not a resume)."""


def intents(message_content: bool) -> discord.Intents:
    """Servers, server and DM messages, and Message Content if asked for."""
    wanted = discord.Intents.none()
    wanted.guilds = True
    wanted.guild_messages = True
    wanted.dm_messages = True
    wanted.message_content = message_content
    return wanted


class GatewayClient(discord.Client):
    """The bot's connection; its events go to ``events`` (see the module docstring)."""

    def __init__(self, api_url: str, events: Events, *, message_content: bool) -> None:
        discord.VoiceClient.warn_nacl = discord.VoiceClient.warn_dave = False  # no voice here
        super().__init__(
            intents=intents(message_content),
            max_messages=None,
            chunk_guilds_at_startup=False,
            max_ratelimit_timeout=RATE_LIMIT_IN_PLACE,
        )
        self.routed = RoutedHTTP(api_url, self.loop, max_ratelimit_timeout=RATE_LIMIT_IN_PLACE)
        self.http = self._connection.http = self.routed
        self._events = events

    async def on_message(self, message: discord.Message) -> None:
        await self._events.message(message)

    async def on_interaction(self, interaction: discord.Interaction) -> None:
        await self._events.interaction(interaction)

    async def on_connect(self) -> None:
        self._events.connected()


async def answer_interaction(
    client: GatewayClient, interaction: discord.Interaction, answer: dict[str, Any]
) -> None:
    """Answer ``interaction`` with the callback ``answer`` (Discord's interaction response),
    through the client's routed HTTP.

    :raises discord.HTTPException: Discord refused it (an interaction is answered once,
        within three seconds).
    """
    route = Route(
        "POST",
        "/interactions/{interaction_id}/{interaction_token}/callback",
        interaction_id=interaction.id,
        interaction_token=interaction.token,
    )
    await client.routed.request(route, json=answer)
