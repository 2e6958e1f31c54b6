"""The hub of ``chatlane serve``: one gateway, its adapters, and the ASGI app they share.

Running it (configuration, command-line overrides, uvicorn) is
:mod:`chatlane.serve`.

What stays true:

* Every adapter submits through :meth:`Hub.submit` to the gateway, whose
  first step checks the sender against ``[allow]`` (:meth:`Config.allows`):
  for a user not on their platform's allowlist nothing runs and nothing is
  stored; the refusal is logged and counted, and the sender is told — by the
  adapter's own :meth:`RefusingAdapter.refuse` when it has one (Telegram
  stays silent in groups), else with a clear notice.
* Every outbound message goes to the adapter of its target's platform; an
  adapter that is missing or fails is logged, never a crash. A reply, notice
  or approval prompt to an adapter that sends through the delivery ledger
  (Telegram, Slack, Discord) is recorded in the store first and sent by the ledger's worker,
  which retries until the platform accepts it (``docs/delivery.md``).
* Every route answers only requests addressed to a name the operator allowed
  (``Host``), with or without a token; every route that checks the token asks
  the hub's one :class:`~chatlane.access.AccessToken`.
* Secrets are read once, by :func:`~chatlane.secrets.resolve_secrets`, and
  handed to the hub, the agent and the adapters; nothing here reads the
  environment.
* Shutdown (SIGINT, SIGTERM) stops accepting, fences running turns, releases
  their leases and closes the store: accepted messages stay in the durable
  queue for the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import InitVar, dataclass, field
from typing import Protocol, runtime_checkable

import msgspec
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import BaseRoute

from chatlane import admin
from chatlane.access import AccessToken
from chatlane.agents import load_agent
from chatlane.asgi import App, HostCheck
from chatlane.commands import CommandSpec
from chatlane.config import Config
from chatlane.delivery.worker import Sender
from chatlane.errors import ChatlaneError, ConfigError, StartInterrupted
from chatlane.gateway import DispatchResult, Gateway, GatewaySettings
from chatlane.identity import KeyPolicy
from chatlane.lifecycle import LifecycleOptions
from chatlane.metrics import Metrics
from chatlane.overheard import ContextLimits
from chatlane.runtime.outcomes import MessageOutcome
from chatlane.secrets import Secrets, TokenSource, resolve_secrets
from chatlane.session_commands import is_yes_or_no
from chatlane.stores import Store, open_store
from chatlane.types import Agent, InboundMessage, Outbound, SessionKey

log = logging.getLogger("chatlane.server")

LEDGERED_PLATFORMS = ("telegram", "slack", "discord")
"""Platforms whose replies go through the delivery ledger in every process, whether or not
it runs their adapter (a process that answers a Telegram message it adopted records the
reply; one running the Telegram adapter sends it)."""


class Adapter(Protocol):
    """A platform connection: it turns platform events into messages and delivers replies."""

    platform: str

    def routes(self) -> Sequence[BaseRoute]:
        """HTTP and WebSocket routes this adapter serves (may be empty)."""
        ...

    async def start(self, hub: Hub) -> None:
        """Begin receiving (polling loops start here)."""
        ...

    async def deliver(self, outbound: Outbound) -> None:
        """Send one outbound message to its target chat."""
        ...

    async def aclose(self) -> None:
        """Stop receiving and release connections."""
        ...


@runtime_checkable
class RefusingAdapter(Protocol):
    """An adapter that tells a refused sender in its own terms (or not at all)."""

    async def refuse(self, message: InboundMessage) -> None:
        """``message``'s sender is not on the allowlist: tell them, if and how it is safe."""
        ...


@runtime_checkable
class OutcomeAdapter(Protocol):
    """An adapter that hears how each message it received ended (the API finishes requests)."""

    def outcome(self, outcome: MessageOutcome) -> None:
        """``outcome`` is the one outcome of a message this adapter's platform sent."""
        ...


@runtime_checkable
class AdoptingAdapter(Protocol):
    """An adapter that hears of messages taken over from a process that stopped (the web
    chat shows them in its open tabs, which that process told)."""

    def adopted(self, key: SessionKey, message: InboundMessage) -> None:
        """``message``, of this adapter's platform, was adopted here and runs or waits."""
        ...


def gateway_settings(config: Config) -> GatewaySettings:
    """How the gateway authorizes senders, names sessions, runs turns and ends conversations."""
    return GatewaySettings(
        key_policy=KeyPolicy(namespace=config.namespace),
        runtime=config.runtime,
        lifecycle=LifecycleOptions(confirm_new=config.confirm_new),
        authorize=config.allows,
        command_guard=config.admin_commands(),
    )


@dataclass
class Hub:
    """What adapters talk to: authorization, the gateway, and delivery by platform.

    ``secrets`` gives the access token read at start; without it, the token is
    read here from the configuration and the environment.
    """

    config: Config
    store: Store
    agent: Agent
    adapters: dict[str, Adapter] = field(default_factory=dict)
    secrets: InitVar[Secrets | None] = None
    gateway: Gateway = field(init=False)
    access: AccessToken = field(init=False)
    """The access token every route checks, one for all (a reload swaps it everywhere)."""
    startup_error: ChatlaneError | None = None
    """Why the gateway or an adapter could not start, or :class:`StartInterrupted` (the
    server then stops at once)."""
    _starting: asyncio.Task[None] | None = field(default=None, init=False, repr=False)

    def __post_init__(self, secrets: Secrets | None) -> None:
        if secrets is None:
            self.access = AccessToken(TokenSource.read(self.config.server.token))
        else:
            self.access = AccessToken(secrets.access_token)
        self.gateway = Gateway(
            self.agent,
            self.deliver,
            settings=gateway_settings(self.config),
            store=self.store,
            refuse=self._refuse,
            on_outcome=self.outcome,
            on_adopted=self.adopted,
        )
        if self.config.delivery.enabled:
            for platform in LEDGERED_PLATFORMS:
                self.gateway.ledger_for(platform, self.config.delivery)

    @property
    def metrics(self) -> Metrics:
        """The engine's counters."""
        return self.gateway.engine.metrics

    def add(self, adapter: Adapter) -> None:
        """Serve ``adapter``'s platform.

        An adapter that can send deliveries of the ledger (a
        :class:`~chatlane.delivery.worker.Sender`) gets its replies, notices
        and approval prompts through it, unless ``[delivery] enabled = false``.
        """
        self.adapters[adapter.platform] = adapter
        if self.config.delivery.enabled and isinstance(adapter, Sender):
            self.gateway.add_sender(adapter, self.config.delivery)

    def admit(self, message: InboundMessage) -> bool:
        """Whether the sender may use the gateway; a refusal is logged and counted, not told."""
        return self.gateway.admit(message)

    def awaits_answer(self, text: str, message: Callable[[], InboundMessage]) -> bool:
        """Whether ``text``, not said to the bot, is a yes or no its sender owes an approval
        prompt (:meth:`~chatlane.gateway.Gateway.awaits_answer`); ``message`` makes the
        message it was said in, only for a plain yes or no (most texts need none)."""
        return is_yes_or_no(text) and self.gateway.awaits_answer(message())

    def overhear(self, message: InboundMessage, limits: ContextLimits) -> bool:
        """Keep ``message``, said in a shared chat but not to the bot, as context for the next
        turn of its session (:meth:`~chatlane.gateway.Gateway.overhear`); whether it was kept."""
        return self.gateway.overhear(message, limits)

    async def has_run(self, message: InboundMessage) -> bool:
        """Whether a turn ever ran for ``message``'s session, in any process sharing the
        store (:meth:`~chatlane.gateway.Gateway.has_run`).

        :raises ChatlaneError: the store could not say.
        """
        return await self.gateway.has_run(message)

    async def submit(self, message: InboundMessage) -> DispatchResult:
        """Dispatch one message; the gateway authorizes it first (``refused`` if it refuses)."""
        return await self.gateway.dispatch(message)

    async def _refuse(self, message: InboundMessage) -> None:
        """Tell a refused sender: through their adapter's ``refuse``, else with a notice."""
        adapter: object = self.adapters.get(message.source.platform)  # refuse() is optional
        if isinstance(adapter, RefusingAdapter):
            await adapter.refuse(message)
            return
        await self.gateway.notify_refused(message)

    def outcome(self, outcome: MessageOutcome) -> None:
        """Hand a message's outcome to its platform's adapter, if that adapter listens."""
        # outcome() is optional (OutcomeAdapter); a plain look-up, as every message ends here
        hear = getattr(self.adapters.get(outcome.platform), "outcome", None)
        if hear is not None:
            hear(outcome)

    def adopted(self, key: SessionKey, message: InboundMessage) -> None:
        """Hand a message adopted here to its platform's adapter, if that adapter listens."""
        hear = getattr(self.adapters.get(message.source.platform), "adopted", None)
        if hear is not None:  # adopted() is optional (AdoptingAdapter)
            hear(key, message)

    async def start(self) -> None:
        """Start the gateway, then each adapter in turn; never raises for what stops that.

        A :class:`~chatlane.errors.ChatlaneError` that stops it, or the
        :class:`~chatlane.errors.StartInterrupted` of :meth:`interrupt_start`, is kept
        in :attr:`startup_error`; what did start is shut down by :func:`shutdown` as
        always. A start interrupted before it began does not begin.
        """
        if self.startup_error is not None:
            return
        starting = asyncio.ensure_future(self._start_everything())
        self._starting = starting
        try:
            await starting
        except ChatlaneError as error:
            self.startup_error = error
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # this task itself is being cancelled, not only the start
        finally:
            self._starting = None

    async def _start_everything(self) -> None:
        await self.gateway.start()
        for adapter in self.adapters.values():
            await adapter.start(self)

    def interrupt_start(self, signal: int) -> None:
        """Call the start off: ``signal`` came before it ended (:meth:`start` then returns,
        with :class:`~chatlane.errors.StartInterrupted` in :attr:`startup_error`).

        Safe in a signal handler: the running start is cancelled and its event loop woken,
        as :func:`asyncio.run` does for Ctrl-C.
        """
        if self.startup_error is None:
            self.startup_error = StartInterrupted(signal)
        starting = self._starting
        if starting is not None and not starting.done():
            starting.cancel()
            starting.get_loop().call_soon_threadsafe(lambda: None)

    async def deliver(self, outbound: Outbound) -> None:
        """Hand ``outbound`` to its platform's adapter."""
        adapter = self.adapters.get(outbound.target.platform)
        if adapter is None:
            log.warning("no adapter for %s; dropped %s", outbound.target.platform, outbound.kind)
            return
        await adapter.deliver(outbound)


async def open_hub(
    config: Config, store_url: str | None = None, *, secrets: Secrets | None = None
) -> Hub:
    """Open the store and build the hub (adapters are added by the caller).

    :param store_url: the store to open instead of ``config.store.url``; the
        hub's configuration then names it, so nothing derived from the store's
        location (the web id secret file beside a SQLite database) lands beside
        the one the file names.
    :param secrets: read at start (default: :func:`~chatlane.secrets.resolve_secrets`
        reads them now); the agent and the hub get theirs from it.
    :raises ConfigError: for an agent that cannot be loaded or a secret file that cannot be read.
    """
    if store_url is not None:
        config = msgspec.structs.replace(
            config, store=msgspec.structs.replace(config.store, url=store_url)
        )
    secrets = resolve_secrets(config) if secrets is None else secrets
    agent = load_agent(config, secrets)
    commands = _agent_commands(agent, config.agent.name)
    store = await open_store(config.store.url)
    bind = getattr(agent, "bind", None)
    if callable(bind):
        bind(store)
    hub = Hub(config, store, agent, secrets=secrets)
    for spec in commands:
        hub.gateway.router.register(spec)
    return hub


def _agent_commands(agent: Agent, name: str) -> list[CommandSpec]:
    """The slash commands an agent brings in its ``commands`` attribute (none without one).

    :raises ConfigError: naming the agent, if one of them is not a :class:`CommandSpec`.
    """
    commands = list(getattr(agent, "commands", ()))
    for spec in commands:
        if not isinstance(spec, CommandSpec):
            raise ConfigError(f"agent {name!r}: its commands must be CommandSpec, not {spec!r}")
    return commands


def build_app(hub: Hub, on_ready: Callable[[], None] | None = None) -> Starlette:
    """The HTTP application: every adapter's routes plus ``/metrics``, with a lifespan
    that starts the gateway and adapters and shuts everything down in order."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await hub.start()  # what stops it is reported by the caller, without a traceback
        if on_ready is not None and hub.startup_error is None:
            on_ready()
        try:
            yield
        finally:
            await shutdown(hub)

    routes: list[BaseRoute] = [*hub.metrics.routes(hub), *admin.routes(hub)]
    for adapter in hub.adapters.values():
        routes.extend(adapter.routes())
    return App(routes, lifespan=lifespan, middleware=_host_check(hub.config))


LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1", "[::1]")


def allowed_hosts(config: Config) -> list[str]:
    """The ``Host`` names answered: loopback names, the listening address, ``allowed_hosts``."""
    return sorted({*LOOPBACK_NAMES, config.server.host, *config.server.allowed_hosts})


def _host_check(config: Config) -> list[Middleware]:
    """Answer only requests addressed to an allowed name, on every route, token or not.

    Without a token a web page elsewhere could reach a loopback gateway through
    DNS rebinding; with one, a name the operator never meant to serve is
    refused too. Anything else gets 400 (:class:`~chatlane.asgi.HostCheck`).
    """
    return [Middleware(HostCheck, allowed_hosts=allowed_hosts(config))]


async def shutdown(hub: Hub) -> None:
    """Fence running turns (their messages stay queued), then stop adapters, close the store.

    Turns stop first, so no turn can commit a reply after its adapter is gone:
    a message that arrives meanwhile is kept in the store for the next start.
    """
    await hub.gateway.aclose()
    for adapter in hub.adapters.values():
        try:
            await adapter.aclose()
        except Exception:
            log.exception("adapter %s failed to close", adapter.platform)
    close_agent = getattr(hub.agent, "aclose", None)
    if callable(close_agent):
        await close_agent()
    await hub.store.close()
