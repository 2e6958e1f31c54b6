"""Fixtures shared by every test package."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from chatlane.testing_postgres import missing, postgres_server
from tests.stores.servers import redis_server


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """``$REDIS_URL``, or a throwaway Redis-compatible server started for this run."""
    with redis_server() as url:
        yield url


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """``$CHATLANE_TEST_POSTGRES_URL``, or a throwaway cluster started for this run.

    Skipped, saying why, where neither is there (no PostgreSQL installed); a
    cluster that is installed but does not start is an error.
    """
    reason = missing()
    if reason is not None:
        pytest.skip(f"no PostgreSQL server for the tests: {reason}")
    with postgres_server() as url:
        yield url
