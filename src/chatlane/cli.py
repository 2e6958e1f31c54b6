"""The ``chatlane`` command line."""

from __future__ import annotations

import click

from chatlane import __version__
from chatlane.errors import ChatlaneError
from chatlane.identity import ChatType, KeyPolicy, SessionSource, build_session_key
from chatlane.identity import parse_session_key as _parse_session_key


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name="chatlane")
def main() -> None:
    """chatlane: sessions and turns for AI chat-agent gateways."""


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
        click.echo(build_session_key(source, policy))
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
        value = getattr(parts, name)
        click.echo(f"{name}={'' if value is None else value}")


if __name__ == "__main__":  # pragma: no cover - `python -m chatlane.cli`
    main()
