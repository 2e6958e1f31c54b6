"""Configuration: defaults, TOML, environment overrides, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from starlette.applications import Starlette

from chatlane.config import Config, LimitsConfig, ServerConfig, check_config, load_config
from chatlane.errors import ConfigError
from chatlane.identity import ChatType
from chatlane.runtime.busy import BusyPolicy, BusySettings, Overflow
from chatlane.runtime.capacity import CapacitySettings
from chatlane.runtime.settings import LeaseSettings, RuntimeSettings
from chatlane.serve import configure, uvicorn_config


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "chatlane.toml"
    path.write_text(text)
    return path


def test_defaults_need_no_file() -> None:
    config = load_config(environ={})
    assert (config.server.host, config.server.port) == ("127.0.0.1", 8080)
    assert config.store.url == "sqlite:///chatlane.db"
    assert (config.agent.name, config.runtime.busy.default) == ("demo", "queue")
    assert config.server.keep_alive == 75


def test_file_then_environment(tmp_path: Path) -> None:
    path = write(tmp_path, '[server]\nport = 9000\n[runtime]\nbusy = "collect"\n')
    config = load_config(
        path, environ={"CHATLANE_RUNTIME__BUSY": "reject", "CHATLANE_ALLOW__TELEGRAM": "[42, 43]"}
    )
    assert config.server.port == 9000
    assert config.runtime.busy.default == "reject"
    assert config.allow == {"telegram": ["42", "43"]}


@pytest.mark.parametrize("value", ["\udcff", "80\udce9"])  # bytes a locale could not decode
def test_an_environment_value_that_is_not_utf8_is_one_clear_error(value: str) -> None:
    with pytest.raises(ConfigError, match="CHATLANE_SERVER__PORT: its value is not valid UTF-8"):
        load_config(environ={"CHATLANE_SERVER__PORT": value})


def test_lease_settings_come_from_the_runtime_table(tmp_path: Path) -> None:
    text = "[runtime]\nlease_ttl = 12\nfence_check = 0\nmax_active_sessions = 3\n"
    text += "reread_stored = 0.25\n"
    settings = load_config(write(tmp_path, text), environ={}).runtime
    leases = settings.leases
    assert (leases.ttl, leases.fence_check, leases.max_active_sessions) == (12, 0, 3)
    assert settings.reread_stored == 0.25


def test_the_runtime_table_decodes_into_the_engine_settings(tmp_path: Path) -> None:
    text = '[runtime]\nbusy = " Collect "\nqueue_cap = 7\noverflow = "drop-oldest"\n'
    text += "coalesce = { telegram = 1.5 }\ncoalesce_max_wait = 4\n"
    text += '[runtime.busy_per_chat_type]\ngroup = "reject"\n[limits]\nqueued_bytes = 4096\n'
    environ = {
        "CHATLANE_RUNTIME__BUSY_PER_PLATFORM": '{ telegram = "interrupt" }',
        "CHATLANE_RUNTIME__LEASE_TTL": "20",
        "CHATLANE_LIMITS__LIVE_SESSIONS": "9",
    }
    runtime = load_config(write(tmp_path, text), environ=environ).runtime
    assert isinstance(runtime, RuntimeSettings)
    assert runtime.busy == BusySettings(
        BusyPolicy.COLLECT, {"telegram": BusyPolicy.ROLLBACK}, {ChatType.GROUP: BusyPolicy.REJECT}
    )
    assert (runtime.queue_cap, runtime.leases.ttl, runtime.leases.max_active_sessions) == (
        7,
        20,
        64,
    )
    assert runtime.capacity == CapacitySettings(queued_bytes=4096, live_sessions=9)
    assert runtime.overflow is Overflow.DROP_OLDEST
    assert (dict(runtime.coalesce), runtime.coalesce_max_wait) == ({"telegram": 1.5}, 4)
    assert load_config(environ={}).runtime == Config().runtime


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[server]\nport = "abc"', "configuration key 'server.port' = 'abc': expected `int`"),
        ("[server]\nprot = 1", "unknown configuration key 'server.prot'"),
        ("colour = 1", "unknown configuration key 'colour'"),
        ('[runtime]\nbusy = "wait"', "'runtime.busy' = 'wait': expected one of: queue, collect"),
        ("[runtime]\nqueue_cap = 0", "'runtime.queue_cap' = 0: expected a whole number > 0"),
        ("[runtime]\nqueue_cap = 2.5", "'runtime.queue_cap' = 2.5: expected a whole number > 0"),
        ("[runtime]\ncoalesce = { telegram = -1 }", "'runtime.coalesce.*': expected a finite"),
        (
            '[runtime]\noverflow = "drop-newest"',
            "'runtime.overflow' = 'drop-newest': expected one of: refuse-new, drop-oldest",
        ),
        (
            "[runtime]\nfence_check = -1",
            "'runtime.fence_check' = -1: expected a finite number >= 0",
        ),
        (
            "[runtime]\nmax_active_sessions = -1",
            "'runtime.max_active_sessions' = -1: expected a whole",
        ),
        ("[runtime]\nleases = 1", "unknown configuration key 'runtime.leases'"),
        ("[runtime]\nqueue = 1", "unknown configuration key 'runtime.queue'"),
        ("[limits]\nqueued_bytes = 0", "'limits.queued_bytes' = 0: expected a whole number > 0"),
        ("[limits]\nlive_sessions = 1.5", "'limits.live_sessions' = 1.5: expected a whole number"),
        ("[limits]\nsocket = 1", "unknown configuration key 'limits.socket'"),
        (
            '[runtime.busy_per_platform]\ntelegram = "later"',
            "'runtime.busy_per_platform.telegram': expected one of: queue",
        ),
        ("[runtime]\ninterrupt_grace = inf", "'runtime.interrupt_grace' = inf: expected a finite"),
        ("[runtime]\nturn_timeout = nan", "'runtime.turn_timeout' = nan: expected a finite"),
        ("[runtime]\nlease_ttl = inf", "'runtime.lease_ttl' = inf: expected a finite number >= 1"),
        ("[server]\nport = 70000", "'server.port' = 70000: expected a port"),
        ("[server]\nkeep_alive = 0", "'server.keep_alive' = 0: expected a whole number > 0"),
        ("[server]\nkeep_alive = -5", "'server.keep_alive' = -5: expected a whole number"),
        ("[server]\nkeep_alive = 2.5", "'server.keep_alive' = 2.5: expected a whole number > 0"),
        ("[server]\nkeep_alive = inf", "'server.keep_alive' = inf: expected a whole number > 0"),
        ('[server]\nkeep_alive = "long"', "'server.keep_alive' = 'long': expected a whole number"),
        ("[allow]\ntelegram = [1.5]", "'allow.telegram' = [1.5]: expected a list of user ids"),
        ('[allow]\ntelegram = "42"', "'allow.telegram' = '42': expected a list of user ids"),
        ('namespace = ""', "'namespace' = '': expected a non-empty name"),
        ("this is [ not toml", "is not valid TOML"),
        (
            '[runtime.busy_per_chat_type]\nroom = "queue"',
            "'runtime.busy_per_chat_type.room': expected one of: dm, group",
        ),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=None) as raised:
        load_config(write(tmp_path, text), environ={})
    assert message in str(raised.value)


HUGE = "99999999999999999999999"
"""More than any store's integers hold (int64 included)."""


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("RUNTIME__MAX_ACTIVE_SESSIONS", HUGE, "whole number >= 0 and <= 1000000000"),
        ("RUNTIME__LEASE_TTL", "1e300", "finite number >= 1 and <= 1000000000"),
        ("RUNTIME__LEASE_TTL", "1e12", "finite number >= 1 and <= 1000000000"),
        ("RUNTIME__LEASE_TTL", "0.001", "finite number >= 1 and <= 1000000000"),
        ("RUNTIME__LEASE_TTL", "0.5", "finite number >= 1 and <= 1000000000"),
        ("RUNTIME__QUEUE_CAP", HUGE, "whole number > 0 and <= 1000000000"),
        ("RUNTIME__INTERRUPT_DEPTH", HUGE, "whole number > 0 and <= 1000000000"),
        ("RUNTIME__SIDE_ANSWERS", HUGE, "whole number > 0 and <= 1000000000"),
        ("RUNTIME__TURN_TIMEOUT", "1e300", "finite number >= 0 and <= 1000000000"),
        ("RUNTIME__FENCE_CHECK", "1e10", "finite number >= 0 and <= 1000000000"),
        ("RUNTIME__APPROVAL_TIMEOUT", "1e300", "finite number >= 0 and <= 1000000000"),
        ("RUNTIME__REREAD_STORED", "1e300", "finite number >= 0 and <= 1000000000"),
        ("RUNTIME__COALESCE", "{ telegram = 1e300 }", "finite number >= 0 and <= 1000000000"),
        ("LIMITS__QUEUED_BYTES", HUGE, "whole number > 0 and <= 1099511627776"),
        ("LIMITS__LIVE_SESSIONS", HUGE, "whole number > 0 and <= 1000000000"),
        ("LIMITS__SOCKETS", HUGE, "whole number > 0 and <= 1000000000"),
        ("DELIVERY__MAX_ATTEMPTS", HUGE, "whole number > 0 and <= 1000000000"),
        ("DELIVERY__CLAIM_BATCH", HUGE, "whole number > 0 and <= 1000000000"),
        ("DELIVERY__CLAIM_TTL", "1e300", "finite number > 0 and <= 1000000000"),
        ("DELIVERY__MAX_RETRY", "1e300", "finite number >= 0 and <= 1000000000"),
        ("SERVER__KEEP_ALIVE", HUGE, "whole number > 0 and <= 1000000000"),
        ("SERVER__SIGN_IN_TTL", HUGE, "whole number > 0 and <= 1000000000"),
        ("SERVER__HEADER_TIMEOUT", "1e300", "finite number > 0 and <= 1000000000"),
        ("SERVER__MAX_CONNECTIONS", HUGE, "whole number > 0 and <= 1000000000"),
        ("AGENT__OPENAI__HISTORY", HUGE, "whole number >= 0 and <= 1000000000"),
        ("AGENT__OPENAI__HISTORY", "-1", "whole number >= 0 and <= 1000000000"),
        ("SCHEDULER__CHAT_JOB_CAP", HUGE, "whole number > 0 and <= 1000000000"),
        ("SCHEDULER__TOTAL_JOB_CAP", HUGE, "whole number > 0 and <= 1000000000"),
        ("SCHEDULER__MIN_INTERVAL", "1e300", "finite number >= 0 and <= 1000000000"),
        ("AUTO_RESET__IDLE_AFTER", "1e300", "finite number > 0 and <= 1000000000"),
        ("TELEGRAM__MAX_ATTACHMENT_BYTES", HUGE, "whole number > 0 and <= 1099511627776"),
        ("DISCORD__MAX_ATTACHMENT_BYTES", HUGE, "whole number > 0 and <= 1099511627776"),
    ],
)
def test_numbers_a_store_cannot_hold_or_that_break_every_turn_stop_the_start(
    name: str, value: str, message: str
) -> None:
    key = name.lower().replace("__", ".")
    with pytest.raises(ConfigError) as raised:
        load_config(environ={f"CHATLANE_{name}": value})
    assert str(raised.value).startswith(f"configuration key '{key}")
    assert message in str(raised.value)


def test_the_ends_of_each_range_are_taken() -> None:
    environ = {
        "CHATLANE_RUNTIME__LEASE_TTL": "1",
        "CHATLANE_RUNTIME__MAX_ACTIVE_SESSIONS": "1000000000",
        "CHATLANE_RUNTIME__TURN_TIMEOUT": "1e9",
        "CHATLANE_LIMITS__QUEUED_BYTES": str(1 << 40),
        "CHATLANE_SERVER__SIGN_IN_TTL": "1000000000",
    }
    config = load_config(environ=environ)
    assert (config.runtime.leases.ttl, config.runtime.leases.max_active_sessions) == (1, 10**9)
    assert (config.runtime.turn_timeout, config.runtime.capacity.queued_bytes) == (1e9, 1 << 40)
    assert load_config(environ={"CHATLANE_RUNTIME__LEASE_TTL": "1e9"}).runtime.leases.ttl == 1e9


def test_a_configuration_built_in_code_is_checked_the_same_way() -> None:
    short = RuntimeSettings(leases=LeaseSettings(ttl=0.3))  # code may: tests watch leases expire
    with pytest.raises(
        ConfigError, match=r"'runtime\.lease_ttl' = 0\.3: expected a finite number >= 1"
    ):
        check_config(Config(runtime=short))
    with pytest.raises(ConfigError, match=r"'server\.keep_alive' = 10000000000: expected a whole"):
        check_config(Config(server=ServerConfig(keep_alive=10**10)))
    many = msgspec.structs.replace(Config().scheduler, chat_job_cap=10**10)
    with pytest.raises(ConfigError, match=r"'scheduler\.chat_job_cap' = 10000000000: expected"):
        check_config(msgspec.structs.replace(Config(), scheduler=many))
    with pytest.raises(ConfigError, match=r"'limits\.sockets' = 0: expected a whole number > 0"):
        check_config(Config(limits=LimitsConfig(sockets=0)))


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="No such file"):
        load_config(tmp_path / "missing.toml", environ={})


def test_secrets_are_named_never_inlined(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("s3cret\n")
    config = load_config(write(tmp_path, f'[server.token]\nfile = "{secret}"\n'), environ={})
    assert config.server.token.read({}) == "s3cret"
    assert "s3cret" not in repr(config)
    with pytest.raises(ConfigError, match=r"unknown configuration key 'server\.token\.value'"):
        load_config(write(tmp_path, '[server.token]\nvalue = "x"\n'), environ={})


def test_non_loopback_needs_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHATLANE_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="needs a token"):
        configure(None, host="0.0.0.0")
    monkeypatch.setenv("CHATLANE_TOKEN", "t")
    monkeypatch.setenv("CHATLANE_SERVER__ALLOWED_HOSTS", '["chat.example"]')
    assert configure(None, host="0.0.0.0").server.host == "0.0.0.0"


def test_command_line_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    config = configure(None, port=9999, store="memory://", agent="demo", busy="steer")
    assert (config.server.port, config.store.url, config.runtime.busy.default) == (
        9999,
        "memory://",
        "steer",
    )
    with pytest.raises(ConfigError, match="--busy: 'later' is not one of"):
        configure(None, busy="later")


async def test_auto_reset_and_cron_from_the_file(tmp_path: Path) -> None:
    from chatlane.agents.demo import DemoAgent
    from chatlane.scheduling_config import build_scheduler
    from chatlane.testing import GatewayHarness

    path = write(
        tmp_path,
        (
            "[auto_reset]\nidle_after = 3600\n"
            "[auto_reset.per_platform.telegram]\ndaily_at_hour = 4\n"
            "[telegram]\nenabled = true\n"
            '[scheduler]\ntimezone = "Europe/Berlin"\n'
            '[[cron]]\nschedule = "0 9 * * 1-5"\nprompt = "standup"\ntarget = "telegram:-100"\n'
            'id = "standup"\n'
        ),
    )
    scheduler = build_scheduler(load_config(path, environ={}))
    async with GatewayHarness(DemoAgent()) as h:
        h.gateway.use_scheduler(scheduler)
        await scheduler.start()
        assert [job.id for job in scheduler.list_jobs()] == ["standup"]
        await scheduler.aclose()
    assert scheduler.settings.auto_reset.default.idle_after == 3600
    assert scheduler.settings.auto_reset.per_platform["telegram"].daily_at_hour == 4


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[auto_reset]\ndaily_at_hour = 25", "'auto_reset': auto-reset daily_at_hour must be 0-23"),
        ('[scheduler]\ntimezone = "Mars/Olympus"', "'scheduler.timezone' = 'Mars/Olympus'"),
        ('[[cron]]\nschedule = "61 * * * *"\nprompt = "x"', "configuration key 'cron.0'"),
        (
            '[[cron]]\nschedule = "every 5m"\nprompt = "x"\ntarget = "origin"',
            "configuration key 'cron.0'",
        ),
        ("[auto_reset.per_chat_type.room]\nidle_after = 5", "'auto_reset.per_chat_type.room'"),
    ],
)
def test_bad_scheduling_config_is_named(tmp_path: Path, text: str, message: str) -> None:
    from chatlane.scheduling_config import build_scheduler

    with pytest.raises(ConfigError) as raised:
        build_scheduler(load_config(write(tmp_path, text), environ={}))
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (
            "telegram:-1001234",
            "configuration key 'cron.0': job 'standup' sends to telegram, which is not "
            "enabled, so its replies would wait for it forever: set [telegram] enabled = true, "
            "or give the job another target",
        ),
        (
            "discord:42:7",
            "configuration key 'cron.0': job 'standup' sends to discord, which is not enabled",
        ),
        (
            "telgram:-1001234",
            "configuration key 'cron.0': job 'standup' sends to 'telgram', which is not a "
            "platform chatlane serves (web, api, telegram, slack, discord)",
        ),
    ],
)
def test_a_cron_job_for_a_platform_not_served_is_refused_naming_both(
    tmp_path: Path, target: str, message: str
) -> None:
    from chatlane.scheduling_config import build_scheduler

    job = f'[[cron]]\nschedule = "@daily"\nprompt = "x"\ntarget = "{target}"\nid = "standup"\n'
    with pytest.raises(ConfigError) as raised:
        build_scheduler(load_config(write(tmp_path, job), environ={}))
    assert str(raised.value).startswith(message)


@pytest.mark.parametrize(
    "target", ["local", "web:browser-1", "api:alice", "slack:C024:1712.5", "telegram:-1001234"]
)
def test_a_cron_job_for_a_served_platform_is_taken(tmp_path: Path, target: str) -> None:
    from chatlane.scheduling_config import build_scheduler

    text = (
        "[slack]\nenabled = true\n[telegram]\nenabled = true\n"
        f'[[cron]]\nschedule = "@daily"\nprompt = "x"\ntarget = "{target}"\nid = "standup"\n'
    )
    build_scheduler(load_config(write(tmp_path, text), environ={}))  # no ConfigError


def test_keep_alive_from_file_environment_and_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, "[server]\nkeep_alive = 90\n")
    assert load_config(path, environ={}).server.keep_alive == 90
    environ = {"CHATLANE_SERVER__KEEP_ALIVE": "120"}
    assert load_config(path, environ=environ).server.keep_alive == 120
    with pytest.raises(ConfigError, match=r"'server\.keep_alive' = 0: expected a whole number"):
        load_config(path, environ={"CHATLANE_SERVER__KEEP_ALIVE": "0"})
    monkeypatch.setenv("CHATLANE_SERVER__KEEP_ALIVE", "120")
    assert configure(str(path), keep_alive=30).server.keep_alive == 30
    with pytest.raises(ConfigError, match="--keep-alive 0: expected a whole number of seconds > 0"):
        configure(str(path), keep_alive=0)


def test_keep_alive_reaches_uvicorn() -> None:
    app = Starlette()
    assert uvicorn_config(app, Config()).timeout_keep_alive == 75
    config = Config(server=ServerConfig(keep_alive=7))
    assert uvicorn_config(app, config).timeout_keep_alive == 7


def test_allowed_base_urls_are_plain_urls_and_a_bad_one_is_not_repeated() -> None:
    assert load_config(environ={}).agent.openai.allowed_base_urls == []
    good = '["https://llm.example.com/v1", "http://10.0.0.5:8000/v1"]'
    config = load_config(environ={"CHATLANE_AGENT__OPENAI__ALLOWED_BASE_URLS": good})
    assert len(config.agent.openai.allowed_base_urls) == 2
    bad = '["https://llm.example.com/v1", "https://me:hunter2@h/v1?key=hunter2"]'
    with pytest.raises(ConfigError, match=r"'agent\.openai\.allowed_base_urls\[1\]'") as error:
        load_config(environ={"CHATLANE_AGENT__OPENAI__ALLOWED_BASE_URLS": bad})
    assert "hunter2" not in str(error.value)


def test_a_config_file_nested_past_reading_is_a_clear_error(tmp_path: Path) -> None:
    path = write(tmp_path, "x = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="nested too deeply to read"):
        load_config(path, environ={})


@pytest.mark.parametrize("platform", ["telegram", "slack", "discord"])
@pytest.mark.parametrize(
    "url", ["http://[::1", "ftp://example.com", "https://x.example/?a=1", "https://u:p@x.example"]
)
def test_a_platforms_api_url_must_be_a_plain_http_url(platform: str, url: str) -> None:
    environ = {f"CHATLANE_{platform.upper()}__API_URL": url}
    with pytest.raises(ConfigError, match=rf"^configuration key '{platform}.api_url' = "):
        load_config(environ=environ)
