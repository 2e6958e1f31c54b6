"""``chatlane serve`` run once as a process, for tests of what it says when it cannot start."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.ports import free_port


def serve_once(directory: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run ``chatlane serve`` (memory store, a free port) in ``directory`` with ``env``
    until it exits (60 s at most); its exit status and output."""
    command = ["serve", "--port", str(free_port()), "--store", "memory://"]
    return subprocess.run(
        [sys.executable, "-m", "chatlane.cli", *command],
        cwd=directory,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


@contextlib.contextmanager
def reaped(process: subprocess.Popen[str]) -> Iterator[subprocess.Popen[str]]:
    """``process``, killed and waited for on the way out if it is still running then
    (a test that failed before it stopped the process leaves nothing behind)."""
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
