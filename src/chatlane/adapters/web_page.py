"""The web chat's HTTP side: the page, the browser's identity cookie and the access gate.

What stays true:

* A browser that loads ``/`` carries a random id, signed by the server
  (:mod:`chatlane.adapters.web_ids`), in an HttpOnly, SameSite=Lax cookie
  (:data:`IDENTITY_COOKIE`). That id is its chat id and its user id, so one
  browser is one session, shared by its tabs, and no page script, other site
  or client can read, choose or invent it. A cookie is a signed id byte for
  byte or no id at all.
* When an access token is configured, neither the page nor the WebSocket is
  served without it. ``/?token=…`` trades the token for an HttpOnly cookie that
  holds a proof derived from it (never the token itself) and redirects to ``/``
  so the token leaves the address bar. Every comparison is constant-time.
* The page is plain HTML, CSS and JavaScript shipped inside the package: no
  build step, nothing fetched from another origin (the Content-Security-Policy
  says so).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from pathlib import Path

from starlette.requests import HTTPConnection, Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from chatlane.adapters.web_ids import IDENTITY_COOKIE as IDENTITY_COOKIE
from chatlane.adapters.web_ids import BrowserIds

AUTH_COOKIE = "chatlane_web_auth"
"""Holds a proof of the access token, set after ``/?token=…``."""
IDENTITY_MAX_AGE = 400 * 24 * 3600
AUTH_MAX_AGE = 30 * 24 * 3600
STATIC_DIR = Path(__file__).with_name("static")

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _same(given: str, expected: str) -> bool:
    """Constant-time equality that accepts any Unicode (``compare_digest`` wants ASCII str)."""
    return hmac.compare_digest(given.encode("utf-8", "replace"), expected.encode("utf-8"))


class Gate:
    """Admits a connection when no token is configured, or when it presents the token."""

    def __init__(self, token: str) -> None:
        self._token = token
        digest = hmac.new(token.encode(), b"chatlane web session", hashlib.sha256)
        self._proof = digest.hexdigest() if token else ""

    @property
    def required(self) -> bool:
        """Whether a token must be presented."""
        return bool(self._token)

    def admits(self, connection: HTTPConnection) -> bool:
        """The auth cookie holds the token's proof, or ``?token=`` is the token."""
        if not self._token:
            return True
        return _same(connection.cookies.get(AUTH_COOKIE, ""), self._proof) or self.token_given(
            connection
        )

    def token_given(self, connection: HTTPConnection) -> bool:
        """``?token=`` is present and right."""
        given = connection.query_params.get("token")
        return given is not None and bool(self._token) and _same(given, self._token)

    def remember(self, response: Response) -> None:
        """Set the auth cookie, so later requests need no ``?token=``."""
        response.set_cookie(
            AUTH_COOKIE, self._proof, max_age=AUTH_MAX_AGE, httponly=True, samesite="lax"
        )


class WebPage:
    """``/`` (the chat page or the sign-in page) and ``/web/static/…`` (its assets)."""

    def __init__(self, gate: Gate, ids: BrowserIds) -> None:
        self.gate = gate
        self.ids = ids
        self._index = (STATIC_DIR / "index.html").read_text(encoding="utf-8")

    def routes(self) -> Sequence[BaseRoute]:
        """The page's HTTP routes."""
        return [
            Route("/", self.index, methods=["GET"]),
            Mount("/web/static", StaticFiles(directory=STATIC_DIR), name="web-static"),
        ]

    async def index(self, request: Request) -> Response:
        """The chat page; a valid ``?token=`` is traded for a cookie first."""
        if not self.gate.admits(request):
            return sign_in_page(wrong="token" in request.query_params)
        response: Response
        if self.gate.token_given(request):
            response = RedirectResponse("/", status_code=303, headers=SECURITY_HEADERS)
            self.gate.remember(response)
        else:
            response = HTMLResponse(self._index, headers=SECURITY_HEADERS)
        if self.ids.read(request) is None:
            response.set_cookie(
                IDENTITY_COOKIE,
                self.ids.issue(),
                max_age=IDENTITY_MAX_AGE,
                httponly=True,
                samesite="lax",
            )
        return response


_SIGN_IN = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<link rel="stylesheet" href="/web/static/app.css">
<title>chatlane — sign in</title>
</head>
<body class="sign-in">
<main>
<h1>chatlane</h1>
<p>This chat needs an access token.</p>
{error}
<form method="get" action="/">
<label for="token">Access token</label>
<input id="token" name="token" type="password" autocomplete="current-password" required>
<button type="submit">Sign in</button>
</form>
</main>
</body>
</html>
"""


def sign_in_page(*, wrong: bool) -> HTMLResponse:
    """The 401 page: a form that sends the token as ``?token=``."""
    error = '<p class="error" role="alert">That token is not right.</p>' if wrong else ""
    return HTMLResponse(_SIGN_IN.format(error=error), status_code=401, headers=SECURITY_HEADERS)
