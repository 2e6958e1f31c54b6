"""The ids stores make: lease tokens never repeat, conversation ids come in creation order."""

from __future__ import annotations

import os
import re
from unittest import mock

from chatlane.stores.ids import new_conversation_id, new_token

CONVERSATION_ID = re.compile(r"c_[0-9A-Za-z]{19}")


def test_lease_tokens_never_repeat() -> None:
    tokens = [new_token() for _ in range(1_000)]
    assert len(set(tokens)) == len(tokens)


def test_conversation_ids_are_url_safe_and_sort_in_creation_order() -> None:
    made = [new_conversation_id() for _ in range(1_000)]
    assert all(CONVERSATION_ID.fullmatch(made_id) for made_id in made)
    assert made == sorted(made)
    assert len(set(made)) == len(made)


def test_conversation_ids_keep_their_order_when_the_clock_stands_still_or_steps_back() -> None:
    with mock.patch("chatlane.stores.ids.time.time_ns", return_value=1_700_000_000_000_000_000):
        still = [new_conversation_id() for _ in range(50)]
    with mock.patch("chatlane.stores.ids.time.time_ns", return_value=1_600_000_000_000_000_000):
        back = [new_conversation_id() for _ in range(50)]
    assert still + back == sorted(still + back)


def test_conversation_ids_differ_in_their_random_part() -> None:
    with mock.patch("chatlane.stores.ids.time.time_ns", return_value=0):
        tails = {new_conversation_id()[10:] for _ in range(200)}
    assert len(tails) == 200


def test_a_forked_process_never_hands_out_its_parents_lease_tokens() -> None:
    parent = [new_token() for _ in range(3)]
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        os.write(writer, " ".join(new_token() for _ in range(3)).encode())
        os._exit(0)
    os.close(writer)
    os.waitpid(child, 0)
    with os.fdopen(reader) as pipe:
        forked = pipe.read().split()
    assert not set(forked) & set(parent)
    assert {token.rpartition("-")[0] for token in forked} != {parent[0].rpartition("-")[0]}
    assert new_token() not in forked
