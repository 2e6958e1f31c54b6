"""The ASGI layers of ``chatlane serve``'s app: one ``Host`` check, and a router that
finds a static path's route without scanning the others.

What stays true:

* :class:`HostCheck` answers exactly as Starlette's ``TrustedHostMiddleware``
  does (it runs it): a request addressed to a name not allowed gets 400. It
  remembers the ``Host`` values it admitted (at most :data:`REMEMBERED`), so a
  request for one of those skips the parsing; a refused value is never
  remembered, and is checked again every time.
* :class:`DirectRouter` sends a request to the route Starlette's router would
  choose. For a path without parameters, and a method its route takes, that
  route is found in one look-up, if no route before it takes the same request
  (checked when the router is built); every other request is routed by
  Starlette, in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.routing import BaseRoute, Match, Mount, Route, Router, WebSocketRoute
from starlette.types import ASGIApp, Receive, Scope, Send

REMEMBERED = 64
"""``Host`` values :class:`HostCheck` remembers as admitted (the configured names, with
ports); beyond them, every request is checked in full."""

_CHECKED = frozenset({"http", "websocket"})


class HostCheck:
    """Answer only requests addressed to an allowed name (see the module docstring)."""

    def __init__(self, app: ASGIApp, allowed_hosts: Sequence[str]) -> None:
        self.app = app
        self._check = TrustedHostMiddleware(self._admit, allowed_hosts=list(allowed_hosts))
        self._admitted: set[bytes] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in _CHECKED and _host(scope) not in self._admitted:
            await self._check(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _admit(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The full check admitted the request: remember its ``Host``, run the app."""
        host = _host(scope)
        if host is not None and len(self._admitted) < REMEMBERED:
            self._admitted.add(host)
        await self.app(scope, receive, send)


def _host(scope: Scope) -> bytes | None:
    """The first ``Host`` header's value, as sent (the one Starlette reads)."""
    for name, value in scope["headers"]:
        if name == b"host":
            return value  # type: ignore[no-any-return]
    return None


class DirectRouter(Router):
    """Starlette's router, with a table of the static routes it may take at once.

    Built once from its routes: a route added later is found by scanning.
    """

    def __init__(self, routes: Sequence[BaseRoute], **options: Any) -> None:
        super().__init__(list(routes), **options)
        self._direct = direct_routes(self.routes)

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not scope.get("root_path"):
            route = self._direct.get((scope["path"], scope["method"]))
            if route is not None:
                scope.setdefault("router", self)
                scope["route"] = route
                scope["endpoint"] = route.endpoint
                scope["path_params"] = dict(scope.get("path_params", {}))
                await route.handle(scope, receive, send)
                return
        await super().app(scope, receive, send)


def direct_routes(routes: Sequence[BaseRoute]) -> dict[tuple[str, str], Route]:
    """``(path, method)`` → the route the router takes for it, for every static path.

    A route is listed only if no route before it takes the same request; the
    table stops at the first route whose matching it cannot foresee (one that
    is neither a ``Route``, a ``Mount`` nor a ``WebSocketRoute``).
    """
    table: dict[tuple[str, str], Route] = {}
    for index, route in enumerate(routes):
        if not isinstance(route, Route | Mount | WebSocketRoute):
            break
        if not isinstance(route, Route) or route.param_convertors or not route.methods:
            continue
        for method in route.methods:
            key = (route.path, method)
            if key not in table and not _taken_before(routes[:index], *key):
                table[key] = route
    return table


def _taken_before(earlier: Sequence[BaseRoute], path: str, method: str) -> bool:
    scope = {"type": "http", "path": path, "root_path": "", "method": method, "headers": []}
    return any(route.matches(scope)[0] is Match.FULL for route in earlier)


class App(Starlette):
    """A Starlette app whose router is a :class:`DirectRouter`."""

    def __init__(self, routes: Sequence[BaseRoute], **options: Any) -> None:
        super().__init__(routes=routes, **options)
        self.router = DirectRouter(routes, lifespan=options.get("lifespan"))


__all__ = ["REMEMBERED", "App", "DirectRouter", "HostCheck", "direct_routes"]
