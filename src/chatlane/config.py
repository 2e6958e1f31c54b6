"""One typed configuration: a TOML file, then environment overrides, validated at start.

What stays true:

* Configuration is read here and passed down; no other module reads
  environment variables (except :mod:`chatlane.secrets`, which resolves every
  secret once at start, and the context layer's documented legacy lookup).
* A bad key or value stops the start with a :class:`~chatlane.errors.ConfigError`
  that names the key, the value and what was expected — never a traceback.
* Every number has a range, declared once on its type
  (:mod:`chatlane.runtime.limits`): within what every store holds, and for the
  lease TTL at least a second, so no configuration that starts fails every
  message. The decoder checks them; :func:`check_config` checks them again for
  a :class:`Config` built in code.
* Secrets (API keys, bot tokens, the access token) are named by the
  environment variable or file they come from; their values are read at start,
  kept out of ``repr`` and never logged.

Environment overrides use ``CHATLANE_<SECTION>__<KEY>``, for example
``CHATLANE_SERVER__PORT=9000`` or ``CHATLANE_RUNTIME__BUSY=interrupt``.

``[runtime]`` (with ``[limits]``'s ``queued_bytes`` and ``live_sessions``)
decodes straight into the engine's :class:`~chatlane.runtime.settings.RuntimeSettings`:
its enums and bounds are checked by the decoder. The file keeps its flat keys
(``lease_ttl``, ``busy_per_platform`` …); :data:`RUNTIME_KEYS` says where each
lives in the settings, and errors name the file's key.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Final
from urllib.parse import urlsplit

import msgspec

from chatlane.authorization import AdminCommands
from chatlane.chat_settings import ChatSettings
from chatlane.delivery.worker import DeliverySettings
from chatlane.endpoints import EndpointRefused, Prefix, normal
from chatlane.errors import ConfigError
from chatlane.groups import GroupsConfig, GroupSettings, check_group_settings
from chatlane.identity import ChatType, SessionSource
from chatlane.redaction import redact_urls
from chatlane.runtime.limits import (
    CONFIGURED_GE,
    Bytes,
    Count,
    CountOrZero,
    PositiveSeconds,
    Seconds,
    WholeSeconds,
    expectation,
    out_of_bounds,
)
from chatlane.runtime.settings import LeaseSettings, RuntimeSettings
from chatlane.scheduler import SchedulerSettings

ENV_PREFIX = "CHATLANE_"


class Secret(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a secret comes from: an environment variable or a file (never the value itself)."""

    env: str = ""
    file: str = ""

    def read(self, environ: Mapping[str, str]) -> str:
        """The secret's value, or ``""`` if none is configured."""
        if self.file:
            try:
                return Path(self.file).read_text(encoding="utf-8").strip()
            except OSError as error:
                raise ConfigError(f"secret file {self.file!r}: {error.strerror}") from None
            except UnicodeDecodeError:
                raise ConfigError(f"secret file {self.file!r}: not UTF-8 text") from None
        return environ.get(self.env, "") if self.env else ""

    def source(self) -> str:
        """Where the value is read from, for a message (never the value itself)."""
        if self.file:
            return f"the file {self.file!r}"
        if self.env:
            return f"the environment variable {self.env}"
        return "nowhere (neither env nor file is set)"


SECRET_SHAPE = (
    'a secret is not written in the configuration: use { env = "VARIABLE" } '
    'or { file = "/path/to/file" }'
)
"""What a secret given as a value (``token = "…"``) is told: where to keep it instead."""


class ServerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where the web chat and the API listen."""

    host: str = "127.0.0.1"
    port: int = 8080
    token: Secret = Secret(env="CHATLANE_TOKEN")
    """Required on a non-loopback address: browsers and API clients must present it."""
    keep_alive: WholeSeconds = 75
    """Seconds an idle HTTP connection is kept open; longer than clients' and proxies'
    idle pools, so they close first and never reuse a connection the server is closing."""
    header_timeout: PositiveSeconds = 10.0
    """Seconds a client has to send a request's headers (a WebSocket handshake's
    included), from connecting or from the first byte of its next request."""
    max_connections: Count = 1000
    """Most connections open at once (HTTP and WebSocket); more are answered 503 and
    closed. Lowered at start to fit the process's open-file limit."""
    allowed_hosts: list[str] = msgspec.field(default_factory=list)
    """``Host`` names answered besides the loopback names and ``host``
    (``*.example.com`` matches subdomains, ``*`` any name)."""
    metrics_public: bool = False
    """Serve ``/metrics`` without the token even when one is configured."""
    sign_in_ttl: WholeSeconds = 7 * 24 * 3600
    """Seconds a web chat sign-in lasts before the browser must present the token again."""

    def is_wildcard(self) -> bool:
        """Whether ``host`` listens on every address (``0.0.0.0``, ``::``)."""
        try:
            return ipaddress.ip_address(self.host).is_unspecified
        except ValueError:
            return False

    def is_loopback(self) -> bool:
        """Whether ``host`` only accepts connections from this machine."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


class StoreConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    url: str = "sqlite:///chatlane.db"


class OpenAIConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An OpenAI-compatible endpoint for the ``openai`` agent."""

    base_url: str = "https://api.openai.com/v1"
    model: str = "gpt-4o-mini"
    api_key: Secret = Secret(env="OPENAI_API_KEY")
    history: CountOrZero = 20
    """Transcript entries sent with each turn (0: none)."""
    allowed_base_urls: list[str] = msgspec.field(default_factory=list)
    """Endpoints chat users may choose with ``/model --base-url`` (origin and path prefix);
    empty: none but ``base_url``."""


class AgentConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Which agent answers: ``demo``, ``openai`` or ``python:module:attribute``."""

    name: str = "demo"
    openai: OpenAIConfig = OpenAIConfig()


GATEWAY_MAX_ACTIVE_SESSIONS: Final = 64
"""``runtime.max_active_sessions`` of ``chatlane serve``: the library's engine leaves it
unlimited (an application embedding it decides); a gateway serving strangers starts bounded."""

GATEWAY_RUNTIME: Final = RuntimeSettings(
    leases=LeaseSettings(max_active_sessions=GATEWAY_MAX_ACTIVE_SESSIONS)
)
"""The runtime settings of ``chatlane serve`` when the file sets none."""

RUNTIME_KEYS: Final[Mapping[tuple[str, str], tuple[str, ...]]] = MappingProxyType(
    {
        ("runtime", "busy"): ("busy", "default"),
        ("runtime", "busy_per_platform"): ("busy", "per_platform"),
        ("runtime", "busy_per_chat_type"): ("busy", "per_chat_type"),
        ("runtime", "lease_ttl"): ("leases", "ttl"),
        ("runtime", "max_active_sessions"): ("leases", "max_active_sessions"),
        ("runtime", "fence_check"): ("leases", "fence_check"),
        ("limits", "queued_bytes"): ("capacity", "queued_bytes"),
        ("limits", "live_sessions"): ("capacity", "live_sessions"),
    }
)
"""Where a file key that is not a plain field of :class:`RuntimeSettings` lives in it.

Every other ``[runtime]`` key is a field of the same name (``queue_cap`` …)."""

_RUNTIME_FIELDS: Final = frozenset(f.name for f in dataclasses.fields(RuntimeSettings)) - {
    "busy",
    "leases",
    "capacity",
}


class LimitsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Process-wide limits the runtime does not hold (its own are ``runtime.capacity``)."""

    sockets: Count = 256
    """Web chat WebSockets open at once in one process."""


class WebConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    id_secret: Secret = Secret()
    """Signs browser ids; default: a 0600 file next to a SQLite store, else made at start."""


class ApiClientConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One API client: its own token, and the session names it may use."""

    token: Secret
    prefix: str = ""
    """Every session name the client uses starts with it; default ``<client name>:``."""


class ApiConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    clients: dict[str, ApiClientConfig] = msgspec.field(default_factory=dict)
    """When set, every ``/v1`` request needs one client's token, and names only its sessions."""
    models: list[str] = msgspec.field(default_factory=list)
    """More names ``model`` may take (listed by ``GET /v1/models``), for clients that send
    a fixed one; any other name but ``chatlane`` (and the ``openai`` agent's) gets 404."""


class TelegramConfig(ChatSettings, frozen=True, forbid_unknown_fields=True):
    """The Telegram bot: long polling, and the group keys (:mod:`chatlane.groups`)."""

    CHAT_KINDS: ClassVar[tuple[str, ...]] = ("group", "supergroup", "channel")
    CHAT_ID: ClassVar[re.Pattern[str]] = re.compile(r"-?[0-9]+")
    CHAT_ID_SHAPE: ClassVar[str] = "a Telegram chat id (a whole number, '-100…' for a group)"

    enabled: bool = False
    token: Secret = Secret(env="TELEGRAM_BOT_TOKEN")
    api_url: str = "https://api.telegram.org"
    typing: bool = True
    """Show "typing…" in a chat while its message is being worked on."""
    allowed_chats: list[str] = msgspec.field(default_factory=list)
    """Chat ids (groups, supergroups, channels) where the bot answers; empty: every one it
    is in. Private chats are governed by the user lists alone."""

    def allowed_chat_ids(self) -> list[str]:
        return self.allowed_chats


class SlackMode(enum.StrEnum):
    """How Slack reaches the app; the same events and presses either way."""

    EVENTS = "events"
    """The Events API over HTTP: Slack posts, signed, to ``/slack/events`` and
    ``/slack/interactions`` (the gateway needs a public HTTPS address)."""
    SOCKET = "socket"
    """Socket Mode: the app opens a WebSocket to Slack with its app-level token
    (no public address; the two routes are not served)."""


class SlackConfig(ChatSettings, frozen=True, forbid_unknown_fields=True):
    """The Slack app: the Events API over HTTP or Socket Mode (:class:`SlackMode`),
    and the group keys (:mod:`chatlane.groups`; a message in a thread the bot is in
    counts as a mention)."""

    CHAT_KINDS: ClassVar[tuple[str, ...]] = ("channel", "thread")
    CHAT_ID: ClassVar[re.Pattern[str]] = re.compile(r"[A-Z0-9]+")
    CHAT_ID_SHAPE: ClassVar[str] = "a Slack conversation id (such as 'C0123ABCD')"
    CHATS_KEY: ClassVar[str] = "allowed_channels"

    enabled: bool = False
    bot_token: Secret = Secret(env="SLACK_BOT_TOKEN")
    """The bot user's OAuth token (``xoxb-…``), for the Web API."""
    mode: SlackMode = SlackMode.EVENTS
    signing_secret: Secret = Secret(env="SLACK_SIGNING_SECRET")
    """Checks that a request to ``/slack/…`` comes from Slack (``events`` mode only)."""
    app_token: Secret = Secret(env="SLACK_APP_TOKEN")
    """The app-level token (``xapp-…``, scope ``connections:write``) that opens Socket
    Mode's WebSocket (``socket`` mode only)."""
    api_url: str = "https://slack.com/api"
    allowed_channels: list[str] = msgspec.field(default_factory=list)
    """Conversation ids (channels, private channels, group DMs) where the bot answers;
    empty: every one it is in. DMs are governed by the user lists alone."""

    def allowed_chat_ids(self) -> list[str]:
        return self.allowed_channels


DISCORD_API_URL: Final = "https://discord.com/api/v10"


class DiscordConfig(ChatSettings, frozen=True, forbid_unknown_fields=True):
    """The Discord bot: the gateway (a WebSocket it opens) and the REST API, with discord.py,
    and the group keys (:mod:`chatlane.groups`; a reply to the bot counts as a mention,
    and a thread is keyed by its parent channel's id)."""

    CHAT_KINDS: ClassVar[tuple[str, ...]] = ("channel", "thread")
    CHAT_ID: ClassVar[re.Pattern[str]] = re.compile(r"[0-9]+")
    CHAT_ID_SHAPE: ClassVar[str] = "a Discord channel id (a snowflake: digits)"
    CHATS_KEY: ClassVar[str] = "allowed_channels"

    enabled: bool = False
    token: Secret = Secret(env="DISCORD_BOT_TOKEN")
    """The bot's token (developer portal → the application → *Bot*)."""
    api_url: str = DISCORD_API_URL
    """The REST API (a stand-in in tests); the gateway's address is asked of it."""
    message_content: bool = True
    """Ask for the privileged Message Content intent (it must be enabled in the developer
    portal); without it Discord sends a message's text only in DMs and when it mentions
    the bot."""
    allow_bots: bool = False
    """Read messages of other bots and webhooks too (never the bot's own)."""
    max_attachment_bytes: Bytes = 25 * 1024 * 1024
    """As :class:`ChatSettings`; 25 MB, Discord's long-standing upload limit."""
    typing: bool = True
    """Show "… is typing" in a channel while its message is being worked on."""
    allowed_channels: list[str] = msgspec.field(default_factory=list)
    """Channel ids where the bot answers (a thread counts as its parent channel);
    empty: every channel it can read. DMs are governed by the user lists alone."""
    allowed_guilds: list[str] = msgspec.field(default_factory=list)
    """Server (guild) ids where the bot answers; empty: every server it is in. Checked as
    messages arrive: a message from another server is ignored."""

    def allowed_chat_ids(self) -> list[str]:
        return self.allowed_channels


class ResetPolicyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """When conversations end by themselves (both off by default)."""

    idle_after: PositiveSeconds | None = None
    """Seconds without activity."""
    daily_at_hour: int | None = None
    """Hour of the day (0-23, in ``scheduler.timezone``)."""
    notify: bool = True


class AutoResetConfig(ResetPolicyConfig, frozen=True, forbid_unknown_fields=True):
    per_platform: dict[str, ResetPolicyConfig] = msgspec.field(default_factory=dict)
    per_chat_type: dict[str, ResetPolicyConfig] = msgspec.field(default_factory=dict)


class CronJobConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A job from the configuration: never stored, never removable at run time."""

    schedule: str
    prompt: str
    target: str = "local"
    id: str = ""


CHAT_PLATFORMS: Final = ("telegram", "slack", "discord")
"""The chat adapters whose sections hold the group keys (:mod:`chatlane.groups`)."""
SERVED_ALWAYS: Final = ("web", "api")
"""The platforms ``chatlane serve`` always runs: the web chat and the API."""

_SCHEDULER = SchedulerSettings()


class SchedulerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    timezone: str = "UTC"
    """Of cron expressions and daily reset hours; the same in every process."""
    chat_job_cap: Count = _SCHEDULER.chat_job_cap
    """Jobs one chat may create with ``/cron add``."""
    user_job_cap: Count = _SCHEDULER.user_job_cap
    """Jobs one user (or API client) may create with ``/cron add``, over all their chats."""
    total_job_cap: Count = _SCHEDULER.total_job_cap
    """Jobs all chats together may create with ``/cron add``."""
    min_interval: Seconds = _SCHEDULER.min_interval
    """Seconds that must at least pass between two runs of a job made from a chat."""


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything ``chatlane serve`` needs; every field has a working default."""

    server: ServerConfig = ServerConfig()
    store: StoreConfig = StoreConfig()
    agent: AgentConfig = AgentConfig()
    runtime: RuntimeSettings = GATEWAY_RUNTIME
    """Decoded from ``[runtime]`` and ``[limits]`` (see :data:`RUNTIME_KEYS`)."""
    limits: LimitsConfig = LimitsConfig()
    api: ApiConfig = ApiConfig()
    web: WebConfig = WebConfig()
    allow: dict[str, list[str]] = msgspec.field(default_factory=dict)
    """Per-platform allowlists of user ids; a platform not listed allows everyone."""
    telegram: TelegramConfig = TelegramConfig()
    slack: SlackConfig = SlackConfig()
    discord: DiscordConfig = DiscordConfig()
    groups: GroupsConfig = GroupsConfig()
    delivery: DeliverySettings = DeliverySettings()
    confirm_new: bool = True
    namespace: str = "main"
    auto_reset: AutoResetConfig = AutoResetConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    cron: list[CronJobConfig] = msgspec.field(default_factory=list)

    def allows(self, source: SessionSource) -> bool:
        """Whether ``source``'s user may use the gateway, in its chat.

        The one authorization rule, for a message and for every run of a job
        created from a chat alike: ``allow.<platform>`` (a platform not listed
        allows everyone), then the platform's own user and chat lists
        (:meth:`~chatlane.groups.GroupSettings.allows`), the same for every
        chat adapter.
        """
        allowed = self.allow.get(source.platform)
        if allowed is not None and (source.user_id or "") not in allowed:
            return False
        section = self.chat_settings(source.platform)
        return section is None or section.allows(source)

    def admin_commands(self) -> AdminCommands:
        """Who may run which commands in a shared session: ``groups.admin_commands`` for
        each chat platform's ``admins`` alone."""
        admins = {
            platform: frozenset(section.admins)
            for platform in CHAT_PLATFORMS
            if (section := self.chat_settings(platform)) is not None
        }
        return AdminCommands(frozenset(self.groups.admin_commands), admins)

    def served_platforms(self) -> tuple[str, ...]:
        """The platforms ``chatlane serve`` runs an adapter for: the web chat and the API
        always, and each chat platform whose section is enabled."""
        enabled = {
            "telegram": self.telegram.enabled,
            "slack": self.slack.enabled,
            "discord": self.discord.enabled,
        }
        return (*SERVED_ALWAYS, *(name for name in CHAT_PLATFORMS if enabled[name]))

    def chat_settings(self, platform: str) -> GroupSettings | None:
        """The section of chat adapter ``platform`` (``[telegram]`` …), if it has one."""
        section = getattr(self, platform, None) if platform in CHAT_PLATFORMS else None
        return section if isinstance(section, GroupSettings) else None


def load_config(path: str | Path | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """Read ``path`` (TOML, optional), apply ``CHATLANE_…`` overrides, and validate.

    :raises ConfigError: naming the key, the value and what was expected.
    """
    environ = os.environ if environ is None else environ
    raw = _read_toml(Path(path)) if path is not None else {}
    _apply_env(raw, environ)
    config = _convert(raw)
    _check(config)
    return config


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ConfigError(f"config file {str(path)!r}: {error.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {error}") from None
    except RecursionError:
        raise ConfigError(f"config file {str(path)!r} is nested too deeply to read") from None


def _apply_env(raw: dict[str, Any], environ: Mapping[str, str]) -> None:
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        if not _encodable(value):
            raise ConfigError(
                f"environment {name}: its value is not valid UTF-8 (set it in a UTF-8 locale)"
            )
        path = name.removeprefix(ENV_PREFIX).lower().split("__")
        target = raw
        for part in path[:-1]:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError(f"environment {name}: {part!r} is not a section")
        target[path[-1]] = _env_value(value)


def _encodable(text: str) -> bool:
    """Whether ``text`` is valid Unicode: bytes a locale could not decode come into Python
    as lone surrogates, which no UTF-8 can carry."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _env_value(value: str) -> Any:
    """Environment values are strings; read numbers, booleans and lists as TOML would."""
    try:
        return tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return value


def _convert(raw: dict[str, Any]) -> Config:
    delivery = raw.get("delivery")
    if isinstance(delivery, dict):
        unknown = sorted(set(delivery) - _DELIVERY_FIELDS)
        if unknown:
            raise ConfigError(f"unknown configuration key 'delivery.{unknown[0]}'")
    allow = raw.get("allow")
    if isinstance(allow, dict):
        raw["allow"] = {platform: _ids(f"allow.{platform}", ids) for platform, ids in allow.items()}
    discord = raw.get("discord")
    if isinstance(discord, dict):
        raw["discord"] = _snowflake_lists(discord)
    telegram = raw.get("telegram")
    if isinstance(telegram, dict):
        raw["telegram"] = _id_lists("telegram", telegram)
    try:
        return msgspec.convert(_settings_layout(raw), Config, strict=False)
    except msgspec.ValidationError as error:
        raise ConfigError(_explain(str(error), raw)) from None


_DELIVERY_FIELDS = frozenset(f.name for f in dataclasses.fields(DeliverySettings))


def _settings_layout(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with ``[runtime]`` and the runtime's ``[limits]`` keys where the settings keep them.

    :raises ConfigError: for a ``[runtime]`` key that is not a setting.
    """
    runtime, limits = raw.get("runtime", {}), raw.get("limits", {})
    if not (isinstance(runtime, dict) and isinstance(limits, dict)):
        return raw  # the decoder names the section that is not a table
    settings: dict[str, Any] = {"leases": {"max_active_sessions": GATEWAY_MAX_ACTIVE_SESSIONS}}
    kept_limits: dict[str, Any] = {}
    for section, table in (("runtime", runtime), ("limits", limits)):
        for key, value in table.items():
            where = RUNTIME_KEYS.get((section, key))
            if where is None and section == "runtime" and key in _RUNTIME_FIELDS:
                where = (key,)
            if where is not None:
                _put(settings, where, _policy_names(value) if where[0] == "busy" else value)
            elif section == "limits":
                kept_limits[key] = value
            else:
                raise ConfigError(f"unknown configuration key 'runtime.{key}'")
    return {**raw, "runtime": settings, "limits": kept_limits}


def _put(table: dict[str, Any], where: tuple[str, ...], value: Any) -> None:
    for part in where[:-1]:
        table = table.setdefault(part, {})
    table[where[-1]] = value


def _policy_names(value: Any) -> Any:
    """Busy policy names are read as ``BusyPolicy.parse`` reads them: case and spaces aside."""
    if isinstance(value, str):
        return value.strip().lower()
    if isinstance(value, dict):
        return {key: _policy_names(policy) for key, policy in value.items()}
    return value


def _ids(key: str, ids: object, what: str = "user ids") -> list[str]:
    """Ids may be written as numbers (Telegram's are); they are compared as strings.

    :raises ConfigError: naming ``key`` unless ``ids`` is a list of ids.
    """
    if not isinstance(ids, list) or not all(_is_id(i) for i in ids):
        raise ConfigError(
            f"configuration key {key!r} = {ids!r}: "
            f"expected a list of {what} (strings or whole numbers)"
        )
    return [str(i) for i in ids]


DISCORD_ID_LISTS: Final = ("allowed_users", "allowed_channels", "allowed_guilds", "admins")
TELEGRAM_ID_LISTS: Final = {
    "allowed_users": "user ids",
    "allowed_chats": "chat ids",
    "admins": "user ids",
}


def _id_lists(section_name: str, section: dict[str, Any]) -> dict[str, Any]:
    """``[telegram]`` with its id lists as strings (TOML may hold Telegram's ids as numbers).

    :raises ConfigError: naming ``telegram.<list>`` unless it is a list of ids.
    """
    converted: dict[str, Any] = {
        name: _ids(f"{section_name}.{name}", section[name], what)
        for name, what in TELEGRAM_ID_LISTS.items()
        if name in section
    }
    return {**section, **converted}


def _snowflake_lists(section: dict[str, Any]) -> dict[str, Any]:
    """``[discord]`` with its id lists as strings of digits (TOML may hold them as numbers).

    :raises ConfigError: naming ``discord.<list>`` unless it is a list of Discord ids.
    """
    lists = {name: section[name] for name in DISCORD_ID_LISTS if name in section}
    for name, ids in lists.items():
        if not isinstance(ids, list) or not all(_is_snowflake(i) for i in ids):
            raise ConfigError(
                f"configuration key {f'discord.{name}'!r} = {ids!r}: expected a list of "
                "Discord ids (snowflakes: whole numbers, as numbers or strings of digits)"
            )
    return {**section, **{name: [str(i).strip() for i in ids] for name, ids in lists.items()}}


def _is_snowflake(value: object) -> bool:
    if isinstance(value, str):
        value = value.strip()
        return value.isascii() and value.isdigit()
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_id(value: object) -> bool:
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def _explain(message: str, raw: dict[str, Any]) -> str:
    """``Expected `int`, got `str` - at `$.server.port``` → key, value and expectation.

    The decoder's path is in the settings' layout; the key named is the file's.
    """
    what, _, where = message.partition(" - at `")
    parts = re.findall(r"\.([^.\[`]+)|\[(\d+|\.\.\.)\]", where)
    path = ["".join(groups).replace("...", "*") for groups in parts]
    if what.startswith("Object contains unknown field"):
        return f"unknown configuration key {'.'.join([*_file_path(path), what.split('`')[1]])!r}"
    info = _type_at(path)
    bad = re.match(r"Invalid enum value (.*)", what)
    if where.startswith("key` in "):
        info = info.key_type if isinstance(info, msgspec.inspect.DictType) else None
        path = [*path, "*"]
    file_path = _file_path(path)
    if isinstance(info, msgspec.inspect.StructType) and info.cls is Secret:
        key = ".".join(_written_secret(raw, file_path))
        return f"configuration key {key!r}: {SECRET_SHAPE}"  # the value never shown
    if bad is not None and file_path[-1:] == ["*"]:
        file_path[-1] = _entry_named(raw, file_path[:-1], bad.group(1))
        shown = ""
    else:
        value = _lookup(raw, file_path)
        shown = f" = {value!r}" if value is not None else ""
    expected = _expectation(info)
    why = f"expected {expected}" if expected else what.lower()
    return f"configuration key {'.'.join(file_path)!r}{shown}: {why}"


def _written_secret(raw: Any, path: list[str]) -> list[str]:
    """``path`` with a table's entry (``*``) named: the first whose secret is not a table."""
    if "*" not in path:
        return path
    at = path.index("*")
    table = _lookup(raw, path[:at])
    for name, entry in table.items() if isinstance(table, dict) else ():
        if not isinstance(_lookup(entry, path[at + 1 :]), dict):
            return [*path[:at], str(name), *path[at + 1 :]]
    return path


def _file_path(path: list[str]) -> list[str]:
    """A decoder path in the settings' layout as the file's key path."""
    if path[:1] == ["runtime"]:
        for (section, key), where in RUNTIME_KEYS.items():
            if tuple(path[1 : 1 + len(where)]) == where:
                return [section, key, *path[1 + len(where) :]]
    return path


def _type_at(path: list[str]) -> msgspec.inspect.Type | None:
    """The decoded type at ``path`` (``*``: any entry of a dict or list), if it can be told."""
    info: msgspec.inspect.Type | None = msgspec.inspect.type_info(Config)
    for part in path:
        if isinstance(info, msgspec.inspect.StructType | msgspec.inspect.DataclassType):
            info = next((f.type for f in info.fields if f.encode_name == part), None)
        elif isinstance(info, msgspec.inspect.DictType):
            info = info.value_type
        elif isinstance(info, msgspec.inspect.ListType):
            info = info.item_type
        else:
            return None
    return info


def _expectation(info: msgspec.inspect.Type | None) -> str:
    """What a bounded number or an enum must be, in words ("" for anything else).

    A lowest value only the configuration enforces (a lease TTL's) is the one told.
    """
    if isinstance(info, msgspec.inspect.EnumType):
        return "one of: " + ", ".join(str(member.value) for member in info.cls)
    if isinstance(info, msgspec.inspect.UnionType):  # ``… | None``: the number's bounds
        info = next((t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)), None)
    configured = None
    if isinstance(info, msgspec.inspect.Metadata):
        configured = (info.extra or {}).get(CONFIGURED_GE)
        info = info.type
    if not isinstance(info, msgspec.inspect.IntType | msgspec.inspect.FloatType):
        return ""
    whole = isinstance(info, msgspec.inspect.IntType)
    if configured is not None:
        return expectation(whole, configured, True, info.le)
    if info.gt is not None:
        return expectation(whole, info.gt, False, info.le)
    if info.ge is not None:
        return expectation(whole, info.ge, True, info.le)
    return ""


def _entry_named(raw: dict[str, Any], path: list[str], bad: str) -> str:
    """The key of the entry of table ``path`` whose value (or key) the decoder refused."""
    table = _lookup(raw, path)
    if isinstance(table, dict):
        for key, value in table.items():
            if bad in (repr(key), repr(_policy_names(value))):
                return str(key)
    return "*"


def _lookup(raw: Any, path: list[str]) -> Any:
    for part in path:
        if isinstance(raw, dict) and part in raw:
            raw = raw[part]
        elif isinstance(raw, list) and part.isdigit() and int(part) < len(raw):
            raw = raw[int(part)]
        else:
            return None
    return raw


def check_config(config: Config) -> None:
    """Validate ``config`` as a whole (``load_config`` does; so must code that changes it).

    :raises ConfigError: naming the key, the value and what was expected.
    """
    _check(config)


def _check(config: Config) -> None:
    if not config.namespace:
        raise ConfigError("configuration key 'namespace' = '': expected a non-empty name")
    _check_server(config.server)
    _check_bounds(config)
    _check_openai(config.agent.openai)
    _check_api_clients(config.api)
    _check_api_urls(config)
    config.groups.check()
    for platform in CHAT_PLATFORMS:
        section = config.chat_settings(platform)
        if section is not None:
            check_group_settings(platform, section)
    for chat_type in config.auto_reset.per_chat_type:
        if chat_type not in {t.value for t in ChatType}:
            raise ConfigError(
                f"configuration key 'auto_reset.per_chat_type.{chat_type}': "
                f"expected a chat type: {', '.join(t.value for t in ChatType)}"
            )


def _check_server(server: ServerConfig) -> None:
    if not _is_host(server.host):
        raise ConfigError(
            f"configuration key 'server.host' = {server.host!r}: expected an IP address "
            "or a host name (127.0.0.1, ::1, 0.0.0.0, localhost, chat.example.com)"
        )
    if not 0 < server.port < 65536:
        raise ConfigError(
            f"configuration key 'server.port' = {server.port}: expected a port between 1 and 65535"
        )


_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _is_host(host: str) -> bool:
    """Whether ``host`` is an IP address, or a name of DNS labels whose last is no number
    (``999.1.1.1`` is neither: an address out of range)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        labels = host.removesuffix(".").split(".")
        named = len(host) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in labels)
        return named and not labels[-1].isdigit()
    return True


def _check_openai(openai: OpenAIConfig) -> None:
    for index, url in enumerate(openai.allowed_base_urls):
        try:
            Prefix.parse(normal(url))
        except EndpointRefused:
            key = f"agent.openai.allowed_base_urls[{index}]"
            raise ConfigError(
                f"configuration key {key!r} = {redact_urls(url)!r}: "
                "expected an http(s) URL without userinfo, query, fragment or escapes"
            ) from None


def _check_api_urls(config: Config) -> None:
    """Each platform's API address is an http(s) URL without credentials, query or fragment
    (the adapters build their requests' URLs on it)."""
    for platform, section in (
        ("telegram", config.telegram),
        ("slack", config.slack),
        ("discord", config.discord),
    ):
        try:
            url = urlsplit(section.api_url)
            valid = url.scheme in ("http", "https") and bool(url.hostname) and url.port != 0
        except ValueError:  # an unclosed IPv6 bracket, a port out of range
            valid = False
        if not valid or url.username or url.password or url.query or url.fragment:
            raise ConfigError(
                f"configuration key '{platform}.api_url' = {redact_urls(section.api_url)!r}: "
                "expected an http(s) URL without credentials, query or fragment, such as "
                f"{_API_URL_EXAMPLES[platform]!r}"
            )


_API_URL_EXAMPLES = {
    "telegram": "https://api.telegram.org",
    "slack": "https://slack.com/api",
    "discord": "https://discord.com/api/v10",
}


def _check_bounds(config: Config) -> None:
    """Every bounded number of every section is in its range, as the configuration's
    (a lease TTL of at least a second: :data:`~chatlane.runtime.limits.CONFIGURED_LEASE_TTL`).

    :raises ConfigError: naming the first key out of its range.
    """
    found = out_of_bounds(config, configured=True)
    if found is not None:
        key = ".".join(_file_path(list(found.path)))
        raise ConfigError(f"configuration key {key!r} = {found.value!r}: expected {found.expected}")


def _check_api_clients(api: ApiConfig) -> None:
    """Each client has a token source; no client's prefix starts another's (or is empty).

    :raises ConfigError: naming the client.
    """
    prefixes = {name: client_prefix(name, client) for name, client in api.clients.items()}
    for name, client in api.clients.items():
        if not (client.token.env or client.token.file):
            raise ConfigError(
                f"configuration key 'api.clients.{name}.token': expected {{ env = … }} "
                "or { file = … }"
            )
        for other, prefix in prefixes.items():
            if other != name and prefix.startswith(prefixes[name]):
                raise ConfigError(
                    f"configuration key 'api.clients.{name}.prefix' = {prefixes[name]!r}: "
                    f"client {other!r} uses {prefix!r}, which starts with it, so {name!r} "
                    "could name its sessions"
                )


URL_VARIABLE: Final = "CHATLANE_URL"
"""Names the gateway the command-line clients talk to, over the configuration's address."""


def gateway_url(config: Config, environ: Mapping[str, str] | None = None) -> str:
    """Where a client on this machine reaches the gateway ``config`` serves.

    ``$CHATLANE_URL`` when set; else ``server.host`` and ``server.port``, with a
    wildcard host (``0.0.0.0``, ``::``) reached on loopback.
    """
    environ = os.environ if environ is None else environ
    named = environ.get(URL_VARIABLE, "").strip()
    if named:
        return named
    host = config.server.host
    if config.server.is_wildcard():
        host = "::1" if ":" in host else "127.0.0.1"
    return http_url(host, config.server.port)


def http_url(host: str, port: int) -> str:
    """``http://host:port``, an IPv6 address in brackets (``http://[::1]:8080``)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def chat_history_path(environ: Mapping[str, str] | None = None) -> Path:
    """Where ``chatlane chat`` keeps the lines typed at its prompt: ``chatlane/chat_history``
    in the user's state folder (``$XDG_STATE_HOME``, else ``~/.local/state``)."""
    environ = os.environ if environ is None else environ
    state = environ.get("XDG_STATE_HOME", "").strip()
    base = Path(state) if Path(state).is_absolute() else Path.home() / ".local" / "state"
    return base / "chatlane" / "chat_history"


def client_prefix(name: str, client: ApiClientConfig) -> str:
    """The session-name prefix of API client ``name``: its own, or ``<name>:``."""
    return client.prefix or f"{name}:"
