"""Which endpoints a chat may choose: allowlisted prefixes, plain URLs, public addresses."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from chatlane.endpoints import NOT_ALLOWED, EndpointPolicy, EndpointRefused
from chatlane.redaction import CREDENTIALS_REFUSED

CONFIGURED = "https://api.openai.com/v1"
LISTED = ("https://llm.example.com/v1", "http://10.0.0.5:8000/v1", "http://localhost:9000")


def resolving_to(*addresses: str) -> EndpointPolicy:
    """The policy over :data:`LISTED` with a resolver that answers ``addresses`` for any name."""

    async def resolve(host: str, port: int) -> Sequence[str]:
        if not addresses:
            raise OSError("no such host")
        return addresses

    return EndpointPolicy.of(CONFIGURED, LISTED, resolve)


@pytest.mark.parametrize(
    "url",
    [
        CONFIGURED + "/",
        "https://llm.example.com/v1",
        "https://LLM.example.com:443/v1/deeper/",
        "http://10.0.0.5:8000/v1",
        "http://localhost:9000/anything",
    ],
)
async def test_listed_endpoints_are_allowed(url: str) -> None:
    assert await resolving_to("93.184.216.34").check(url) == url.strip().rstrip("/")


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8080/v1",  # not listed
        "http://169.254.169.254/latest/meta-data",
        "https://llm.example.com/v10",  # a sibling, not below the prefix
        "https://llm.example.com:8443/v1",  # another port
        "http://llm.example.com/v1",  # another scheme
        "https://llm.example.com/v1/../admin",
        "https://llm.example.com/v1/%2e%2e/admin",
        "https://llm.example.com/v1?x=",  # swallows /chat/completions
        "https://llm.example.com/v1#x",
        "http://10.0.0.5:8000/v1?",
        "ftp://llm.example.com/v1",
        "https://llm.example.com\\evil/v1",
        "https://llm.example.com/v1\x1b/x",
    ],
)
async def test_everything_else_is_refused_with_one_message(url: str) -> None:
    with pytest.raises(EndpointRefused) as refused:
        await resolving_to("93.184.216.34").check(url)
    assert str(refused.value) == NOT_ALLOWED


@pytest.mark.parametrize(
    "url", ["https://me:hunter2@llm.example.com/v1", "https://llm.example.com/v1?api_key=hunter2"]
)
async def test_credentials_in_a_url_are_refused_as_credentials(url: str) -> None:
    with pytest.raises(EndpointRefused) as refused:
        await resolving_to("93.184.216.34").check(url)
    assert str(refused.value) == CREDENTIALS_REFUSED


@pytest.mark.parametrize(
    "addresses",
    [
        ("127.0.0.1",),
        ("93.184.216.34", "10.1.2.3"),
        ("169.254.169.254",),
        ("::1",),
        ("::ffff:127.0.0.1",),
        ("fe80::1",),
        ("100.64.0.1",),
        (),  # does not resolve
    ],
)
async def test_a_listed_name_must_resolve_to_public_addresses_only(
    addresses: tuple[str, ...],
) -> None:
    with pytest.raises(EndpointRefused) as refused:
        await resolving_to(*addresses).check("https://llm.example.com/v1")
    assert str(refused.value) == NOT_ALLOWED


async def test_an_entry_written_as_an_address_allows_that_private_address() -> None:
    policy = resolving_to()  # nothing resolves: an address is not looked up
    assert await policy.check("http://10.0.0.5:8000/v1/x") == "http://10.0.0.5:8000/v1/x"


async def test_no_entries_allow_only_the_configured_endpoint() -> None:
    policy = EndpointPolicy.of(CONFIGURED)
    assert await policy.check(CONFIGURED) == CONFIGURED
    with pytest.raises(EndpointRefused):
        await policy.check("https://llm.example.com/v1")


@pytest.mark.parametrize("entry", ["https://u:p@h/v1", "https://h/v1?x=1", "h/v1", "https://h/%41"])
def test_a_bad_entry_is_refused(entry: str) -> None:
    with pytest.raises(EndpointRefused):
        EndpointPolicy.of(CONFIGURED, [entry])
