"""The ``chatlane`` command line."""

from __future__ import annotations

import functools
import json
import os
import sys
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import click

from chatlane import __version__
from chatlane.console import EARLY_SIGTERM, exit_status, stopped_early
from chatlane.errors import ChatlaneError, StartInterrupted
from chatlane.identity import ChatType, KeyPolicy, SessionSource, build_session_key
from chatlane.identity import parse_session_key as _parse_session_key
from chatlane.logs import escape_controls, escape_json_controls


class _Commands(click.Group):
    """The command group: every argument must be text (a locale that is not UTF-8 hands
    Python bytes it cannot decode, which nothing downstream could send or store)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if sys.platform == "win32":
            raise click.ClickException(
                "chatlane runs on Linux and macOS (it uses POSIX file locks, signals and "
                "resource limits); on Windows, run it inside WSL"
            )
        for number, argument in enumerate(args, start=1):
            try:
                argument.encode()
            except UnicodeEncodeError:
                shown = os.fsencode(argument).decode("utf-8", "backslashreplace")
                raise click.UsageError(
                    f"argument {number} ({shown}) is not valid UTF-8; "
                    "run chatlane in a UTF-8 locale",
                    ctx,
                ) from None
        return super().parse_args(ctx, args)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name="chatlane")
def main() -> None:
    """chatlane: sessions and turns for AI chat-agent gateways."""


@main.command()
@click.option(
    "--config",
    "config_path",
    type=str,  # read by load_config, whose errors are one line
    default=None,
    help="A chatlane.toml file (environment CHATLANE_<SECTION>__<KEY> overrides it).",
)
@click.option("--host", default=None, help="Address to listen on (default 127.0.0.1).")
@click.option("--port", type=int, default=None, help="Port to listen on (default 8080).")
@click.option(
    "--store",
    default=None,
    help=(
        "memory://, sqlite:///path, redis://host:port/db, rediss://host:port/db, "
        "redis+sentinel://host:port,…/<primary name> or postgresql://host/db"
    ),
)
@click.option("--agent", default=None, help="demo, openai or python:module:attribute")
@click.option("--busy", default=None, help="queue, collect, rollback, redirect, steer or reject")
@click.option(
    "--keep-alive",
    type=int,
    default=None,
    help="Seconds an idle HTTP connection stays open (default 75).",
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="Logs on stderr as text or JSON lines.",
)
def serve(
    config_path: str | None,
    host: str | None,
    port: int | None,
    store: str | None,
    agent: str | None,
    busy: str | None,
    keep_alive: int | None,
    log_format: str,
) -> None:
    """Run the gateway: web chat and OpenAI-compatible API (and Telegram, Slack and Discord
    when enabled)."""
    try:
        with EARLY_SIGTERM:  # SIGTERM, until uvicorn takes it, ends as Ctrl-C does
            _serve(
                config_path,
                host=host,
                port=port,
                store=store,
                agent=agent,
                busy=busy,
                keep_alive=keep_alive,
                log_format=log_format,
            )
    except StartInterrupted as interrupted:
        click.get_current_context().exit(stopped_early(128 + interrupted.signal))
    except ChatlaneError as error:
        raise click.ClickException(str(error)) from None
    except KeyboardInterrupt as stop:  # before uvicorn handles the signals: nothing was ready
        click.get_current_context().exit(stopped_early(exit_status(stop)))


def _serve(config_path: str | None, *, log_format: str, **overrides: Any) -> None:
    """``chatlane serve``: configure, then run until a signal (imports here, where the
    command's Ctrl-C and SIGTERM are caught)."""
    import asyncio

    from chatlane.logs import configure_logging
    from chatlane.serve import prepare
    from chatlane.serve import serve as run

    configure_logging(log_format)
    config, secrets = prepare(config_path, **overrides)
    asyncio.run(run(config, secrets))


def _admin_get(url: str, token: str, path: str, method: str = "GET") -> Any:
    import httpx

    from chatlane.terminal import response_error

    headers = {b"Authorization": b"Bearer " + token.encode()} if token else {}
    try:
        port = httpx.URL(url).port  # the system would wrap 99999 round to another port
        if port is not None and not 0 < port < 65536:
            raise httpx.InvalidURL(f"port {port} is not between 1 and 65535")
        response = httpx.request(method, url.rstrip("/") + path, headers=headers, timeout=10)
    except (httpx.HTTPError, httpx.InvalidURL) as error:
        raise click.ClickException(f"cannot reach the gateway at {url}: {error}") from None
    if response.status_code != 200:
        raise click.ClickException(f"{url}{path}: {response_error(response)}")
    try:
        return response.json()
    except ValueError:
        raise click.ClickException(
            f"{url}{path} did not answer as a chatlane gateway (not JSON); check --url"
        ) from None


F = TypeVar("F", bound=Callable[..., Any])


def _reads_the_gateway(command: F) -> F:
    """An admin command whose gateway answered JSON of another shape (another service on
    that address, another version) ends with one line, not a traceback."""

    @functools.wraps(command)
    def reading(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except (KeyError, TypeError, AttributeError, IndexError):
            raise click.ClickException(_UNEXPECTED) from None

    return typing.cast(F, reading)


_UNEXPECTED = (
    "the gateway's answer is not what this chatlane expects (another service at that "
    "address, or another version of chatlane?); check --url"
)


def _gateway_options(command: F) -> F:
    """``--url``, ``--token`` and ``--config``: the gateway a client command talks to."""
    options = (
        click.option(
            "--url",
            default=None,
            help="The running gateway (default: $CHATLANE_URL, else the configured "
            "server.host and server.port, http://127.0.0.1:8080 without configuration).",
        ),
        click.option(
            "--token",
            default=None,
            help="Access token (default: the configured server.token, $CHATLANE_TOKEN).",
        ),
        click.option(
            "--config",
            "config_path",
            type=str,  # read by load_config, whose errors are one line
            default=None,
            help="The gateway's chatlane.toml, read as `chatlane serve` reads it.",
        ),
    )
    for option in reversed(options):
        command = option(command)
    return command


def _gateway(config_path: str | None, url: str | None, token: str | None) -> tuple[str, str]:
    """The gateway's URL and token: the options, else as ``chatlane serve`` is configured.

    :raises click.ClickException: for a configuration that cannot be read.
    """
    from chatlane.config import gateway_url, load_config
    from chatlane.secrets import read_secret

    try:
        config = load_config(config_path)
        if url is None:
            url = gateway_url(config)
        if token is None:
            token = read_secret(config.server.token)
    except ChatlaneError as error:
        raise click.ClickException(str(error)) from None
    return url, token


@main.command()
@_gateway_options
@_reads_the_gateway
def sessions(url: str | None, token: str | None, config_path: str | None) -> None:
    """List the sessions a running gateway holds."""
    items = _admin_get(*_gateway(config_path, url, token), "/admin/sessions")["sessions"]
    keys = [_shown(item["key"]) for item in items]
    width = max([48, *map(len, keys)])
    click.echo(f"{'KEY':<{width}} {'STATE':<10} {'GEN':>5} {'QUEUED':>6} {'IDLE(s)':>8}")
    for key_, item in zip(keys, items, strict=True):
        click.echo(
            f"{key_:<{width}} {_shown(item['activity']):<10} {_shown(item['generation']):>5} "
            f"{_shown(item['queued']):>6} {_shown(item['idle_seconds']):>8}"
        )


def _shown(value: object) -> str:
    """``value`` as one line of plain text: control characters and escapes shown escaped."""
    return escape_controls(str(value))


@main.command()
@click.argument("session_key")
@_gateway_options
@click.option("--json", "as_json", is_flag=True, help="The gateway's answer as it is (JSON).")
@_reads_the_gateway
def inspect(
    session_key: str, url: str | None, token: str | None, config_path: str | None, as_json: bool
) -> None:
    """Show one session's state, queue and recent transcript."""
    from urllib.parse import quote

    from chatlane.cli_views import session_lines

    path = "/admin/sessions/" + quote(session_key, safe="")
    detail = _admin_get(*_gateway(config_path, url, token), path)
    if not isinstance(detail, dict) or "key" not in detail:
        raise click.ClickException(_UNEXPECTED)
    if as_json:  # raw line breaks are the indentation's only: JSON escapes those in strings
        dumped = json.dumps(detail, indent=2, ensure_ascii=False)
        click.echo("\n".join(map(escape_json_controls, dumped.split("\n"))))
        return
    for line in session_lines(detail):
        click.echo(escape_controls(line))


@main.command()
@_gateway_options
@_reads_the_gateway
def failed(url: str | None, token: str | None, config_path: str | None) -> None:
    """List the messages set aside as failed (oldest first), with why."""
    items = _admin_get(*_gateway(config_path, url, token), "/admin/failed")["failed"]
    if not items:
        click.echo("no failed messages")
    for item in items:
        fields = (item["message_id"], item["key"], item["reason"])
        click.echo("  ".join(map(_shown, fields)))


@main.command()
@click.argument("message_id")
@_gateway_options
def retry(message_id: str, url: str | None, token: str | None, config_path: str | None) -> None:
    """Run a failed message again (in its place in its session's queue)."""
    from urllib.parse import quote

    path = f"/admin/failed/{quote(message_id, safe='')}/retry"
    _admin_get(*_gateway(config_path, url, token), path, method="POST")
    click.echo(f"{_shown(message_id)} is queued again")


@main.command()
@click.option(
    "--state",
    type=click.Choice(["dead", "pending", "delivered"]),
    default="dead",
    show_default=True,
    help="Which deliveries to list.",
)
@_gateway_options
@_reads_the_gateway
def deliveries(state: str, url: str | None, token: str | None, config_path: str | None) -> None:
    """List the delivery ledger: dead letters (with why) by default, and its counts."""
    answer = _admin_get(*_gateway(config_path, url, token), f"/admin/deliveries?state={state}")
    stats = answer["stats"]
    click.echo(f"pending {stats['pending']}  dead {stats['dead']}")
    if not answer["deliveries"]:
        click.echo(f"no {state} deliveries")
    for item in answer["deliveries"]:
        fields = (item["id"], item["target"], item["attempts"], item["reason"], item["preview"])
        click.echo("  ".join(map(_shown, fields)))


@main.command()
@click.argument("delivery_id")
@_gateway_options
def redeliver(
    delivery_id: str, url: str | None, token: str | None, config_path: str | None
) -> None:
    """Send a dead delivery again, in its place among its chat's pending ones, attempts reset."""
    from urllib.parse import quote

    path = f"/admin/deliveries/{quote(delivery_id, safe='')}/retry"
    _admin_get(*_gateway(config_path, url, token), path, method="POST")
    click.echo(f"{_shown(delivery_id)} is pending again")


@main.group()
def cron() -> None:
    """List and remove the scheduled jobs of a running gateway (whoever made them)."""


@cron.command("list")
@_gateway_options
@_reads_the_gateway
def cron_list(url: str | None, token: str | None, config_path: str | None) -> None:
    """List every job: id, next run, where it came from, whether it is paused."""
    items = _admin_get(*_gateway(config_path, url, token), "/admin/cron")["jobs"]
    if not items:
        click.echo("no scheduled jobs")
    for item in items:
        made = "configured" if item["configured"] else (item["principal"] or "api")
        paused = "  (paused)" if item["paused"] else ""
        where = item["session"] or item["target"]
        click.echo(
            f"{_shown(item['id'])}  {_shown(item['schedule'])}  "
            f"next {_shown(item['next_run_text'])}  {_shown(made)}  {_shown(where)}{paused}  "
            f"{_shown(repr(item['prompt']))}"
        )


@cron.command("remove")
@click.argument("job_id")
@_gateway_options
def cron_remove(job_id: str, url: str | None, token: str | None, config_path: str | None) -> None:
    """Remove a stored job, in every process sharing the store."""
    from urllib.parse import quote

    path = f"/admin/cron/{quote(job_id, safe='')}"
    _admin_get(*_gateway(config_path, url, token), path, method="DELETE")
    click.echo(f"removed job {_shown(job_id)}")


@main.command()
@_gateway_options
@click.option("--session", default=None, help="Session name (default: terminal-<user name>).")
@click.option("--local", is_flag=True, help="Run an in-process gateway instead of using --url.")
@click.option("--store", default=None, help="With --local: memory:// (default), sqlite:///path…")
def chat(
    url: str | None,
    token: str | None,
    config_path: str | None,
    session: str | None,
    local: bool,
    store: str | None,
) -> None:
    """Talk to a gateway from the terminal, replies streamed (Ctrl-D or /quit to leave)."""
    import asyncio

    from chatlane.terminal import check_session, check_token, default_session, run_chat

    if store is not None and not local:
        raise click.UsageError("--store needs --local")
    try:
        name = default_session() if session is None else check_session(session)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--session") from None
    if not local:
        url, token = _gateway(config_path, url, token)
    try:
        token = check_token(token or "")
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--token") from None
    local_store = (store or "memory://") if local else None
    try:
        code = asyncio.run(run_chat(url or "", name, token, local_store, config_path))
    except ChatlaneError as error:
        raise click.ClickException(str(error)) from None
    except KeyboardInterrupt:
        code = 130
    click.get_current_context().exit(code)


@main.group()
def key() -> None:
    """Build and read session keys."""


@key.command("build")
@click.option("--platform", required=True, help="Platform name, e.g. telegram.")
@click.option("--chat-id", default=None, help="Chat id on that platform.")
@click.option(
    "--chat-type",
    type=click.Choice([t.value for t in ChatType]),
    default=ChatType.DM.value,
    show_default=True,
)
@click.option("--thread-id", default=None)
@click.option("--user-id", default=None)
@click.option("--namespace", default="main", show_default=True)
@click.option("--shared-groups", is_flag=True, help="One session per group, not per user.")
@click.option("--per-user-threads", is_flag=True, help="One session per user inside threads.")
def key_build(
    platform: str,
    chat_id: str | None,
    chat_type: str,
    thread_id: str | None,
    user_id: str | None,
    namespace: str,
    shared_groups: bool,
    per_user_threads: bool,
) -> None:
    """Print the session key a message from this source belongs to."""
    try:
        source = SessionSource(
            platform,
            chat_id=chat_id,
            chat_type=ChatType(chat_type),
            thread_id=thread_id,
            user_id=user_id,
        )
        policy = KeyPolicy(namespace, not shared_groups, per_user_threads)
        click.echo(_shown(build_session_key(source, policy)))
    except ChatlaneError as error:
        raise click.ClickException(str(error)) from None


@key.command("parse")
@click.argument("session_key")
def key_parse(session_key: str) -> None:
    """Print the components of SESSION_KEY."""
    try:
        parts = _parse_session_key(session_key)
    except ChatlaneError as error:
        raise click.ClickException(str(error)) from None
    for name in ("namespace", "platform", "chat_type", "chat_id", "thread_id", "user_id"):
        value = getattr(parts, name) or ""
        shown = value if value.isprintable() else repr(value)  # one field per line, always
        click.echo(f"{name}={shown}")


if __name__ == "__main__":  # pragma: no cover - `python -m chatlane.cli`
    main()
