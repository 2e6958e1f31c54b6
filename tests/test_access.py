"""The access token at the edges: read once, reloaded on SIGHUP, failing closed; the Host
check on every route; /metrics behind the token; wrong tokens limited per client address."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import msgspec
import pytest
from starlette.applications import Starlette

from chatlane.access import (
    GUESS_WINDOW,
    GUESSES,
    AccessToken,
    GuessLimiter,
    TooManyGuesses,
    counted_address,
)
from chatlane.config import Config, Secret, ServerConfig, StoreConfig
from chatlane.errors import ConfigError
from chatlane.hub import open_hub
from chatlane.secrets import TokenSource
from chatlane.serve import add_adapters, configure, uvicorn_config
from tests.adapters.test_api import TOKEN, serve
from tests.adapters.test_web import WAIT, chat_socket, close_code, served
from tests.ports import free_port
from tests.test_operating import config_with_token
from tests.test_serve import start, stop, wait_ready

ROUTES = ("/admin/sessions", "/metrics", "/v1/models")


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_a_token_file_emptied_at_run_time_does_not_open_the_admin_routes(
    tmp_path: Path,
) -> None:
    config = config_with_token(tmp_path)
    async with serve(config) as s, httpx.AsyncClient() as client:
        (tmp_path / "token").write_text("")
        url = f"http://127.0.0.1:{s.port}"
        for route in ROUTES:
            assert (await client.get(url + route)).status_code == 401, route
            assert (await client.get(url + route, headers=bearer(TOKEN))).status_code == 200


async def test_a_token_file_removed_at_run_time_does_not_break_or_open_anything(
    tmp_path: Path,
) -> None:
    config = config_with_token(tmp_path)
    async with serve(config) as s, httpx.AsyncClient() as client:
        (tmp_path / "token").unlink()
        url = f"http://127.0.0.1:{s.port}/admin/sessions"
        assert (await client.get(url)).status_code == 401
        assert (await client.get(url, headers=bearer(TOKEN))).status_code == 200


async def test_the_host_check_applies_with_a_token(tmp_path: Path) -> None:
    async with serve(config_with_token(tmp_path)) as s, httpx.AsyncClient() as client:
        url = f"http://127.0.0.1:{s.port}"
        for route in (*ROUTES, "/"):
            headers = {**bearer(TOKEN), "Host": "rebound.example"}
            assert (await client.get(url + route, headers=headers)).status_code == 400, route
        assert (await client.get(url + "/v1/models", headers=bearer(TOKEN))).status_code == 200


async def test_allowed_hosts_are_answered_too(tmp_path: Path) -> None:
    config = config_with_token(tmp_path)
    server = msgspec.structs.replace(config.server, allowed_hosts=["chat.example"])
    async with (
        serve(msgspec.structs.replace(config, server=server)) as s,
        httpx.AsyncClient() as client,
    ):
        headers = {**bearer(TOKEN), "Host": "chat.example"}
        response = await client.get(f"http://127.0.0.1:{s.port}/v1/models", headers=headers)
        assert response.status_code == 200


async def test_metrics_need_the_token_unless_made_public(tmp_path: Path) -> None:
    config = config_with_token(tmp_path)
    async with serve(config) as s, httpx.AsyncClient() as client:
        url = f"http://127.0.0.1:{s.port}/metrics"
        refused = await client.get(url)
        assert refused.status_code == 401
        assert "chatlane_" not in refused.text
        assert (await client.get(url, headers=bearer("wrong"))).status_code == 401
        assert "chatlane_turns_started_total" in (await client.get(url, headers=bearer(TOKEN))).text
    public = msgspec.structs.replace(config.server, metrics_public=True)
    async with (
        serve(msgspec.structs.replace(config, server=public)) as s,
        httpx.AsyncClient() as client,
    ):
        assert (await client.get(f"http://127.0.0.1:{s.port}/metrics")).status_code == 200
        assert (await client.get(f"http://127.0.0.1:{s.port}/admin/sessions")).status_code == 401


def test_listening_on_every_address_needs_the_allowed_host_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CHATLANE_TOKEN", "t0ken")
    with pytest.raises(ConfigError, match=r"'server\.allowed_hosts'"):
        configure(None, host="0.0.0.0")
    monkeypatch.setenv("CHATLANE_SERVER__ALLOWED_HOSTS", '["chat.example"]')
    assert configure(None, host="0.0.0.0").server.allowed_hosts == ["chat.example"]
    assert ServerConfig(host="::").is_wildcard()
    assert not Config().server.is_wildcard()


# -- a real `chatlane serve` and SIGHUP ----------------------------------------------------


def wait_for_line(process: subprocess.Popen[str], text: str) -> None:
    """Read the process's output until a line contains ``text``."""
    assert process.stdout is not None
    for line in process.stdout:
        if text in line:
            return
    raise AssertionError(f"the server exited without printing {text!r}")


def statuses(base: str, token: str | None) -> list[int]:
    headers = bearer(token) if token is not None else {}
    return [httpx.get(base + route, headers=headers).status_code for route in ROUTES]


def signed_in(base: str, token: str) -> bool:
    response = httpx.post(base + "/", data={"token": token})
    return response.status_code == 303


@pytest.mark.slow
def test_sighup_swaps_the_token_for_every_route_and_an_empty_one_refuses_all(
    tmp_path: Path,
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("first-token")
    port = free_port()
    env = {"CHATLANE_SERVER__TOKEN__FILE": str(token_file)}
    process = start(tmp_path, "--port", str(port), "--store", "memory://", env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(process)
        assert statuses(base, "first-token") == [200, 200, 200]
        token_file.write_text("second-token")
        assert statuses(base, "first-token") == [200, 200, 200]  # read once, not per request
        process.send_signal(signal.SIGHUP)
        wait_for_line(process, "access token reloaded")
        assert statuses(base, "first-token") == [401, 401, 401]
        assert statuses(base, "second-token") == [200, 200, 200]
        assert signed_in(base, "second-token")
        assert not signed_in(base, "first-token")
        token_file.write_text("")
        process.send_signal(signal.SIGHUP)
        wait_for_line(process, "refusing all requests")
        assert statuses(base, "second-token") == [401, 401, 401]
        assert statuses(base, None) == [401, 401, 401]
        assert not signed_in(base, "second-token")
    finally:
        assert stop(process) == 0


# -- wrong tokens, limited per client address ----------------------------------------------


def test_the_limiter_lets_a_client_try_again_after_the_window() -> None:
    now = [0.0]
    limiter = GuessLimiter(attempts=2, window=60, clock=lambda: now[0], max_clients=2)
    limiter.reserve("a")
    now[0] = 10
    limiter.reserve("a")
    assert limiter.retry_after("a") == 50
    assert limiter.retry_after("b") == 0
    with pytest.raises(TooManyGuesses) as blocked:
        limiter.reserve("a")
    assert blocked.value.seconds == 50
    now[0] = 60
    assert limiter.retry_after("a") == 0  # the first failure is a window old


def test_an_attempt_is_counted_until_released() -> None:
    """Attempts reserved at once count against each other; a released one (its token was
    right) no longer counts."""
    limiter = GuessLimiter(attempts=2, window=60, clock=lambda: 0.0)
    first, second = limiter.reserve("a"), limiter.reserve("a")
    with pytest.raises(TooManyGuesses):
        limiter.reserve("a")  # both still in flight: no third is judged
    limiter.release(second)
    limiter.reserve("a")
    limiter.release(first)
    limiter.release(first)  # once is all it counts
    assert limiter.retry_after("a") == 0
    assert limiter.judge("b", b"right", lambda: "found") == "found"
    assert limiter.judge("b", b"one", lambda: None) is None
    assert limiter.judge("b", b"two", lambda: None) is None
    with pytest.raises(TooManyGuesses):
        limiter.judge("b", b"x", lambda: pytest.fail("a blocked address's token is not judged"))


def test_the_same_wrong_token_counts_once_a_window() -> None:
    """A token sent again and again (a tab holding an old one) is one count; each different
    one counts; the repeated one counts anew once its first count is a window old."""
    now = [0.0]
    limiter = GuessLimiter(attempts=3, window=60, clock=lambda: now[0])
    for _ in range(100):
        assert limiter.judge("a", b"stale", lambda: None) is None
    assert limiter.retry_after("a") == 0
    assert limiter.judge("a", b"right", lambda: "found") == "found"
    now[0] = 10
    limiter.judge("a", b"guess 1", lambda: None)
    limiter.judge("a", b"stale", lambda: None)
    assert limiter.retry_after("a") == 0
    limiter.judge("a", b"guess 2", lambda: None)
    assert limiter.retry_after("a") == 50  # three different ones; "stale" since 0
    now[0] = 60
    limiter.judge("a", b"stale", lambda: None)  # counted anew, now
    assert limiter.retry_after("a") == 10


def test_wrong_tokens_are_remembered_by_keyed_digest_within_bounds() -> None:
    """No token is kept: a digest under a key of each limiter's own; and the table holds at
    most ``max_clients`` addresses of at most ``attempts`` counts."""
    limiter = GuessLimiter(attempts=2, window=60, clock=lambda: 0.0, max_clients=3)
    assert limiter.digest(b"tok") != GuessLimiter().digest(b"tok")
    assert b"tok" not in limiter.digest(b"tok")
    for client in range(10):
        for guess in range(5):
            with contextlib.suppress(TooManyGuesses):
                limiter.judge(str(client), b"%d" % guess, lambda: None)
    assert [limiter.retry_after(str(client)) for client in range(10)] == [0] * 7 + [60] * 3


def test_nothing_is_counted_while_no_token_is_loaded(tmp_path: Path) -> None:
    """A gateway a reload locked refuses every token, and there is nothing to guess."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    access = AccessToken(TokenSource.read(Secret(file=str(token_file))))
    token_file.write_text("")
    access.reload()
    for _ in range(GUESSES + 1):
        assert not access.check_authorization(f"Bearer {TOKEN}", "203.0.113.7")
    assert access.guesses.retry_after("203.0.113.7") == 0
    assert not access.check_authorization("", "203.0.113.7")  # no token presented


@contextlib.asynccontextmanager
async def gateway(config: Config) -> AsyncIterator[str]:
    """Every route ``chatlane serve`` has (web chat, API, admin, metrics), on the hub's one
    token, served as it serves them; yields the base URL."""
    hub = await open_hub(msgspec.structs.replace(config, store=StoreConfig(url="memory://")))
    add_adapters(hub)
    async with served(hub) as host:
        yield f"http://{host}"


GUESSER = "203.0.113.7"
NEIGHBOUR = "198.51.100.2"
COMPLETION = {"model": "chatlane", "messages": [{"role": "user", "content": "hi"}], "user": "x"}
GUESSED_ROUTES = (
    ("GET", "/admin/sessions"),
    ("GET", "/admin/cron"),
    ("GET", "/metrics"),
    ("GET", "/v1/models"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/"),
)
GUESSED_AT_ONCE = 60


def sent_from(address: str, token: str) -> dict[str, str]:
    """A request's headers as a proxy uvicorn trusts (127.0.0.1) forwards them from ``address``."""
    return {"X-Forwarded-For": address, "Authorization": f"Bearer {token}"}


async def call(client: httpx.AsyncClient, route: int, headers: dict[str, str]) -> httpx.Response:
    method, path = GUESSED_ROUTES[route % len(GUESSED_ROUTES)]
    body = COMPLETION if method == "POST" else None
    return await client.request(method, path, json=body, headers=headers)


async def test_wrong_bearer_tokens_sent_at_once_block_their_address_on_every_route(
    tmp_path: Path,
) -> None:
    """Sixty wrong bearer tokens from one address at once, spread over the routes that take
    the token: five are judged (401), the rest get 429; then the address's right token is not
    judged either, while every other address's still works."""
    async with (
        gateway(config_with_token(tmp_path)) as base,
        httpx.AsyncClient(base_url=base) as client,
        asyncio.timeout(WAIT * 3),
    ):
        answers = await asyncio.gather(
            *(call(client, n, sent_from(GUESSER, f"guess {n}")) for n in range(GUESSED_AT_ONCE))
        )
        statuses = sorted(answer.status_code for answer in answers)
        assert statuses == [401] * GUESSES + [429] * (GUESSED_AT_ONCE - GUESSES)
        for answer in answers:
            if answer.status_code == 429:
                assert 0 < int(answer.headers["retry-after"]) <= GUESS_WINDOW
        for route in range(len(GUESSED_ROUTES)):
            refused = await call(client, route, sent_from(GUESSER, TOKEN))
            assert refused.status_code == 429, GUESSED_ROUTES[route]
            assert 0 < int(refused.headers["retry-after"]) <= GUESS_WINDOW
        completion = await call(client, 4, sent_from(GUESSER, TOKEN))
        assert completion.json()["error"]["code"] == "too_many_wrong_tokens"
        # naming another address first changes nothing: the proxy appends the one it saw
        spoofed = sent_from(f"{NEIGHBOUR}, {GUESSER}", TOKEN)
        assert (await client.get("/v1/models", headers=spoofed)).status_code == 429
        for route in range(len(GUESSED_ROUTES)):
            answered = await call(client, route, sent_from(NEIGHBOUR, TOKEN))
            assert answered.status_code == 200, GUESSED_ROUTES[route]
        assert (
            await client.get("/v1/models", headers={"X-Forwarded-For": GUESSER})
        ).status_code == 401


def test_a_proxy_elsewhere_is_trusted_through_forwarded_allow_ips(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What docs/security.md tells an operator whose proxy runs on another host."""
    monkeypatch.delenv("FORWARDED_ALLOW_IPS", raising=False)
    default = uvicorn_config(Starlette(), Config())
    assert default.proxy_headers
    assert default.forwarded_allow_ips == "127.0.0.1,::1"
    monkeypatch.setenv("FORWARDED_ALLOW_IPS", "10.0.0.5,10.1.0.0/16")
    assert uvicorn_config(Starlette(), Config()).forwarded_allow_ips == "10.0.0.5,10.1.0.0/16"


async def test_credentials_of_another_scheme_are_no_guesses(tmp_path: Path) -> None:
    """The ``Basic`` credentials a proxy's own password check forwards on every request (the
    WebSocket handshake too), and an empty bearer token, present no token: refused, never
    counted, so the address's right token is still served everywhere."""
    basic = {"X-Forwarded-For": GUESSER, "Authorization": "Basic dXNlcjpwYXNz"}
    empty = {"X-Forwarded-For": GUESSER, "Authorization": "Bearer"}
    async with (
        gateway(config_with_token(tmp_path)) as base,
        httpx.AsyncClient(base_url=base) as client,
    ):
        host = base.removeprefix("http://")
        for headers in (basic, empty):
            for route in range(len(GUESSED_ROUTES) * (GUESSES + 1)):
                assert (await call(client, route, headers)).status_code == 401
        for _ in range(GUESSES + 1):
            async with chat_socket(host, None, **basic) as ws:
                assert await close_code(ws) == 4401
        for route in range(len(GUESSED_ROUTES)):
            answered = await call(client, route, sent_from(GUESSER, TOKEN))
            assert answered.status_code == 200, GUESSED_ROUTES[route]


async def test_a_stale_token_sent_again_and_again_blocks_no_one(tmp_path: Path) -> None:
    """A script still sending the old token: a hundred requests (at once, over every route)
    cost its address one guess, so the right token is served from there; four different
    wrong ones then make five, and the address is blocked for every token, the stale one
    and the right one included."""
    async with (
        gateway(config_with_token(tmp_path)) as base,
        httpx.AsyncClient(base_url=base) as client,
        asyncio.timeout(WAIT * 3),
    ):
        stale = sent_from(GUESSER, "the old token")
        answers = await asyncio.gather(*(call(client, n, stale) for n in range(100)))
        assert {answer.status_code for answer in answers} == {401}
        for route in range(len(GUESSED_ROUTES)):
            answered = await call(client, route, sent_from(GUESSER, TOKEN))
            assert answered.status_code == 200, GUESSED_ROUTES[route]
        for guess in range(GUESSES - 1):
            assert (
                await call(client, guess, sent_from(GUESSER, f"guess {guess}"))
            ).status_code == 401
        for headers in (stale, sent_from(GUESSER, TOKEN), sent_from(GUESSER, "guess 0")):
            assert (await call(client, 3, headers)).status_code == 429


def test_ipv6_addresses_are_counted_by_their_64_block() -> None:
    """A host or home is given a whole ``/64``: its addresses share one count. IPv4, the
    IPv6 addresses that stand for one IPv4 client each (mapped, NAT64, Teredo), link-local
    ones and what is no address keep their own."""
    assert counted_address("2001:db8:1:2::7") == "2001:db8:1:2::/64"
    assert counted_address("2001:db8:1:2:ffff:1:2:3") == "2001:db8:1:2::/64"
    assert counted_address("2001:db8:1:3::7") == "2001:db8:1:3::/64"
    assert counted_address("::ffff:203.0.113.7") == GUESSER == counted_address(GUESSER)
    # one IPv4 client each, whatever /64 they share: NAT64 (RFC 6052), Teredo
    assert counted_address("64:ff9b::cb00:7107") == GUESSER
    assert counted_address("64:ff9b::c633:6402") == NEIGHBOUR
    teredo = "2001:0:4136:e378:8000:63bf:3fff:fdd2"  # RFC 4380's example: 192.0.2.45
    assert counted_address(teredo) == "192.0.2.45"
    # link-local: every link's hosts share fe80::/64; each counts alone
    assert counted_address("fe80::1%eth0") == "fe80::1%eth0"
    assert counted_address("fe80::1%eth1") != counted_address("fe80::1%eth0")
    for other in ("testclient", "", "/run/chatlane.sock", "not:an:address"):
        assert counted_address(other) == other


async def test_a_guesser_behind_nat64_blocks_no_other_translated_client(tmp_path: Path) -> None:
    """Behind a NAT64 translator (the well-known prefix) every IPv4 client shares one ``/64``:
    five wrong tokens from one of them block that client only."""
    async with (
        gateway(config_with_token(tmp_path)) as base,
        httpx.AsyncClient(base_url=base) as client,
    ):
        for guess in range(GUESSES):
            guessed = sent_from("64:ff9b::cb00:7107", f"guess {guess}")
            assert (await call(client, guess, guessed)).status_code == 401
        assert (await call(client, 0, sent_from("64:ff9b::cb00:7107", TOKEN))).status_code == 429
        assert (await call(client, 0, sent_from("64:ff9b::c633:6402", TOKEN))).status_code == 200


async def test_guesses_from_one_ipv6_block_count_together(tmp_path: Path) -> None:
    """Five wrong tokens, each from another address of one ``/64``, block the whole block,
    the right token included; the next block is served."""
    block = "2001:db8:1:2::"
    async with (
        gateway(config_with_token(tmp_path)) as base,
        httpx.AsyncClient(base_url=base) as client,
    ):
        for guess in range(GUESSES):
            guessed = sent_from(f"{block}{guess + 1:x}", f"guess {guess}")
            assert (await call(client, guess, guessed)).status_code == 401
        refused = await call(client, 0, sent_from(f"{block}abcd:1", TOKEN))
        assert refused.status_code == 429
        for route in range(len(GUESSED_ROUTES)):
            answered = await call(client, route, sent_from("2001:db8:1:3::1", TOKEN))
            assert answered.status_code == 200, GUESSED_ROUTES[route]
