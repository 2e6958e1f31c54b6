"""The PostgreSQL store (``postgresql://…``): the operators' own database, shared by every host.

:class:`PostgresStore` (in :mod:`~chatlane.stores.postgres.store`) keeps the
store contract in a schema of its own, built and upgraded by the versioned
steps of :mod:`~chatlane.stores.postgres.schema`, through asyncpg's pool;
:mod:`~chatlane.stores.postgres.url` reads its URLs.
"""

from __future__ import annotations

from chatlane.stores.postgres.store import PostgresStore

__all__ = ["PostgresStore"]
