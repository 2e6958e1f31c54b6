"""The throwaway Redis server of :mod:`chatlane.testing_redis` is the one it started."""

from __future__ import annotations

import subprocess

import pytest

from chatlane import testing_redis
from chatlane.testing_redis import PortTaken, free_port, server_binary, wait_until_ready


def start(binary: str, port: int) -> subprocess.Popen[bytes]:
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def test_a_server_answering_on_the_port_that_is_not_the_one_started_is_told() -> None:
    """A server whose port another took meanwhile exits; the other's answer is not its own."""
    try:
        binary = server_binary()
    except testing_redis.TestServerError as error:
        pytest.skip(str(error))
    port = free_port()
    first = start(binary, port)
    try:
        wait_until_ready(port, first, 10.0)  # the one started there: no error
        second = start(binary, port)
        try:
            with pytest.raises(PortTaken, match=f"port {port}"):
                wait_until_ready(port, second, 10.0)
        finally:
            second.kill()
            second.wait(timeout=10)
    finally:
        first.terminate()
        first.wait(timeout=10)
