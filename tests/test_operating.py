"""Operating a running gateway: chatlane sessions, chatlane inspect, /metrics, admin auth."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from chatlane.cli import main
from chatlane.config import Config, Secret, ServerConfig
from chatlane.stores import sqlite_writer
from tests.adapters.test_api import TOKEN, serve
from tests.keys import chat_key


def config_with_token(tmp_path: Path) -> Config:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    return Config(server=ServerConfig(token=Secret(file=str(token_file))))


async def run_cli(*args: str) -> tuple[int, str]:
    result = await asyncio.to_thread(CliRunner().invoke, main, list(args))
    return result.exit_code, result.output


async def test_sessions_and_inspect_read_the_running_gateway(tmp_path: Path) -> None:
    async with serve(config_with_token(tmp_path)) as s:
        await s.client.chat.completions.create(
            model="chatlane", messages=[{"role": "user", "content": "hello"}], user="op:1"
        )
        url = f"http://127.0.0.1:{s.port}"
        code, listing = await run_cli("sessions", "--url", url, "--token", TOKEN)
        assert code == 0
        assert "main:api:dm:op%3A1" in listing
        assert "idle" in listing
        code, detail = await run_cli(
            "inspect", "main:api:dm:op%3A1", "--url", url, "--token", TOKEN
        )
        assert code == 0
        assert "state         idle, generation 1, 0 queued" in detail
        assert "  assistant: echo: hello" in detail
        code, detail = await run_cli(
            "inspect", "main:api:dm:op%3A1", "--json", "--url", url, "--token", TOKEN
        )
        assert code == 0
        assert json.loads(detail)["transcript"][1]["content"] == "echo: hello"
        assert '"generation": 1' in detail


async def test_admin_and_cli_need_the_token(tmp_path: Path) -> None:
    async with serve(config_with_token(tmp_path)) as s:
        url = f"http://127.0.0.1:{s.port}"
        async with httpx.AsyncClient() as client:
            assert (await client.get(url + "/admin/sessions")).status_code == 401
        code, output = await run_cli("sessions", "--url", url, "--token", "wrong")
        assert code == 1
        assert "HTTP 401" in output


async def test_cli_says_when_the_gateway_is_unreachable() -> None:
    code, output = await run_cli("sessions", "--url", "http://127.0.0.1:9")
    assert code == 1
    assert output.startswith("Error: cannot reach the gateway at http://127.0.0.1:9")


async def test_metrics_count_turns_and_busy_outcomes(tmp_path: Path) -> None:
    async with serve(config_with_token(tmp_path)) as s:
        for text in ("hello", "/busy reject"):
            await s.client.chat.completions.create(
                model="chatlane", messages=[{"role": "user", "content": text}], user="m"
            )
        async with httpx.AsyncClient() as client:
            headers = {"Authorization": f"Bearer {TOKEN}"}
            url = f"http://127.0.0.1:{s.port}/metrics"
            text = (await client.get(url, headers=headers)).text
        assert "chatlane_turns_started_total 1" in text
        assert 'chatlane_turns_finished_total{outcome="answered"} 1' in text
        assert 'chatlane_turn_duration_seconds_bucket{le="+Inf"} 1' in text
        assert "chatlane_queue_depth 0" in text
        assert "chatlane_messages_taken_back_total 0" in text
        assert 'python_gc_collections_total{generation="2"} ' in text
        assert "python_gc_frozen_objects " in text


async def metrics_text(port: int) -> str:
    async with httpx.AsyncClient() as client:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        return (await client.get(f"http://127.0.0.1:{port}/metrics", headers=headers)).text


async def test_metrics_show_where_sqlite_ran_a_turns_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_writer, "PAUSE_AFTER_SLOW", 0.0)  # load slows no later write
    store = f"sqlite:///{tmp_path / 'chatlane.db'}"
    async with serve(config_with_token(tmp_path), store=store) as s:
        await s.client.chat.completions.create(
            model="chatlane", messages=[{"role": "user", "content": "hello"}], user="m"
        )
        lines = dict(line.rsplit(" ", 1) for line in (await metrics_text(s.port)).splitlines())
    assert int(lines['chatlane_sqlite_transactions_total{thread="loop"}']) >= 2  # a turn's two
    assert int(lines['chatlane_sqlite_transactions_total{thread="writer"}']) >= 1  # the heartbeat
    assert lines["chatlane_sqlite_handed_over_total"] == "0"
    assert lines['chatlane_sqlite_lock_waits_total{side="waited"}'] == "0"  # no other process
    assert lines['chatlane_sqlite_lock_waits_total{side="let_in"}'] == "0"
    assert lines['chatlane_sqlite_checkpoints_total{kind="beside"}'] == "0"
    assert lines['chatlane_sqlite_checkpoints_total{kind="held"}'] == "0"


async def test_metrics_of_a_store_without_counters_leave_them_out(tmp_path: Path) -> None:
    async with serve(config_with_token(tmp_path)) as s:
        assert "chatlane_sqlite" not in await metrics_text(s.port)


async def test_without_a_token_only_loopback_names_are_answered(tmp_path: Path) -> None:
    async with serve(Config()) as s, httpx.AsyncClient() as client:
        url = f"http://127.0.0.1:{s.port}/admin/sessions"
        assert (await client.get(url)).status_code == 200
        rebound = await client.get(url, headers={"Host": f"evil.example:{s.port}"})
        assert rebound.status_code == 400


async def test_inspecting_an_unknown_key_creates_nothing(tmp_path: Path) -> None:
    async with serve(config_with_token(tmp_path)) as s:
        url = f"http://127.0.0.1:{s.port}"
        code, output = await run_cli(
            "inspect", "main:api:dm:nobody", "--url", url, "--token", TOKEN
        )
        assert code == 1
        assert "HTTP 404" in output
        assert await s.hub.store.generation(chat_key("nobody", "api")) == 0
        async with httpx.AsyncClient() as client:
            lower = await client.get(
                url + "/admin/sessions", headers={"Authorization": f"bearer {TOKEN}"}
            )
            assert lower.status_code == 200


async def test_failed_messages_are_listed_and_run_again_by_the_operator(tmp_path: Path) -> None:
    from chatlane.identity import SessionSource
    from chatlane.stores.codec import encode_message
    from chatlane.types import InboundMessage

    async with serve(config_with_token(tmp_path)) as s:
        store, key = s.hub.store, chat_key("op", "api")
        message = InboundMessage(SessionSource("api", chat_id="op", user_id="op"), "hello again")
        seq = await store.enqueue(key, message.id, "a-process", encode_message(message))
        await store.park(key, [seq], "its turn lost its lease 3 times")
        url = f"http://127.0.0.1:{s.port}"
        code, listing = await run_cli("failed", "--url", url, "--token", TOKEN)
        assert code == 0
        assert f"{message.id}  {key}  its turn lost its lease 3 times" in listing
        code, detail = await run_cli("inspect", key, "--url", url, "--token", TOKEN)
        assert f"failed        1\n  {message.id}: its turn lost its lease 3 times\n" in detail
        code, detail = await run_cli("inspect", key, "--json", "--url", url, "--token", TOKEN)
        assert '"reason": "its turn lost its lease 3 times"' in detail
        code, output = await run_cli("retry", message.id, "--url", url, "--token", TOKEN)
        assert (code, output) == (0, f"{message.id} is queued again\n")
        await asyncio.wait_for(s.hub.gateway.engine.wait_idle(), 10)
        assert [e.content for e in await store.transcript(key)] == [
            "hello again",
            "echo: hello again",
        ]
        assert await store.failed() == []
        code, output = await run_cli("retry", message.id, "--url", url, "--token", TOKEN)
        assert code == 1
        assert "HTTP 404" in output
        code, listing = await run_cli("failed", "--url", url, "--token", TOKEN)
        assert listing == "no failed messages\n"


async def test_dead_deliveries_are_listed_inspected_and_sent_again(tmp_path: Path) -> None:
    from chatlane.delivery import draft_of
    from chatlane.stores import Settlement, SettlementKind
    from chatlane.types import Outbound, OutboundKind, Target

    async with serve(config_with_token(tmp_path)) as s:
        store, key = s.hub.store, chat_key("42", "telegram")
        reply = Outbound(OutboundKind.REPLY, key, Target("telegram", "42"), "the answer")
        draft = draft_of(reply)
        await store.record_deliveries([draft])
        [claimed] = await store.claim_deliveries(["telegram"], "a-process", 30, 10)
        gone = Settlement(draft.id, claimed.claim, SettlementKind.DEAD, reason="bot blocked")
        await store.settle_deliveries([gone])
        url = f"http://127.0.0.1:{s.port}"
        code, listing = await run_cli("deliveries", "--url", url, "--token", TOKEN)
        assert code == 0
        assert listing.splitlines()[0] == "pending 0  dead 1"
        assert f"{draft.id}  {draft.target}  0  bot blocked  the answer" in listing
        code, detail = await run_cli("inspect", key, "--url", url, "--token", TOKEN)
        assert f"undelivered   1\n  {draft.id}: bot blocked\n" in detail
        code, detail = await run_cli("inspect", key, "--json", "--url", url, "--token", TOKEN)
        assert f'"id": "{draft.id}"' in detail
        assert '"reason": "bot blocked"' in detail
        code, output = await run_cli("redeliver", draft.id, "--url", url, "--token", TOKEN)
        assert (code, output) == (0, f"{draft.id} is pending again\n")
        code, listing = await run_cli(
            "deliveries", "--state", "pending", "--url", url, "--token", TOKEN
        )
        assert listing.splitlines()[0] == "pending 1  dead 0"
        assert draft.id in listing
        code, output = await run_cli("redeliver", draft.id, "--url", url, "--token", TOKEN)
        assert code == 1
        assert "HTTP 404" in output
        async with httpx.AsyncClient() as client:
            headers = {"Authorization": f"Bearer {TOKEN}"}
            wrong = await client.get(url + "/admin/deliveries?state=lost", headers=headers)
            assert wrong.status_code == 400
            assert (await client.get(url + "/admin/deliveries")).status_code == 401
