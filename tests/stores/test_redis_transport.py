"""The Redis store over a redis-py client of the user's, and what it refuses at open.

The contract suite runs over this transport too (backend ``redis-py`` in
``tests/stores/conftest.py``); these tests cover what only it has.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile

import pytest
import redis.asyncio as aioredis

from chatlane.errors import ConfigError, StoreError
from chatlane.stores import open_store
from chatlane.stores.redis import RedisStore
from chatlane.stores.redis_transport import RedisPyTransport, as_resp2
from chatlane.stores.resp import ServerNotReady
from chatlane.testing_redis import free_port
from tests.keys import chat_key
from tests.stores.test_resp import client, private_server
from tests.stores.test_resp_health import SPIN


async def test_a_client_that_decodes_replies_is_refused() -> None:
    decoding = aioredis.Redis(decode_responses=True)
    with pytest.raises(ConfigError, match="decode_responses"):
        await RedisStore.from_client(decoding)
    await decoding.aclose()


async def test_the_users_client_stays_open_unless_handed_over() -> None:
    with private_server() as port:
        admin = client(port)
        mine = aioredis.Redis(port=port, protocol=3, client_name="users-own")
        store = await RedisStore.from_client(mine, prefix="users")
        assert await store.generation(chat_key("c")) == 0
        await store.close()
        assert (await admin.execute("CLIENT", "LIST")).count(b"name=users-own") == 1
        handed = await RedisStore.from_client(mine, prefix="users", close_client=True)
        await handed.close()
        assert (await admin.execute("CLIENT", "LIST")).count(b"name=users-own") == 0
        await admin.close()


async def test_not_ready_replies_through_redis_py_are_connection_errors() -> None:
    with private_server("--lua-time-limit", "20") as port:
        spinner = client(port)
        users = aioredis.Redis(port=port)
        transport = RedisPyTransport(users, owned=True)
        spinning = asyncio.ensure_future(spinner.execute("EVAL", SPIN, 0, 300))
        refusal = None
        while refusal is None:  # until the server says it is busy
            try:
                await transport.execute("PING")
            except ServerNotReady as busy:
                refusal = str(busy)
        assert "BUSY" in refusal
        assert await spinning == 1
        await transport.close()
        await spinner.close()


def test_resp3_replies_take_resp2_shapes() -> None:
    assert as_resp2({b"f": b"v", b"g": [True, "x", 1.5]}) == [b"f", b"v", b"g", [1, b"x", 1.5]]
    assert sorted(as_resp2({b"a", b"b"})) == [b"a", b"b"]
    assert as_resp2(None) is None


@pytest.mark.parametrize("transport", ["url", "redis-py"])
async def test_a_redis_cluster_node_is_refused_at_open_saying_why(transport: str) -> None:
    bus = str(free_port())  # the default, port + 10000, may be past 65535
    with (
        tempfile.TemporaryDirectory() as folder,
        private_server(
            "--cluster-enabled",
            "yes",
            "--cluster-port",
            bus,
            "--cluster-config-file",
            f"{folder}/n",
        ) as port,
    ):
        users = aioredis.Redis(port=port)
        opening = (
            RedisStore.open(f"redis://127.0.0.1:{port}/0")
            if transport == "url"
            else RedisStore.from_client(users)
        )
        with pytest.raises(StoreError, match="Redis Cluster node"):
            await opening
        await users.aclose()


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0", "redis+sentinel://127.0.0.1:1/main"])
async def test_without_hiredis_the_error_says_what_to_install(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "hiredis", None)
    for name in [
        n for n in sys.modules if n.startswith(("chatlane.stores.redis", "chatlane.stores.resp"))
    ]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(StoreError, match=r"pip install 'chatlane\[redis\]'"):
        await open_store(url)
