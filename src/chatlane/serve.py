"""Running ``chatlane serve``: configuration and overrides, secrets, adapters, uvicorn.

What it runs — the gateway, its adapters and their ASGI app — is :mod:`chatlane.hub`.
Secrets are read once, by :func:`prepare` (:func:`~chatlane.secrets.resolve_secrets`),
checked there, and handed to the hub, the agent and every adapter by :func:`serve`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import gc
import importlib
import logging
import resource
import signal
import socket
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TypedDict, Unpack

import msgspec
import uvicorn
from starlette.types import ASGIApp

from chatlane.adapters.discord_wire import check_token
from chatlane.adapters.slack_wire import check_secrets
from chatlane.adapters.web_wire import MAX_FRAME_BYTES
from chatlane.agents import needs_extra
from chatlane.config import Config, ServerConfig, check_config, http_url, load_config
from chatlane.console import EARLY_SIGTERM, EarlySigterm
from chatlane.errors import ConfigError, StartInterrupted
from chatlane.http_guard import MAX_LINGERING, ConnectionLimits, guarded_protocol
from chatlane.hub import Adapter, Hub, build_app, open_hub, shutdown
from chatlane.redaction import redact_urls
from chatlane.runtime.busy import BusyPolicy
from chatlane.scheduling.settings import build_scheduler
from chatlane.secrets import Secrets, missing_secret, resolve_secrets
from chatlane.stores import MemoryStore, Store
from chatlane.stores.urls import mask_userinfo

log = logging.getLogger("chatlane.server")


class Overrides(TypedDict, total=False):
    """What the ``chatlane serve`` command line sets on top of the configuration."""

    host: str | None
    port: int | None
    store: str | None
    agent: str | None
    busy: str | None
    keep_alive: int | None


def configure(config_path: str | None, **overrides: Unpack[Overrides]) -> Config:
    """The configuration file and environment, then the command line on top; validated,
    with the secrets it needs present (see :func:`prepare`).

    :raises ConfigError: for any bad value or missing secret, naming it.
    """
    config, _ = prepare(config_path, **overrides)
    return config


def prepare(
    config_path: str | None,
    *,
    host: str | None = None,
    port: int | None = None,
    store: str | None = None,
    agent: str | None = None,
    busy: str | None = None,
    keep_alive: int | None = None,
) -> tuple[Config, Secrets]:
    """What ``chatlane serve`` starts with: the validated configuration (as :func:`configure`)
    and its secrets, read once and checked.

    :raises ConfigError: for any bad value, a secret file that cannot be read or a
        missing token, naming it.
    """
    config = load_config(config_path)
    _check_options(host=host, port=port, store=store, agent=agent, keep_alive=keep_alive)
    server = msgspec.structs.replace(
        config.server,
        host=config.server.host if host is None else host,
        port=config.server.port if port is None else port,
        keep_alive=config.server.keep_alive if keep_alive is None else keep_alive,
    )
    runtime = config.runtime
    if busy is not None:
        policy = BusyPolicy.parse(busy, what="--busy")
        runtime = dataclasses.replace(
            runtime, busy=dataclasses.replace(runtime.busy, default=policy)
        )
    config = msgspec.structs.replace(
        config,
        server=server,
        runtime=runtime,
        store=msgspec.structs.replace(config.store, url=store or config.store.url),
        agent=msgspec.structs.replace(config.agent, name=agent or config.agent.name),
    )
    check_config(config)
    for platform in enabled_platforms(config):  # a missing extra first: no token helps then
        adapter_class(platform)
    secrets = resolve_secrets(config)
    require_token(config, secrets)
    if config.telegram.enabled and not secrets.telegram_token:
        raise missing_secret(
            "telegram is enabled but has no bot token", config.telegram.token, "telegram.token"
        )
    if config.slack.enabled:
        check_secrets(
            config.slack,
            secrets.slack_bot_token,
            secrets.slack_signing_secret,
            secrets.slack_app_token,
        )
    if config.discord.enabled:
        check_token(secrets.discord_token, config.discord.token)
    build_scheduler(config)
    return config, secrets


def _check_options(**options: str | int | None) -> None:
    """Command-line values replace the configuration's, so each must be one.

    :raises ConfigError: for an empty text, a port outside 1 to 65535 or a
        keep-alive of no seconds.
    """
    for name, value in options.items():
        if value == "":
            raise ConfigError(f"--{name.replace('_', '-')}: expected a value, not an empty string")
    port = options.get("port")
    if isinstance(port, int) and not 0 < port < 65536:
        raise ConfigError(f"--port {port}: expected a port between 1 and 65535")
    keep_alive = options.get("keep_alive")
    if isinstance(keep_alive, int) and not keep_alive > 0:
        raise ConfigError(f"--keep-alive {keep_alive}: expected a whole number of seconds > 0")


def require_token(config: Config, secrets: Secrets) -> None:
    """A non-loopback address needs an access token; a wildcard one, the names it answers to.

    :raises ConfigError: if either is missing.
    """
    token = config.server.token
    if not secrets.access_token.value and token != ServerConfig().token:
        log.warning(  # a name mistyped in the configuration, most likely
            "server.token reads %s, which gives nothing: the gateway has no access token",
            token.source(),
        )
    if not config.server.is_loopback() and not secrets.access_token.value:
        raise missing_secret(
            f"configuration key 'server.host' = {config.server.host!r}: listening beyond this "
            "machine needs a token",
            token,
            "server.token",
        )
    if config.server.is_wildcard() and not config.server.allowed_hosts:
        raise ConfigError(
            f"configuration key 'server.host' = {config.server.host!r}: listening on every "
            "address needs the names clients use in 'server.allowed_hosts' (every request "
            "addressed to another name is refused)"
        )


CHAT_ADAPTERS: dict[str, tuple[str, str, str]] = {
    "telegram": ("the Telegram adapter", "chatlane.adapters.telegram", "TelegramAdapter"),
    "slack": ("the Slack adapter", "chatlane.adapters.slack", "SlackAdapter"),
    "discord": ("the Discord adapter", "chatlane.adapters.discord", "DiscordAdapter"),
}
"""Each chat platform's extra (its name), what it is called, and where its adapter class is."""


def enabled_platforms(config: Config) -> list[str]:
    """The chat platforms ``config`` enables, in :data:`CHAT_ADAPTERS` order."""
    enabled = {
        "telegram": config.telegram.enabled,
        "slack": config.slack.enabled,
        "discord": config.discord.enabled,
    }
    return [name for name in CHAT_ADAPTERS if enabled[name]]


def adapter_class(platform: str) -> Callable[..., Adapter]:
    """The adapter class of ``platform`` (a key of :data:`CHAT_ADAPTERS`).

    :raises ConfigError: its extra is not installed, naming the ``pip install`` to run.
    """
    what, module, name = CHAT_ADAPTERS[platform]
    with needs_extra(platform, what):
        adapter: Callable[..., Adapter] = getattr(importlib.import_module(module), name)
    return adapter


def add_adapters(hub: Hub, secrets: Secrets | None = None) -> None:
    """The web chat and the API always; Telegram, Slack and Discord when enabled. All share the
    hub's access token; ``secrets`` (default: read now) gives them the rest."""
    from chatlane.adapters.api import ApiAdapter
    from chatlane.adapters.web import WebAdapter

    secrets = resolve_secrets(hub.config) if secrets is None else secrets
    hub.add(WebAdapter(hub.config, access=hub.access, secrets=secrets))
    hub.add(ApiAdapter(hub.config, access=hub.access, secrets=secrets))
    for platform in enabled_platforms(hub.config):
        hub.add(adapter_class(platform)(hub.config, secrets=secrets))


async def serve(config: Config, secrets: Secrets | None = None) -> None:
    """Run until SIGINT or SIGTERM; then shut down gracefully and say so (:func:`stopped_line`).

    The address is bound first, so a port in use stops the start before the
    store is opened or any adapter starts. A Ctrl-C or a SIGTERM before the
    gateway is ready calls the start off: what it opened is closed, and the call
    ends with :class:`~asyncio.CancelledError` (which :func:`asyncio.run` turns into
    :class:`KeyboardInterrupt`) for a Ctrl-C before uvicorn handles the signals, else
    with :class:`~chatlane.errors.StartInterrupted`. Until uvicorn handles them, a
    SIGTERM cancels this task as a Ctrl-C does, where ``chatlane serve`` put
    :data:`~chatlane.console.EARLY_SIGTERM` in charge of it.

    :param secrets: as :func:`prepare` read them (default: read now).
    :raises ConfigError: the port is in use, or the address cannot be listened on.
    :raises StartInterrupted: a signal came while the app and its adapters started, or
        SIGTERM came before.
    """
    with sigterm_calls_off_the_start() as sigterm:
        try:
            await _start_and_run(config, secrets)
        except asyncio.CancelledError:
            if not sigterm.came:
                raise
            raise StartInterrupted(signal.SIGTERM) from None


@contextlib.contextmanager
def sigterm_calls_off_the_start() -> Iterator[EarlySigterm]:
    """While in it, a SIGTERM that :data:`~chatlane.console.EARLY_SIGTERM` handles cancels
    the current task (the start) until the gateway is ready; it says whether one came."""
    EARLY_SIGTERM.start = asyncio.current_task()
    try:
        yield EARLY_SIGTERM
    finally:
        EARLY_SIGTERM.start = None


async def _start_and_run(config: Config, secrets: Secrets | None) -> None:
    """:func:`serve`'s start and run; a cancellation before the app started closes what
    had opened before it goes on."""
    secrets = resolve_secrets(config) if secrets is None else secrets
    listening = bind_socket(config)  # before anything starts: a port in use changes nothing
    with listening:
        scheduler = build_scheduler(config)
        hub = await open_hub(config, secrets=secrets)
        try:
            hub.gateway.use_scheduler(scheduler)
            add_adapters(hub, secrets)
            server = AnnouncingServer(uvicorn_config(build_app(hub), config), config, hub)
            await server.serve(sockets=[listening])
        except asyncio.CancelledError:  # a signal before the app started: close what opened
            await shutdown(hub)
            raise
    if hub.startup_error is not None:
        raise hub.startup_error
    print(stopped_line(hub.store), flush=True)


def bind_socket(config: Config) -> socket.socket:
    """The listening socket for ``server.host`` and ``server.port``, bound now.

    :raises ConfigError: the port is in use (with the hint to pick another with
        ``--port``), or the address cannot be listened on.
    """
    host, port = config.server.host, config.server.port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio turns Nagle's algorithm off only for sockets
    # that say they are TCP, and without that every two-write answer waits for
    # the client's delayed ACK (about 40 ms on Linux).
    listening = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listening.bind((host.strip("[]"), port))
    except OSError as error:
        listening.close()
        if error.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"port {port} on {host} is already in use (another chatlane?): stop what "
                "listens there, or start with --port <another port>"
            ) from None
        raise ConfigError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    return listening


STOPPED = "chatlane stopped (messages not answered yet stay in the store for the next start)"
"""What ``chatlane serve`` prints once it has shut down, on a store that keeps its messages."""

STOPPED_MEMORY = (
    "chatlane stopped (the memory store keeps nothing: messages not answered yet are gone)"
)
"""What it prints instead on the memory store, which ends with the process."""


def stopped_line(store: Store) -> str:
    """The last line of ``chatlane serve`` on ``store``: whether what it holds waits for the
    next start."""
    return STOPPED_MEMORY if isinstance(store, MemoryStore) else STOPPED


FORCED_APP_SHUTDOWN = 5.0
"""After a second Ctrl-C, the seconds open requests may take to end once their
connections are dropped, and then the app's own shutdown (adapters, agent, store)."""

FILES_KEPT = 64 + MAX_LINGERING
"""Open files kept free of connections: for the store, logs and the agent, and for
refused connections while they linger."""


def connection_limits(config: Config) -> ConnectionLimits:
    """The header deadline, and ``max_connections`` lowered to fit the open-file limit."""
    wanted = config.server.max_connections
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    fits = wanted if soft == resource.RLIM_INFINITY else max(1, min(wanted, soft - FILES_KEPT))
    if fits < wanted:
        log.warning(
            "server.max_connections = %d does not fit the open-file limit (%d): using %d",
            wanted,
            soft,
            fits,
        )
    return ConnectionLimits(header_timeout=config.server.header_timeout, max_connections=fits)


def uvicorn_config(app: ASGIApp, config: Config) -> uvicorn.Config:
    """How the HTTP server runs ``app``: address, header deadline, connection cap, idle
    keep-alive, shutdown wait, frame limit."""
    return uvicorn.Config(
        app,
        host=config.server.host,
        port=config.server.port,
        http=guarded_protocol(connection_limits(config)),
        timeout_keep_alive=config.server.keep_alive,
        log_level="warning",
        lifespan="on",
        timeout_graceful_shutdown=max(1, int(config.runtime.interrupt_grace) + 5),
        ws_max_size=MAX_FRAME_BYTES,
    )


class AnnouncingServer(uvicorn.Server):
    """Prints the URLs once the socket is bound (so "ready" means ready), the start's
    objects frozen first (:func:`freeze_the_start`); reloads the access token on SIGHUP.

    A signal before then calls the start off (:meth:`~chatlane.hub.Hub.interrupt_start`):
    nothing is announced, and what started is shut down as after a failed start.
    """

    def __init__(self, uvicorn_config: uvicorn.Config, config: Config, hub: Hub) -> None:
        super().__init__(uvicorn_config)
        self.chatlane_config = config
        self.hub = hub

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Shut down gracefully and then exit normally (status 0), not by re-raising the signal;
        before the gateway is ready, call its start off.

        A second Ctrl-C (SIGINT) stops waiting for open connections, as
        uvicorn's does; :meth:`shutdown` still closes the app.
        """
        super().handle_exit(sig, frame)
        self._captured_signals.clear()
        if not self.started:
            self.hub.interrupt_start(sig)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Stop the turns first, so requests waiting on them are answered, not held open.

        A second Ctrl-C makes uvicorn stop waiting for open requests and skip
        the app's own shutdown (adapters, agent, store); both are then ended
        here (:meth:`_close_the_rest`). Left running, their tasks would be
        cancelled as the process exits, each printing uvicorn's traceback.
        """
        if hasattr(signal, "SIGHUP"):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        await self.hub.gateway.aclose()
        await super().shutdown(sockets)
        if self.force_exit:
            await self._close_the_rest()
        gc.unfreeze()  # what the start made may go now, as in a process that never froze it

    async def _close_the_rest(self) -> None:
        """After a second Ctrl-C: drop the connections still open, so their requests end
        as a client's disconnect ends them, then close the app; each step waited for
        :data:`FORCED_APP_SHUTDOWN` seconds at most."""
        for connection in list(self.server_state.connections):
            connection.transport.close()
        requests = set(self.server_state.tasks)
        if requests:
            await asyncio.wait(requests, timeout=FORCED_APP_SHUTDOWN)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(FORCED_APP_SHUTDOWN):
                await self.lifespan.shutdown()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        # A Ctrl-C that came before uvicorn took the signals asked asyncio.run to cancel
        # this task: the cancellation lands here, before the app begins to start.
        await asyncio.sleep(0)
        await super().startup(sockets)
        if self.hub.startup_error is not None:
            self.should_exit = True
        elif self.started:
            if hasattr(signal, "SIGHUP"):
                asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.hub.access.reload)
            freeze_the_start()
            EARLY_SIGTERM.ready = True  # uvicorn's SIGTERM from now on: a graceful shutdown
            announce(self.chatlane_config)


def freeze_the_start() -> None:
    """Collect the start's garbage, then keep what is left out of every later collection.

    What the start made — modules, classes, configuration, the app, the store —
    lives as long as the process. Left to the collector, each full collection
    walks all of it, holding up every request in flight (about 13 ms each,
    some twice a second, with 16 API requests in flight). Frozen
    (:func:`gc.freeze`), a full collection walks only what was made since:
    sessions, turns and their messages. Nothing frozen is ever freed by the
    collector, so the start's own garbage goes first; objects that are
    freed by their reference count still go as before.
    """
    gc.collect()
    gc.freeze()


def announce(config: Config) -> None:
    """Print where the gateway can be reached, the chat platforms it runs, and its store:
    the URL without its credentials, and a SQLite store's file as an absolute path. The
    store's line is the last."""
    base = http_url(config.server.host, config.server.port)
    platforms = enabled_platforms(config)
    chats = f"  chats:    {', '.join(platforms)}\n" if platforms else ""
    print(
        f"chatlane is ready\n  web chat: {base}/\n  API:      {base}/v1  "
        f"(OpenAI-compatible)\n  metrics:  {base}/metrics   health: {base}/health\n{chats}"
        f"  store:    {shown_store(config.store.url)}   agent: {config.agent.name}",
        flush=True,
    )


def shown_store(url: str) -> str:
    """``url`` without credentials; for SQLite, with the file's absolute path after it."""
    shown = redact_urls(mask_userinfo(url))
    if url.startswith("sqlite:"):
        from chatlane.stores.sqlite_schema import parse_url

        shown += f" (file {parse_url(url).path.absolute()})"
    return shown
