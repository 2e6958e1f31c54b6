"""The access token at the edges: read once, reloaded on SIGHUP, failing closed; the Host
check on every route; /metrics behind the token."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import httpx
import msgspec
import pytest

from chatlane.config import Config, ServerConfig
from chatlane.errors import ConfigError
from chatlane.serve import configure
from tests.adapters.test_api import TOKEN, serve
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
