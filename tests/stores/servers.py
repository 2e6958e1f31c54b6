"""The Redis server the tests use (see :mod:`chatlane.testing_redis`)."""

from __future__ import annotations

from chatlane.testing_redis import redis_server

__all__ = ["redis_server"]
