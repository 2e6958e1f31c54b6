"""A store URL's password never shows in a message, whatever characters it holds."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from chatlane.errors import StoreError
from chatlane.redaction import redact_urls
from chatlane.serve import shown_store
from chatlane.stores import open_store
from chatlane.stores.postgres.url import parse_url as parse_postgres_url
from chatlane.stores.postgres.url import redact as redact_postgres
from chatlane.stores.redis_sentinel import parse_sentinel_url
from chatlane.stores.redis_url import parse_url as parse_redis_url
from chatlane.stores.redis_url import redact as redact_redis
from chatlane.stores.sqlite_schema import parse_url as parse_sqlite_url
from chatlane.stores.urls import mask_userinfo

HALVES = ("12", "pw-tail")
"""A password's two halves; each must stay out of every message (``12`` would pass for a
port)."""

PASSWORDS = [f"{HALVES[0]}{c}{HALVES[1]}" for c in "@/?#"] + [f"xq{c}{HALVES[1]}" for c in "@/?#"]

TEMPLATES = [
    "redis://:{}@127.0.0.1:1/0",
    "redis://bot:{}@127.0.0.1:1/0?socket_connect_timeout=0.5",
    "rediss://bot:{}@127.0.0.1:1/0?ssl_cert_reqs=none&socket_connect_timeout=0.5",
    "redis+sentinel://:{}@127.0.0.1:1/main?socket_connect_timeout=0.5",
    "postgresql://bot:{}@127.0.0.1:1/chat?connect_timeout=0.5",
    "postgres://bot:{}@127.0.0.1:1/chat?schema=bot_eu&connect_timeout=0.5",
]


def shown(message: str, password: str) -> bool:
    start = password[:2]
    return HALVES[1] in message or f":{start}" in message or f"{start}@" in message


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("password", PASSWORDS)
async def test_no_part_of_the_password_is_in_the_message(template: str, password: str) -> None:
    url = template.format(password)
    with pytest.raises(StoreError) as raised:
        await open_store(url)
    message = str(raised.value)
    assert not shown(message, password), message
    assert "Traceback" not in message
    assert "\n" not in message


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("password", PASSWORDS)
def test_redaction_hides_the_whole_password(template: str, password: str) -> None:
    url = template.format(password)
    for redact in (redact_redis, redact_postgres, mask_userinfo, shown_store):
        assert HALVES[1] not in redact(url), redact
    if "/" not in password:  # a log line's URL: its path may hold an @ of its own
        assert HALVES[1] not in redact_urls(url)


@pytest.mark.parametrize(
    ("parse", "url"),
    [
        (parse_postgres_url, "postgresql://bot:top/pw-tail@127.0.0.1/postgres"),
        (parse_postgres_url, "postgresql://bot:12/pw-tail@127.0.0.1/postgres"),
        (parse_postgres_url, "postgresql://bot:12?pw-tail@127.0.0.1/postgres"),
        (parse_postgres_url, "postgresql://bot:12#pw-tail@127.0.0.1/postgres"),
        (parse_redis_url, "redis://:top/pw-tail@127.0.0.1:6379/0"),
        (parse_redis_url, "redis://:12?pw-tail@127.0.0.1:6379/0"),
        (parse_redis_url, "redis://:12#pw-tail@127.0.0.1:6379/0"),
        (parse_sentinel_url, "redis+sentinel://:top?pw-tail@h1/main"),
        (parse_sentinel_url, "redis+sentinel://:top/pw-tail@h1/main"),
    ],
)
def test_a_password_that_ends_the_address_early_is_refused_unshown(
    parse: Callable[[str], object], url: str
) -> None:
    with pytest.raises(StoreError, match="malformed") as raised:
        parse(url)
    message = str(raised.value)
    assert "pw-tail" not in message
    assert "top" not in message
    assert "Port could not be cast" not in message  # the parser's words quote the "port"
    assert "percent-encode" in message


def test_a_password_with_at_signs_reaches_each_store_whole() -> None:
    endpoint, _ = parse_redis_url("redis://bot:top@pw@tail@127.0.0.1:6380/0")
    assert (endpoint.host, endpoint.port, endpoint.password) == ("127.0.0.1", 6380, "top@pw@tail")
    location = parse_postgres_url("postgresql://bot:top@pw@db.internal/chat")
    assert (
        location.dsn == "postgresql://bot:top%40pw@db.internal/chat"
    )  # asyncpg splits at the first @
    parsed = parse_sentinel_url("redis+sentinel://:top@pw@h1/main")
    assert (parsed.sentinels, parsed.redis_url) == (
        (("h1", 26379),),
        "redis://:top@pw@sentinel-primary/0",
    )


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://:s3cret@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://:top@s3cret@h:6379/0", "redis://:***@h:6379/0"),
        ("postgresql://bot:top@s3cret@h/db", "postgresql://bot:***@h/db"),
        ("postgresql://bot@h/db", "postgresql://bot@h/db"),
        ("postgresql://h/db?application_name=a@b", "postgresql://h/db?application_name=a@b"),
        ("postgresql://bot:top/s3cret@h/db", "postgresql://…"),
        ("mysql:bot:s3cret@h", "…"),
    ],
)
def test_mask_userinfo(url: str, expected: str) -> None:
    assert mask_userinfo(url) == expected


async def test_a_url_of_an_unknown_scheme_is_shown_without_its_password() -> None:
    with pytest.raises(StoreError, match="expected memory://") as raised:
        await open_store("postgressql://bot:top@pw-tail@db.internal/chat")
    assert "pw-tail" not in str(raised.value)
    assert "top" not in str(raised.value)


def test_sqlite_urls_hold_no_password_and_are_shown_as_written() -> None:
    with pytest.raises(StoreError, match="busy_timeout") as raised:
        parse_sqlite_url("sqlite:///data/chat@home.db?busy_timeout=x")
    assert "sqlite:///data/chat@home.db?busy_timeout=x" in str(raised.value)


@pytest.mark.parametrize(
    ("logged", "shown"),
    [
        (
            "postgres store postgresql://bot@h:5432/db?sslmode=require: no answer within 30 s",
            "postgres store postgresql://***@h:5432/db?sslmode=***: no answer within 30 s",
        ),
        ("see https://h/p?a=1&token=zz. Then", "see https://h/p?a=***&token=***. Then"),
        ("at https://h/p?a=1#part: done", "at https://h/p?a=***#***: done"),
        ("(https://h/p?q=1), more", "(https://h/p?q=***), more"),
        ("ends https://h/p?password=pw:", "ends https://h/p?password=***"),
        ("https://h/p?password=a:b c", "https://h/p?password=*** c"),
    ],
)
def test_a_logged_url_keeps_the_sentence_around_it(logged: str, shown: str) -> None:
    """Punctuation ending a query before a space is the sentence's: kept, never redacted
    with the value; anywhere else it may be a value's, and goes with it."""
    assert redact_urls(logged) == shown
