"""Delivery ids: in creation order, unique within a millisecond, URL-safe."""

from __future__ import annotations

import re

import pytest

from chatlane.delivery.ledger import new_delivery_id


def test_a_delivery_id_sorts_after_those_made_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    made = []
    for moment_ms in (1_700_000_000_000, 1_700_000_000_000, 1_700_000_000_001, 2**47):
        monkeypatch.setattr("time.time_ns", lambda ms=moment_ms: ms * 1_000_000 + 999_999)
        made.append(new_delivery_id())
    assert made[1] != made[0]  # the same moment: the random bits tell them apart
    assert made[2] > max(made[:2])
    assert made[3] > made[2]
    assert made[2].startswith(f"d_{1_700_000_000_001:012x}")
    assert all(re.fullmatch(r"d_[0-9a-f]{36}", d) for d in made)
