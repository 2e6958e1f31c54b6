"""A PostgreSQL server for tests and benchmarks: ``$CHATLANE_TEST_POSTGRES_URL``, or a throwaway.

The throwaway cluster is made with ``initdb`` and run with ``pg_ctl`` from
PATH or Debian's ``/usr/lib/postgresql/<version>/bin``, in a temporary
directory, on 127.0.0.1 and a free port, with ``fsync`` off (nothing in it
outlives the run); it is stopped when the block ends. ``initdb`` refuses to
run as root, so as root the cluster runs as the ``postgres`` user. Connections
over TCP need the password (SCRAM), so a wrong one is refused as on a real server.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from chatlane.testing_redis import TestServerError, free_port

__all__ = ["ENV", "PASSWORD", "USER", "binaries", "missing", "postgres_server", "throwaway"]

ENV = "CHATLANE_TEST_POSTGRES_URL"
USER, PASSWORD = "chatlane", "chatlane-test"


def binaries() -> Path | None:
    """The directory holding ``initdb`` and ``pg_ctl``, or None if there is none."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(found).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), reverse=True)
    return Path(versions[0]).parent if versions else None


def _as_owner() -> list[str]:
    """How to run a server command: as ``postgres`` when this process is root."""
    if os.geteuid() != 0:
        return []
    if shutil.which("runuser") is None:
        raise TestServerError("running as root, and no runuser to start postgres as its own user")
    return ["runuser", "-u", "postgres", "--"]


def _run(command: list[str], log: Path) -> None:
    with log.open("ab") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode:
        tail = log.read_text()[-500:]
        raise TestServerError(f"{' '.join(command)} failed ({done.returncode}): {tail}")


@contextmanager
def throwaway_cluster(directory: Path) -> Iterator[str]:
    """Yield the URL of a new cluster in ``directory`` (created), stopped when the block ends.

    :raises TestServerError: no PostgreSQL is installed, or the cluster did not start.
    """
    found = binaries()
    if found is None:
        raise TestServerError("no initdb/pg_ctl on PATH or in /usr/lib/postgresql/*/bin")
    owner, data, log = _as_owner(), directory / "data", directory / "commands.log"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "password").write_text(PASSWORD + "\n")
    if owner:
        entry = pwd.getpwnam("postgres")
        for path in (directory, directory / "password"):
            os.chown(path, entry.pw_uid, entry.pw_gid)
    init = [str(found / "initdb"), "-D", str(data), "-U", USER, "--auth-local=trust"]
    _run([*owner, *init, "--auth-host=scram-sha-256", f"--pwfile={directory / 'password'}"], log)
    port = free_port()
    options = f"-p {port} -k {directory} -c listen_addresses=127.0.0.1 -c fsync=off"
    pg_ctl = [*owner, str(found / "pg_ctl"), "-D", str(data), "-l", str(directory / "server.log")]
    _run([*pg_ctl, "-o", options, "-w", "start"], log)
    try:
        yield f"postgresql://{USER}:{PASSWORD}@127.0.0.1:{port}/postgres"
    finally:
        _run([*pg_ctl, "-m", "immediate", "-w", "stop"], log)


def missing() -> str | None:
    """Why no PostgreSQL server is there for the tests, or None if there is (or can be) one."""
    if os.environ.get(ENV) or binaries() is not None:
        return None
    return f"${ENV} is not set and initdb/pg_ctl are not installed (PATH, /usr/lib/postgresql)"


@contextmanager
def postgres_server() -> Iterator[str]:
    """Yield a PostgreSQL URL: ``$CHATLANE_TEST_POSTGRES_URL``, or a throwaway cluster's.

    :raises TestServerError: a throwaway cluster is needed and cannot start (see
        :func:`missing` for whether one could be).
    """
    url = os.environ.get(ENV)
    if url:
        yield url
        return
    with throwaway() as url:
        yield url


@contextmanager
def throwaway() -> Iterator[str]:
    """Yield the URL of a throwaway cluster in a new temporary directory (removed after it).

    :raises TestServerError: no PostgreSQL is installed, or the cluster did not start.
    """
    with (
        tempfile.TemporaryDirectory(prefix="chatlane-pg-") as folder,
        throwaway_cluster(Path(folder)) as url,
    ):
        yield url
