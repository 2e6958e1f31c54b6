"""The stored form of approval grants bound to users (``approval_allowlist_by_user``):
each user's commands, read back as written, and nothing else ever read as a grant."""

from __future__ import annotations

import pytest

from chatlane.runtime.persisted import decode_user_grants, encode_user_grants, stored_fields
from chatlane.state import UserGrant
from chatlane.stores.fields import APPROVAL_ALLOWLIST_BY_USER


def test_grants_bound_to_users_keep_their_stored_form() -> None:
    grants = (UserGrant("alice", "ls"), UserGrant("bob", "ls"), UserGrant("alice", "rm x"))
    stored = encode_user_grants(grants)
    assert stored == {"alice": ["ls", "rm x"], "bob": ["ls"]}
    assert sorted(decode_user_grants(stored) or ()) == sorted(grants)
    assert stored_fields({APPROVAL_ALLOWLIST_BY_USER: grants}) == {
        APPROVAL_ALLOWLIST_BY_USER: stored
    }


@pytest.mark.parametrize(
    ("value", "read"),
    [
        (None, None),
        (["alice", "ls"], None),
        ({}, ()),
        ({"alice": "ls"}, ()),
        ({"": ["ls"], "bob": [3, "ls"]}, (UserGrant("bob", "ls"),)),
    ],
)
def test_a_stored_value_that_is_no_grant_is_never_read_as_one(
    value: object, read: tuple[UserGrant, ...] | None
) -> None:
    assert decode_user_grants(value) == read
