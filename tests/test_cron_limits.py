"""``/cron`` from chats, attacked: invented session names, tight intervals, removed users."""

from __future__ import annotations

from pathlib import Path

from openai import AsyncOpenAI

from chatlane.adapters.api import ApiAdapter
from chatlane.agents.demo import DemoAgent
from chatlane.config import ApiClientConfig, ApiConfig, Config, SchedulerConfig, Secret
from chatlane.cron import Job
from chatlane.hub import Hub
from chatlane.scheduler import Scheduler, SchedulerSettings
from chatlane.scheduling_config import build_scheduler
from chatlane.stores import open_store
from tests.adapters.test_api import TOKEN, make_config
from tests.adapters.test_limits import served
from tests.test_operating import run_cli
from tests.test_scheduler import FakeClock, scheduled


async def cron_hub(config: Config, store: str = "memory://") -> Hub:
    hub = Hub(config, await open_store(store), DemoAgent())
    hub.gateway.use_scheduler(build_scheduler(config))
    hub.add(ApiAdapter(config))
    return hub


async def say(client: AsyncOpenAI, text: str, session: str) -> str:
    reply = await client.chat.completions.create(
        model="chatlane", messages=[{"role": "user", "content": text}], user=session
    )
    return reply.choices[0].message.content or ""


async def test_invented_session_names_stop_at_the_total_cap_and_the_interval(
    tmp_path: Path,
) -> None:
    """The attack: one job a second from each of many invented names, kept across restarts."""
    store = f"sqlite:///{tmp_path / 'jobs.db'}"
    config = make_config(tmp_path, scheduler=SchedulerConfig(total_job_cap=5))
    async with served(await cron_hub(config, store)) as client:
        fast = [await say(client, "/cron add every 1s ping", f"name-{n}") for n in range(3)]
        assert all("at most every 60s" in reply for reply in fast)
        added = [await say(client, "/cron add every 1m ping", f"name-{n}") for n in range(8)]
        assert sum(reply.startswith("Added job ") for reply in added) == 5
        assert "as many jobs made from chats as it allows" in added[-1]
    hub = await cron_hub(config, store)  # after a restart, still five
    async with served(hub) as client:
        assert hub.gateway.scheduler is not None
        assert len(hub.gateway.scheduler.list_jobs()) == 5
        assert "as many jobs" in await say(client, "/cron add every 1h ping", "name-99")


async def test_one_client_is_one_principal_whatever_its_session_names(tmp_path: Path) -> None:
    (tmp_path / "alice").write_text("alice-token")
    clients = {"alice": ApiClientConfig(token=Secret(file=str(tmp_path / "alice")))}
    config = make_config(
        tmp_path, api=ApiConfig(clients=clients), scheduler=SchedulerConfig(user_job_cap=3)
    )
    hub = await cron_hub(config)
    async with served(hub, token="alice-token") as alice:
        replies = [await say(alice, "/cron add @hourly ping", f"alice:{n}") for n in range(6)]
    assert sum(reply.startswith("Added job ") for reply in replies) == 3
    assert replies[-1].startswith("You already have the most jobs you may have (3)")


async def test_a_job_of_a_user_removed_from_the_allowlist_is_paused_not_run() -> None:
    """The gateway's one check decides: ann's job pauses while ann is refused."""
    allowed = {"ann", "bob"}
    clock = FakeClock()
    scheduler = Scheduler(SchedulerSettings(period=0.02), now=clock)

    async def send(text: str, user_id: str) -> None:  # in a thread: one session for both
        await h.send(text, chat_id="g", chat_type="group", thread_id="t", user_id=user_id)

    async with scheduled(scheduler, allow=lambda s: s.user_id in allowed) as h:
        await send("/cron add every 1m ping", "ann")
        await h.replies(chat_id="g", thread_id="t", count=1)
        allowed.discard("ann")
        clock.advance(60)
        await send("/cron list", "bob")
        listing = (await h.replies(chat_id="g", thread_id="t", count=2))[1]
        assert "(paused: its creator is not allowed)" in listing
        [job] = scheduler.list_jobs()
        assert scheduler.is_paused(job)
        await scheduler.run_once()
        await scheduler.wait_idle()
        await h.settle()
        assert [o.text for o in h.delivered(chat_id="g", thread_id="t")][2:] == []
        allowed.add("ann")
        clock.advance(60)
        assert (await h.replies(chat_id="g", thread_id="t", count=3))[2] == "echo: ping"


async def test_the_operator_lists_and_removes_any_job(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    hub = await cron_hub(config)
    assert hub.gateway.scheduler is not None
    job = await hub.gateway.scheduler.add_job("@daily", "operator job", "local")
    async with served(hub) as client:
        reply = await say(client, "/cron add @hourly from a chat", "someone")
        chat_job = reply.split()[2]
        url = f"http://127.0.0.1:{client.base_url.port}"
        code, listing = await run_cli("cron", "list", "--url", url, "--token", TOKEN)
        assert code == 0
        assert f"{chat_job}  @hourly" in listing
        assert "api:someone  main:api:dm:someone" in listing
        assert f"{job.id}  @daily" in listing
        code, _ = await run_cli("cron", "list", "--url", url, "--token", "wrong")
        assert code != 0
        code, output = await run_cli("cron", "remove", chat_job, "--url", url, "--token", TOKEN)
        assert (code, output.strip()) == (0, f"removed job {chat_job}")
        assert await say(client, "/cron list", "someone") == (
            "No jobs for this chat. Add one with /cron add."
        )
        code, output = await run_cli("cron", "remove", "nope", "--url", url, "--token", TOKEN)
        assert code != 0
        assert "404" in output


async def test_configured_jobs_are_not_counted_against_chats() -> None:
    configured = [Job("@daily", f"cfg {n}", "test:c", id=f"cfg{n}") for n in range(3)]
    scheduler = Scheduler(SchedulerSettings(total_job_cap=1), jobs=configured)
    async with scheduled(scheduler) as h:
        await h.send("/cron add @daily mine", chat_id="c")
        assert (await h.replies(chat_id="c", count=1))[0].startswith("Added job ")
