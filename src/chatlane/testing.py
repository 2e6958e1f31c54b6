"""Test support for people who build on chatlane, in the spirit of Starlette's TestClient.

:class:`GatewayHarness` runs a real :class:`~chatlane.gateway.Gateway` — the
same engine, busy policies and commands as production — with an in-memory
outbox instead of an adapter::

    async with GatewayHarness(my_agent, busy="interrupt") as h:
        await h.send("hello", chat_id="c1")
        assert await h.replies(chat_id="c1", count=1) == ["hi!"]
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any, Self

from chatlane.authorization import Allowlist, Authorize, allow_all, any_command
from chatlane.errors import ConfigError, InvalidSource
from chatlane.gateway import DispatchResult, Gateway, GatewaySettings
from chatlane.identity import KeyPolicy, SessionKey, SessionSource
from chatlane.lifecycle import LifecycleOptions
from chatlane.metrics import Metrics
from chatlane.runtime import pending
from chatlane.runtime.busy import BusyPolicy, BusySettings
from chatlane.runtime.engine import RuntimeSettings
from chatlane.runtime.outcomes import MessageOutcome
from chatlane.runtime.turn import Turn
from chatlane.state import SessionState
from chatlane.stores import Store, open_store
from chatlane.types import (
    Agent,
    Attachment,
    InboundMessage,
    Outbound,
    OutboundKind,
    Target,
    clean_text,
)

_COMPLETE = frozenset(
    {OutboundKind.REPLY, OutboundKind.ACK, OutboundKind.NOTICE, OutboundKind.APPROVAL}
)
_RUNTIME_FIELDS = frozenset(f.name for f in dataclasses.fields(RuntimeSettings)) - {"busy"}
_WATCHED_METRICS = ("turn_started", "turn_finished", "busy", "failed")
"""The engine's counters whose updates wake :meth:`GatewayHarness.until_running` and co."""

ChatAddress = tuple[str | None, str | None]


Allow = Mapping[str, Iterable[str]] | Authorize
"""Who may use a harness's gateway: user ids per platform, or a check of the sender."""


def harness_settings(
    busy: str | BusyPolicy, settings: dict[str, Any], allow: Allow | None = None
) -> GatewaySettings:
    """Gateway settings from the harness's keyword arguments.

    :raises ConfigError: for a keyword that is not a runtime setting, or a bad allowlist.
    """
    extra = {"key_policy", "lifecycle", "command_guard"}
    unknown = sorted(set(settings) - _RUNTIME_FIELDS - extra)
    if unknown:
        raise ConfigError(
            f"unknown harness settings {unknown}; expected some of "
            f"{sorted(_RUNTIME_FIELDS | extra)}"
        )
    key_policy = settings.pop("key_policy", KeyPolicy())
    lifecycle = settings.pop("lifecycle", LifecycleOptions())
    guard = settings.pop("command_guard", any_command)
    busy_settings = BusySettings(default=BusyPolicy.parse(str(busy)))
    runtime = RuntimeSettings(busy=busy_settings, **settings)
    return GatewaySettings(key_policy, runtime, lifecycle, _authorize(allow), guard)


def _authorize(allow: Allow | None) -> Authorize:
    if allow is None:
        return allow_all
    if isinstance(allow, Mapping):
        return Allowlist(allow)
    return allow


def _source(
    platform: str,
    chat_id: str,
    chat_type: str,
    thread_id: str | None,
    user_id: str,
    chat_name: str = "",
    user_name: str = "",
) -> SessionSource:
    """:raises InvalidSource: for an empty ``chat_id`` or an unknown ``chat_type``."""
    _address(chat_id, thread_id)
    return SessionSource(
        platform,
        chat_id=chat_id,
        chat_type=chat_type,  # type: ignore[arg-type]  # checked (and converted) by SessionSource
        chat_name=chat_name,
        thread_id=thread_id,
        user_id=user_id,
        user_name=user_name,
    )


def _address(chat_id: object, thread_id: object) -> ChatAddress:
    """Where replies to that chat and thread are filed: ids as text, ``""`` thread as none.

    :raises InvalidSource: for an empty ``chat_id`` (replies could not be told apart).
    """
    if chat_id is None or str(chat_id) == "":
        raise InvalidSource("the harness needs a non-empty chat_id")
    thread = None if thread_id is None or str(thread_id) == "" else clean_text(str(thread_id))
    return (clean_text(str(chat_id)), thread)


class GatewayHarness:
    """An in-process gateway whose deliveries are recorded per chat and thread.

    :param agent: the agent under test.
    :param busy: the gateway-wide busy policy.
    :param store: ``"memory"``, a store URL (``sqlite:///…``, ``redis://…``) or a
        :class:`~chatlane.stores.Store` (which the harness then does not close).
    :param allow: who may use the gateway, as ``[allow]`` in the configuration:
        user ids per platform (``{"test": ["u1"]}``; a platform not named allows
        everyone), or any ``authorize(source) -> bool``. Everyone by default.
        A refused sender gets the refusal notice and nothing runs.
    :param settings: any :class:`~chatlane.runtime.engine.RuntimeSettings` field
        (``queue_cap``, ``collect_debounce``, ``turn_timeout``, …) or ``key_policy``.
    """

    def __init__(
        self,
        agent: Agent,
        *,
        busy: str | BusyPolicy = "queue",
        store: str | Store = "memory",
        allow: Allow | None = None,
        **settings: Any,
    ) -> None:
        self._agent = agent
        self._settings = harness_settings(busy, settings, allow)
        self._store = store
        self._owns_store = isinstance(store, str)
        self.outbox: list[Outbound] = []
        self.outcomes: list[MessageOutcome] = []
        """The outcome of every message the gateway accepted, as emitted (one each)."""
        self._by_chat: defaultdict[ChatAddress, list[Outbound]] = defaultdict(list)
        self._arrived = asyncio.Condition()
        self._changed = asyncio.Event()
        self._gateway: Gateway | None = None
        self._closed = False

    @property
    def gateway(self) -> Gateway:
        """The gateway under test (after the block it stays readable, but closed).

        :raises RuntimeError: before the ``async with`` block.
        """
        if self._gateway is None:
            raise RuntimeError("use the harness as `async with GatewayHarness(...) as h:`")
        return self._gateway

    async def __aenter__(self) -> Self:
        """Start the gateway; a harness is entered once (make a new one for another run).

        :raises RuntimeError: if this harness was entered before.
        """
        if self._gateway is not None or self._closed:
            raise RuntimeError("a GatewayHarness can be entered once; make a new one")
        store = self._store
        if isinstance(store, str):
            store = await open_store("memory://" if store == "memory" else store)
        self._store = store
        self._gateway = Gateway(
            self._agent,
            self._record,
            settings=self._settings,
            store=store,
            on_outcome=self.outcomes.append,
        )
        self._watch(self._gateway.engine.metrics)
        await self._gateway.start()
        return self

    def _watch(self, metrics: Metrics) -> None:
        """Wake the ``until_*`` waiters whenever the engine counts a turn or an arrival."""
        for name in _WATCHED_METRICS:
            counted = getattr(metrics, name)

            def then_notify(*args: Any, _counted: Callable[..., None] = counted) -> None:
                _counted(*args)
                self._notify()

            setattr(metrics, name, then_notify)

    def _notify(self) -> None:
        """Something changed: every waiter looks at its condition again."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.gateway.aclose()
        self._closed = True
        if self._owns_store and isinstance(self._store, Store):
            await self._store.close()

    async def _record(self, outbound: Outbound) -> None:
        async with self._arrived:
            self.outbox.append(outbound)
            target = outbound.target
            self._by_chat[(target.chat_id, target.thread_id)].append(outbound)
            self._arrived.notify_all()
        self._notify()

    async def send(
        self,
        text: str,
        *,
        chat_id: str,
        user_id: str = "u1",
        platform: str = "test",
        chat_type: str = "dm",
        thread_id: str | None = None,
        chat_name: str = "",
        user_name: str = "",
        internal: bool = False,
        attachments: tuple[Attachment, ...] = (),
        whole_reply: bool = False,
    ) -> DispatchResult:
        """Deliver one inbound message (with ``attachments``, if any), as an adapter would.

        ``whole_reply``: its sender takes only whole replies, as an API request without
        ``stream`` (:attr:`~chatlane.types.InboundMessage.whole_reply`).

        :raises RuntimeError: outside the ``async with`` block.
        """
        source = _source(platform, chat_id, chat_type, thread_id, user_id, chat_name, user_name)
        gateway = self.gateway
        if self._closed:
            raise RuntimeError("this GatewayHarness was closed; send inside its `async with`")
        try:
            message = InboundMessage(
                source, text, internal=internal, attachments=attachments, whole_reply=whole_reply
            )
            return await gateway.dispatch(message)
        finally:
            self._notify()

    def delivered(self, *, chat_id: str, thread_id: str | None = None) -> list[Outbound]:
        """Everything delivered to that chat and thread so far, chunks included."""
        return list(self._by_chat[_address(chat_id, thread_id)])

    async def replies(
        self,
        *,
        chat_id: str,
        thread_id: str | None = None,
        count: int,
        timeout: float = 5.0,  # noqa: ASYNC109 - the harness's documented API
    ) -> list[str]:
        """The first ``count`` complete replies (acks and notices included) to that chat.

        Replies are counted from the start of the harness, in delivery order, so
        calling again with a larger ``count`` returns the earlier ones too.

        After the ``async with`` block only what arrived can be read: too few
        replies then raise at once.

        :raises TimeoutError: if fewer than ``count`` arrive within ``timeout``.
        :raises RuntimeError: before the block starts, or after it with too few replies.
        """
        address = _address(chat_id, thread_id)

        def complete() -> list[str]:
            found = [o.text for o in self._by_chat[address] if o.kind in _COMPLETE]
            return found[:count]

        if self._gateway is None:
            raise RuntimeError("use the harness as `async with GatewayHarness(...) as h:`")
        if self._closed and len(complete()) < count:
            raise RuntimeError(
                f"the harness was closed with {len(complete())} of {count} replies "
                f"for chat {address[0]!r}"
            )
        async with asyncio.timeout(timeout), self._arrived:
            await self._arrived.wait_for(lambda: len(complete()) >= count)
        return complete()

    async def wait_for(
        self,
        predicate: Callable[[list[Outbound]], bool],
        timeout: float = 5.0,  # noqa: ASYNC109 - like replies()
    ) -> list[Outbound]:
        """Wait until ``predicate(outbox)`` holds; return the outbox then.

        :raises TimeoutError: if it does not hold within ``timeout``.
        """
        async with asyncio.timeout(timeout), self._arrived:
            await self._arrived.wait_for(lambda: predicate(self.outbox))
        return list(self.outbox)

    async def settle(self, timeout: float = 30.0) -> None:  # noqa: ASYNC109 - like replies()
        """Wait until no turn runs and nothing is queued anywhere.

        :raises TimeoutError: if the gateway is still busy after ``timeout``.
        """
        async with asyncio.timeout(timeout):
            await self.gateway.engine.wait_idle()

    async def until_running(
        self,
        *,
        chat_id: str,
        user_id: str = "u1",
        platform: str = "test",
        chat_type: str = "dm",
        thread_id: str | None = None,
        text: str | None = None,
        timeout: float = 5.0,  # noqa: ASYNC109 - like replies()
    ) -> None:
        """Wait until a turn of that source's session holds its lease and its agent was called.

        It returns once the agent has run up to its first ``await``, so a
        message sent next finds the session busy with a started turn. With
        ``text``, only a turn whose text is ``text`` counts (to wait for the
        turn that follows an interrupted one).

        :raises TimeoutError: if no such agent runs there within ``timeout``.
        """
        key = self.session_key(
            chat_id=chat_id,
            user_id=user_id,
            platform=platform,
            chat_type=chat_type,
            thread_id=thread_id,
        )

        def running() -> bool:
            turn = self.session(key).turn.agent  # a Turn once its agent was called
            return isinstance(turn, Turn) and (text is None or turn.text == text)

        await self._until(running, timeout, f"no agent was running for {key!r}")

    async def until_queued(
        self,
        *,
        chat_id: str,
        count: int,
        user_id: str = "u1",
        platform: str = "test",
        chat_type: str = "dm",
        thread_id: str | None = None,
        timeout: float = 5.0,  # noqa: ASYNC109 - like replies()
    ) -> None:
        """Wait until at least ``count`` messages of that source's session wait for a turn.

        :raises TimeoutError: if fewer than ``count`` are queued within ``timeout``.
        """
        key = self.session_key(
            chat_id=chat_id,
            user_id=user_id,
            platform=platform,
            chat_type=chat_type,
            thread_id=thread_id,
        )

        def queued() -> bool:
            return pending.pending_count(self.session(key)) >= count

        await self._until(queued, timeout, f"fewer than {count} messages were queued for {key!r}")

    async def _until(
        self,
        holds: Callable[[], bool],
        timeout: float,  # noqa: ASYNC109 - like replies()
        failure: str,
    ) -> None:
        """Wait, woken by each change the harness sees, until ``holds()``.

        :raises TimeoutError: naming ``failure`` and ``timeout``.
        :raises RuntimeError: outside the ``async with`` block.
        """
        if self._gateway is None or self._closed:
            raise RuntimeError("wait inside the harness's `async with` block")
        try:
            async with asyncio.timeout(timeout):
                while not holds():
                    await self._changed.wait()
        except TimeoutError:
            raise TimeoutError(f"{failure} within {timeout} s") from None

    def session(self, session_key: SessionKey) -> SessionState:
        """The live state of ``session_key`` (created if it does not exist yet)."""
        return self.gateway.engine.registry.get(session_key)

    def session_key(
        self,
        *,
        chat_id: str,
        user_id: str = "u1",
        platform: str = "test",
        chat_type: str = "dm",
        thread_id: str | None = None,
    ) -> SessionKey:
        """The key the harness's gateway gives to messages from that source."""
        source = _source(platform, chat_id, chat_type, thread_id, user_id)
        return self.gateway.session_key(InboundMessage(source, ""))


__all__ = ["GatewayHarness", "Target", "harness_settings"]
