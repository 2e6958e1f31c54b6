"""The web chat's HTTP side: the page, the browser's identity cookie and the access gate.

What stays true:

* A browser that loads ``/`` carries a random id, signed by the server
  (:mod:`chatlane.adapters.web_ids`), in an HttpOnly, SameSite=Lax cookie
  (:data:`IDENTITY_COOKIE`), marked ``Secure`` when the page was reached over
  HTTPS, as the sign-in cookie is (:func:`over_https`) — one given over plain
  HTTP before is set again, the same id, marked ``Secure``. That id is its chat id
  and its user id, so one browser is one session, shared by its tabs, and no
  page script, other site or client can read, choose or invent it. A cookie
  is a signed id byte for byte or no id at all.
* When an access token is configured, neither the page, its scripts nor the
  WebSocket is served without a sign-in: of ``/web/static/…``, only the
  stylesheet the sign-in page uses is (:data:`PUBLIC_ASSETS`). The sign-in
  form *posts* the token (it never appears in a URL); a right one gets a
  per-browser HttpOnly cookie that expires (:class:`Gate`). Wrong tokens,
  posted or sent as a bearer token, are limited per client address with the
  token's own count (:class:`~chatlane.access.GuessLimiter`, shared by every
  route): a posted one is counted before its form is read, so sign-ins sent
  at once are counted together, and uncounted if the form posts no token (a
  body that is no form, or is over :data:`MAX_FORM_BYTES`, is not counted at
  all). Every comparison is constant-time.
* The page is plain HTML, CSS and JavaScript shipped inside the package, with
  its Markdown libraries vendored under ``static/vendor``: no build step,
  nothing fetched from another origin (the Content-Security-Policy says so).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import secrets
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from starlette.requests import HTTPConnection, Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

from chatlane.access import AccessToken, Attempt, TooManyGuesses, client_address
from chatlane.adapters.web_ids import IDENTITY_COOKIE as IDENTITY_COOKIE
from chatlane.adapters.web_ids import BrowserIds

AUTH_COOKIE = "chatlane_web_auth"
"""Holds the browser's sign-in: an expiry and a nonce, signed with the token's key."""
SIGN_IN_PURPOSE = b"chatlane web sign-in"
IDENTITY_MAX_AGE = 400 * 24 * 3600
AUTH_MAX_AGE = 7 * 24 * 3600
MAX_FORM_BYTES = 4096
STATIC_DIR = Path(__file__).with_name("static")
PUBLIC_ASSETS = frozenset({"app.css"})
"""The files of :data:`STATIC_DIR` served without a sign-in: the sign-in page's stylesheet."""

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


class Gate:
    """Admits a connection when no token is required, or when it is signed in.

    A sign-in is a cookie of its own per browser: a random nonce and an expiry,
    signed with a key derived from the access token. It is no function of the
    token alone, it ends at its expiry, and a token reload ends every sign-in.
    Scripts may instead send ``Authorization: Bearer <token>``.

    :param access: the gateway's token (the hub's, so a reload reaches the web chat).
    :param ttl: seconds a sign-in lasts.
    :param clock: wall-clock seconds (the expiry is written into the cookie).
    """

    def __init__(
        self,
        access: AccessToken,
        *,
        ttl: int = AUTH_MAX_AGE,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._access = access
        self.ttl = ttl
        self._clock = clock

    @property
    def required(self) -> bool:
        """Whether a token must be presented."""
        return self._access.required

    def admits(self, connection: HTTPConnection) -> bool:
        """No token is required, the sign-in cookie is valid, or the bearer token is right
        (a wrong one counts against the connection's client address).

        :raises TooManyGuesses: for a bearer token from an address that is blocked (a
            valid sign-in cookie is admitted all the same).
        """
        if not self._access.required:
            return True
        if self._valid(connection.cookies.get(AUTH_COOKIE, "")):
            return True
        return self._access.check_bearer(connection.headers, client_address(connection))

    def attempt(self, client: str) -> Attempt:
        """Count a sign-in of ``client``'s as a wrong token before its form is read (it may
        take a while to arrive); :meth:`sign_in` uncounts it if the form posts no token or
        the right one, and a form that never arrives stays counted.

        :raises TooManyGuesses: while ``client`` may not try.
        """
        return self._access.guesses.reserve(client)

    def sign_in(self, attempt: Attempt, token: bytes) -> str | None:
        """A fresh sign-in cookie value if ``token`` is right, else ``None`` (``attempt``
        then stays counted, unless ``token`` is empty: no token, no guess)."""
        if not self._access.settle(attempt, token, self._access.matches(token)):
            return None
        expires = int(self._clock()) + self.ttl
        payload = f"{expires}.{secrets.token_urlsafe(18)}"
        return f"{payload}.{self._signature(payload)}"

    def remember(self, response: Response, cookie: str, *, secure: bool) -> None:
        """Set the sign-in cookie (``Secure`` when the page was reached over HTTPS)."""
        response.set_cookie(
            AUTH_COOKIE, cookie, max_age=self.ttl, httponly=True, samesite="lax", secure=secure
        )

    def _valid(self, cookie: str) -> bool:
        payload, _, signature = cookie.rpartition(".")
        expires, _, nonce = payload.partition(".")
        if not (_EXPIRY.fullmatch(expires) and nonce and int(expires) > self._clock()):
            return False  # an expiry of ASCII digits only, of a size a clock reads
        expected = self._signature(payload)
        return bool(expected) and hmac.compare_digest(signature.encode(), expected.encode())

    def _signature(self, payload: str) -> str:
        """HMAC-SHA256 of ``payload`` under the current token's key; ``""`` while it has none."""
        key = self._access.derive(SIGN_IN_PURPOSE)
        if key is None:
            return ""
        return hmac.new(key, payload.encode(), hashlib.sha256).hexdigest()


_EXPIRY = re.compile(r"[0-9]{1,15}")
"""A sign-in cookie's expiry: whole seconds of the epoch (``²`` or a 5,000-digit number is
no expiry)."""


class SignedInAssets:
    """The page's files under ``/web/static``, served to whom :class:`Gate` admits (a
    browser that signed in, a right bearer token), and :data:`PUBLIC_ASSETS` to anyone.

    Anyone else gets 401 (429 for a bearer token from a blocked address), whatever
    the path: nothing is looked up for them.
    """

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self._files = StaticFiles(directory=STATIC_DIR)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = self._refusal(scope)
        if refusal is None:
            await self._files(scope, receive, send)
        else:
            await refusal(scope, receive, send)

    def _refusal(self, scope: Scope) -> Response | None:
        """Why the request is not served, as the response; ``None`` to serve it."""
        if self._files.get_path(scope) in PUBLIC_ASSETS:
            return None
        try:
            if self.gate.admits(HTTPConnection(scope)):
                return None
        except TooManyGuesses as blocked:
            headers = {**SECURITY_HEADERS, "Retry-After": str(blocked.seconds)}
            return PlainTextResponse(f"{blocked}\n", status_code=429, headers=headers)
        text = "sign in first: load / and give the access token\n"
        return PlainTextResponse(text, status_code=401, headers=SECURITY_HEADERS)


class WebPage:
    """``/`` (the chat page or the sign-in page), ``POST /`` (signing in) and
    ``/web/static/…`` (the page's assets, behind the sign-in: :class:`SignedInAssets`)."""

    def __init__(self, gate: Gate, ids: BrowserIds) -> None:
        self.gate = gate
        self.ids = ids
        self._index = (STATIC_DIR / "index.html").read_text(encoding="utf-8")

    def routes(self) -> Sequence[BaseRoute]:
        """The page's HTTP routes."""
        return [
            Route("/", self.index, methods=["GET"]),
            Route("/", self.sign_in, methods=["POST"]),
            Mount("/web/static", SignedInAssets(self.gate), name="web-static"),
        ]

    async def index(self, request: Request) -> Response:
        """The chat page, or the sign-in page until the browser signed in: 401, or 429 for a
        bearer token from an address blocked for wrong tokens."""
        try:
            if not self.gate.admits(request):
                return sign_in_page()
        except TooManyGuesses as blocked:
            return sign_in_page(retry_after=blocked.retry_after)
        return self._with_identity(request, HTMLResponse(self._index, headers=SECURITY_HEADERS))

    async def sign_in(self, request: Request) -> Response:
        """Trade a posted token for a sign-in cookie; wrong tokens are limited per client
        address, each counted before its form is read."""
        if not _same_origin(request):
            return PlainTextResponse("cross-origin sign-in refused", status_code=403)
        if not may_post_token(request):
            return sign_in_page()  # no form to read a token from: nothing guessed
        try:
            attempt = self.gate.attempt(client_address(request))
        except TooManyGuesses as blocked:
            return sign_in_page(retry_after=blocked.retry_after)
        token = await posted_token(request)
        cookie = self.gate.sign_in(attempt, token)
        if cookie is None:
            return sign_in_page(wrong=bool(token))
        response = RedirectResponse("/", status_code=303, headers=SECURITY_HEADERS)
        self.gate.remember(response, cookie, secure=over_https(request))
        return self._with_identity(request, response)

    def _with_identity(self, request: Request, response: Response) -> Response:
        """``response``, giving the browser a signed identity cookie if it has none
        (``Secure`` when the page was reached over HTTPS, as the sign-in cookie), and over
        HTTPS the one it has again, the same id, marked ``Secure``.

        A browser never says which flags the cookie it sends was set with, so one set
        over plain HTTP (before the page moved behind HTTPS) is set again on every page
        reached over HTTPS: the same value each time, so nothing changes but the flag
        and the expiry, 400 days from then."""
        bid = self.ids.read(request)
        secure = over_https(request)
        if bid is None or secure:
            value = self.ids.issue() if bid is None else self.ids.signed(bid)
            response.set_cookie(
                IDENTITY_COOKIE,
                value,
                max_age=IDENTITY_MAX_AGE,
                httponly=True,
                samesite="lax",
                secure=secure,
            )
        return response


def over_https(request: Request) -> bool:
    """Whether the page was reached over HTTPS (behind a proxy uvicorn trusts, as its
    ``X-Forwarded-Proto`` says): the browser's cookies are then marked ``Secure``, so it
    never sends them over plain HTTP."""
    return request.url.scheme == "https"


def _same_origin(request: Request) -> bool:
    """Not posted by another site's page.

    Browsers say where a request comes from in ``Sec-Fetch-Site``; without it,
    an ``Origin`` must be the page's own host. ``Origin: null`` is what the
    page's own form sends under ``Referrer-Policy: no-referrer``, so it is
    judged by ``Sec-Fetch-Site`` alone. A client that sends neither is not a browser.
    """
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        return site in ("same-origin", "none")
    origin = request.headers.get("origin")
    return origin in (None, "null") or origin_host(origin) == request.headers.get("host")


def origin_host(origin: str) -> str | None:
    """The host (and port) an ``Origin`` header names; None for one that is no URL (a
    bracket left open, a port of letters), which matches no host."""
    try:
        return urlsplit(origin).netloc
    except ValueError:
        return None


def may_post_token(request: Request) -> bool:
    """Whether ``request``'s headers allow a token in its body: a form
    (``application/x-www-form-urlencoded``) not declared longer than :data:`MAX_FORM_BYTES`.
    Any other sign-in posts no token, so it is neither read nor counted."""
    kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    length = request.headers.get("content-length", "")
    too_long = length.isascii() and length.isdigit() and int(length) > MAX_FORM_BYTES
    return kind == "application/x-www-form-urlencoded" and not too_long


async def posted_token(request: Request) -> bytes:
    """The ``token`` field of a form post of at most :data:`MAX_FORM_BYTES`; ``b""`` otherwise
    (an empty field, no such field, a longer form, a form's content type missing)."""
    if not may_post_token(request):
        return b""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            return b""
    fields = parse_qs(body.decode("latin-1"), encoding="utf-8", errors="replace")
    return fields.get("token", [""])[0].encode("utf-8")


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
<form method="post" action="/">
<label for="token">Access token</label>
<input id="token" name="token" type="password" autocomplete="current-password" required>
<button type="submit">Sign in</button>
</form>
</main>
</body>
</html>
"""


def sign_in_page(*, wrong: bool = False, retry_after: float = 0.0) -> HTMLResponse:
    """The sign-in form (posting the token): 401, or 429 with ``Retry-After`` while limited."""
    if retry_after > 0:
        seconds = math.ceil(retry_after)
        text = f"Too many wrong tokens: try again in {seconds} s."
        error = f'<p class="error" role="alert">{text}</p>'
        headers = {**SECURITY_HEADERS, "Retry-After": str(seconds)}
        return HTMLResponse(_SIGN_IN.format(error=error), status_code=429, headers=headers)
    error = '<p class="error" role="alert">That token is not right.</p>' if wrong else ""
    return HTMLResponse(_SIGN_IN.format(error=error), status_code=401, headers=SECURITY_HEADERS)
