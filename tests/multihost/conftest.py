"""The network and the store host of the multi-host tests: made by the tests, always removed.

One network per store: the gateway hosts are added to it by the run.
"""

from __future__ import annotations

import importlib.util
import pwd
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from chatlane import stores
from chatlane.testing_redis import TestServerError, server_binary
from tests.multihost.network import Network, NetworkUnavailable
from tests.multihost.servers import postgres_binaries, start_postgres, start_redis


@pytest.fixture(scope="module", params=["redis", "postgresql"])
def store_host(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Network, str]]:
    """A new private network with a store server on a host of its own, ``db``; and its URL."""
    if request.param == "postgresql":
        skip_without_postgres()
    with built_network() as network:
        if request.param == "redis":
            yield from redis_host(network, tmp_path_factory.mktemp("redis"))
        else:
            yield from postgres_host(network)


@contextmanager
def built_network() -> Iterator[Network]:
    """Open a :class:`Network` (skipping, saying why, where none can be made); close it after."""
    network = Network()
    try:
        network.open()
    except NetworkUnavailable as error:
        network.close()
        pytest.skip(str(error))
    try:
        yield network
    finally:
        failures = network.close()
    assert not failures, failures


def redis_host(network: Network, directory: Path) -> Iterator[tuple[Network, str]]:
    try:
        binary = server_binary()
    except TestServerError as error:
        pytest.skip(str(error))
    server, url = start_redis(network.add("db"), binary, directory)
    try:
        yield network, url
    finally:
        server.stop()


def postgres_host(network: Network) -> Iterator[tuple[Network, str]]:
    binaries = postgres_binaries()
    assert binaries is not None
    server, url, data = start_postgres(network.add("db"), binaries)
    try:
        yield network, url
    finally:
        server.stop()
        shutil.rmtree(data, ignore_errors=True)


def skip_without_postgres() -> None:
    """Skip, saying why, unless this chatlane has a PostgreSQL store and a server can run here."""
    if "postgresql" not in getattr(stores, "SCHEMES", ()):
        pytest.skip(
            "this chatlane has no PostgreSQL store: postgresql:// is not a store URL scheme"
        )
    if importlib.util.find_spec("asyncpg") is None:
        pytest.skip("the PostgreSQL store needs asyncpg, which is not installed")
    if postgres_binaries() is None:
        pytest.skip("no PostgreSQL server here: no /usr/lib/postgresql/*/bin with initdb")
    if shutil.which("setpriv") is None or not user_exists("postgres"):
        pytest.skip("PostgreSQL must run as the postgres user: no such user or no setpriv")


def user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True
