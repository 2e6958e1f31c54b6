"""Operator endpoints: the gateway's health, its sessions, one session in detail,
and the messages set aside as failed.

``GET /admin/sessions``, ``GET /admin/sessions/{key}`` and ``GET /admin/failed``
answer JSON; ``POST /admin/failed/{message_id}/retry`` runs a failed message
again; ``GET /admin/deliveries?state=dead`` lists the delivery ledger (dead
letters by default, or ``pending`` / ``delivered``) with its counts, and
``POST /admin/deliveries/{id}/retry`` sends a dead one again;
``/admin/cron`` lists and removes scheduled jobs (:mod:`chatlane.admin_cron`).
When an access token is configured they require it
(``Authorization: Bearer …``): the one the gateway read at start or at its
last reload; a gateway whose token became empty or unreadable refuses all.
A wrong token counts against its client address as on every route
(:class:`~chatlane.access.GuessLimiter`); a blocked address gets 429 with
``Retry-After``, whatever token it sends.
Keys and ids are URL-encoded in the path, so ``:`` and ``%`` work. A store
that fails them is answered with 503 and the store's own message, never a
traceback.

``GET /health`` needs no token (probes call it): 200 ``{"status": "ok"}``,
or 503 ``{"status": "unhealthy", "reason": …}`` once the store found damage.
The reason names the condition, not the store's path.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route

from chatlane import admin_cron
from chatlane.access import TooManyGuesses, client_address
from chatlane.delivery.ledger import outbound_of
from chatlane.errors import StoreError, shown_to_users
from chatlane.identity import SessionKey
from chatlane.runtime.turn import waiting_here
from chatlane.state import SessionState, SlotPhase
from chatlane.stores.base import DEAD, DELIVERED, PENDING, Delivery, FailedRecord
from chatlane.types import Outbound

if TYPE_CHECKING:
    from chatlane.hub import Hub


def _activity(state: SessionState, hub: Hub) -> str:
    turn = hub.gateway.engine.running_turn(state.key)
    if turn is not None:
        return "running"
    return "collecting" if state.turn.phase is SlotPhase.COLLECTING else "idle"


def session_summary(state: SessionState, hub: Hub) -> dict[str, Any]:
    """What ``chatlane sessions`` lists for one session."""
    return {
        "key": state.key,
        "activity": _activity(state, hub),
        "generation": state.persistent.run_generation,
        "queued": waiting_here(state),  # what queue_cap counts, untaken steers too
        "idle_seconds": round(time.monotonic() - state.last_access, 1),
    }


def command_list(hub: Hub) -> list[dict[str, str]]:
    """The slash commands the gateway knows (as ``/help`` lists them), for clients to complete."""
    return [
        {"name": spec.name, "usage": spec.usage, "summary": spec.summary}
        for spec in hub.gateway.router
    ]


def refusal(request: Request, hub: Hub) -> JSONResponse | None:
    """``None`` if no token is configured or the request carries the hub's current one
    (never reread); else its refusal: 401, or 429 with ``Retry-After`` while its client
    address is blocked for wrong tokens."""
    try:
        if hub.access.check_bearer(request.headers, client_address(request)):
            return None
    except TooManyGuesses as blocked:
        headers = {"Retry-After": str(blocked.seconds)}
        return JSONResponse({"error": str(blocked)}, status_code=429, headers=headers)
    return JSONResponse({"error": "a valid bearer token is required"}, status_code=401)


Endpoint = Callable[[Request], Awaitable[JSONResponse]]


def _guarded(hub: Hub, endpoint: Endpoint) -> Endpoint:
    """``endpoint`` behind the bearer token (:func:`refusal`); a store that cannot serve the
    request is answered with 503 and its message."""

    async def guarded(request: Request) -> JSONResponse:
        refused = refusal(request, hub)
        if refused is not None:
            return refused
        try:
            return await endpoint(request)
        except StoreError as error:
            return JSONResponse({"error": str(error)}, status_code=503)

    return guarded


def health(hub: Hub) -> JSONResponse:
    """Whether the gateway can still be trusted with messages (see the module docstring)."""
    damage = hub.store.damaged
    if damage is None:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unhealthy", "reason": shown_to_users(damage)}, status_code=503)


def routes(hub: Hub) -> Sequence[BaseRoute]:
    """The admin routes, bound to ``hub``."""

    async def healthy(request: Request) -> JSONResponse:
        return health(hub)

    async def commands(request: Request) -> JSONResponse:
        return JSONResponse({"commands": command_list(hub)})

    async def sessions(request: Request) -> JSONResponse:
        items = [session_summary(s, hub) for _, s in hub.gateway.engine.registry.items()]
        return JSONResponse({"sessions": items})

    async def one(request: Request) -> JSONResponse:
        # taken as it is: reserved keys (a local cron job's session) are listed, so they can be
        # inspected, and an unknown key is a 404
        key = SessionKey(request.path_params["key"])
        if not await _known(hub, key):
            return JSONResponse({"error": f"no session {key!r}"}, status_code=404)
        return JSONResponse(await session_detail(hub, key))

    async def failed(request: Request) -> JSONResponse:
        return JSONResponse({"failed": [_failed(f) for f in await hub.store.failed(1000)]})

    async def retry(request: Request) -> JSONResponse:
        message_id = request.path_params["message_id"]
        if not await hub.gateway.engine.retry_failed(message_id):
            return JSONResponse({"error": f"no failed message {message_id!r}"}, status_code=404)
        return JSONResponse({"retried": message_id})

    async def deliveries(request: Request) -> JSONResponse:
        state = request.query_params.get("state", DEAD)
        if state not in (DEAD, PENDING, DELIVERED):
            error = f"state must be one of {DEAD}, {PENDING}, {DELIVERED}; not {state!r}"
            return JSONResponse({"error": error}, status_code=400)
        return JSONResponse(await ledger_listing(hub, state))

    async def redeliver(request: Request) -> JSONResponse:
        delivery_id = request.path_params["delivery_id"]
        if not await hub.store.retry_dead(delivery_id):
            return JSONResponse({"error": f"no dead delivery {delivery_id!r}"}, status_code=404)
        if hub.gateway.delivery is not None:
            hub.gateway.delivery.poke()
        return JSONResponse({"retried": delivery_id})

    return [
        Route("/health", healthy, methods=["GET"]),
        Route("/admin/deliveries", _guarded(hub, deliveries), methods=["GET"]),
        Route(
            "/admin/deliveries/{delivery_id:path}/retry",
            _guarded(hub, redeliver),
            methods=["POST"],
        ),
        Route("/admin/commands", _guarded(hub, commands), methods=["GET"]),
        Route("/admin/sessions", _guarded(hub, sessions), methods=["GET"]),
        Route("/admin/sessions/{key:path}", _guarded(hub, one), methods=["GET"]),
        Route("/admin/failed", _guarded(hub, failed), methods=["GET"]),
        Route("/admin/failed/{message_id:path}/retry", _guarded(hub, retry), methods=["POST"]),
        *admin_cron.routes(hub, lambda request: refusal(request, hub)),
    ]


def _failed(failed: FailedRecord) -> dict[str, Any]:
    record = failed.record
    return {
        "message_id": record.message_id,
        "key": record.key,
        "seq": record.seq,
        "reason": failed.reason,
        "failed_at": failed.failed_at,
        "accepted_at": record.accepted_at,
    }


LISTED_DELIVERIES = 1000
"""Most deliveries one listing shows."""


async def ledger_listing(hub: Hub, state: str) -> dict[str, Any]:
    """The ledger's counts and its deliveries in ``state``, oldest first."""
    stats = await hub.store.delivery_stats()
    listed = await hub.store.deliveries(state, LISTED_DELIVERIES)
    return {
        "stats": {
            "pending": stats.pending,
            "oldest_pending_at": stats.oldest_pending_at,
            "dead": stats.dead,
        },
        "deliveries": [delivery_summary(d) for d in listed],
    }


def delivery_summary(delivery: Delivery) -> dict[str, Any]:
    """One delivery as the admin routes show it: where it goes, how it went, what it says."""
    try:
        outbound: Outbound | None = outbound_of(delivery)
    except msgspec.DecodeError:
        outbound = None
    return {
        "id": delivery.id,
        "state": delivery.state,
        "lane": delivery.lane,
        "target": delivery.target,
        "key": outbound.session_key if outbound else None,
        "kind": outbound.kind.value if outbound else None,
        "preview": outbound.text[:PREVIEW] if outbound else None,
        "attempts": delivery.attempts,
        "uncertain": delivery.uncertain,
        "reason": delivery.reason,
        "created_at": delivery.created_at,
        "settled_at": delivery.settled_at,
    }


PREVIEW = 80
"""Characters of a delivery's text the admin routes show."""


async def _known(hub: Hub, key: SessionKey) -> bool:
    """Whether ``key`` names a session, without creating anything for an unknown one."""
    if hub.gateway.engine.registry.peek(key) is not None:
        return True
    store = hub.store
    if await store.generation(key) > 0 or await store.pending(key):
        return True
    if any(failed.record.key == key for failed in await store.failed(1000)):
        return True
    return any(summary["key"] == key for summary in await _dead_summaries(hub))


async def _dead_summaries(hub: Hub) -> list[dict[str, Any]]:
    return [delivery_summary(d) for d in await hub.store.deliveries(DEAD, LISTED_DELIVERIES)]


async def session_detail(hub: Hub, key: SessionKey) -> dict[str, Any]:
    """One session's live state, stored fields and recent transcript."""
    state = hub.gateway.engine.registry.peek(key)
    store = hub.store
    conversation = await store.conversation(key)
    transcript = await store.transcript(key, limit=20)
    return {
        "key": key,
        "live": session_summary(state, hub) if state is not None else None,
        "generation": await store.generation(key),
        "persistent": await store.load_persistent(key),
        "conversation": {
            "id": conversation.id,
            "title": conversation.title,
            "started_at": conversation.started_at,
        },
        "transcript": [
            {"role": e.role, "content": e.content, "generation": e.generation} for e in transcript
        ],
        "pending": [
            {"seq": r.seq, "message_id": r.message_id, "owner": r.owner}
            for r in await store.pending(key)
        ],
        "failed": [_failed(f) for f in await store.failed(1000) if f.record.key == key],
        "dead_deliveries": [d for d in await _dead_summaries(hub) if d["key"] == key],
    }
