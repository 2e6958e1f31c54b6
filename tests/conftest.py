"""Fixtures shared by every test package."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.stores.servers import redis_server


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """``$REDIS_URL``, or a throwaway Redis-compatible server started for this run."""
    with redis_server() as url:
        yield url
