"""Fixtures and Hypothesis settings shared by every test package."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import settings

from chatlane.testing_postgres import missing, postgres_server
from tests.stores.servers import redis_server

# Hypothesis as this suite runs it: no per-example deadline, so a loaded machine (two
# workers beside other processes) cannot fail a property on timing, and a failure prints
# the blob that reproduces it. HYPOTHESIS_PROFILE names another profile ("default" brings
# the 200 ms deadline back); pytest's --hypothesis-profile still overrides both.
settings.register_profile(
    "chatlane", settings.get_profile("default"), deadline=None, print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "chatlane"))


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
