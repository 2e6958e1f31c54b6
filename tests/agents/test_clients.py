"""The agent's HTTP clients: a bounded cache, closed on eviction, never mid-stream."""

from __future__ import annotations

from openai import AsyncOpenAI

from chatlane.agents.clients import ClientCache
from chatlane.agents.openai_agent import CLIENT_CACHE_SIZE, OpenAIAgent
from chatlane.config import OpenAIConfig


def client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url, api_key="none")


async def test_the_least_recently_used_client_is_evicted_and_closed() -> None:
    cache = ClientCache(client, size=2)
    async with cache.use("http://a/v1") as first:
        pass
    async with cache.use("http://b/v1"):
        pass
    async with cache.use("http://a/v1") as again:
        assert again is first
    async with cache.use("http://c/v1"):
        pass
    assert cache.urls() == ["http://a/v1", "http://c/v1"]
    assert not first.is_closed()
    async with cache.use("http://d/v1"), cache.use("http://e/v1"):
        pass
    assert first.is_closed()
    await cache.aclose()


async def test_a_client_in_use_is_closed_only_when_its_use_ends() -> None:
    cache = ClientCache(client, size=1)
    async with cache.use("http://a/v1") as streaming:
        async with cache.use("http://b/v1") as other:
            assert not streaming.is_closed(), "a stream is cut off by the eviction"
        assert cache.urls() == ["http://b/v1"]
    assert streaming.is_closed()
    await cache.aclose()
    assert other.is_closed()


async def test_the_agent_keeps_a_bounded_number_of_clients() -> None:
    listed = [f"http://127.0.0.1:9/v{n}" for n in range(CLIENT_CACHE_SIZE * 2)]
    agent = OpenAIAgent(OpenAIConfig(allowed_base_urls=listed))
    for url in listed:
        async with agent._clients.use(await agent.endpoints.check(url)):
            pass
    assert agent.open_endpoints() == listed[-CLIENT_CACHE_SIZE:]
    await agent.aclose()
    assert agent.open_endpoints() == []
