"""The bounds of the settings records built in code: every number within what the stores
hold, and a lease TTL no turn must lose its lease to."""

from __future__ import annotations

from typing import Any

import pytest

from chatlane.delivery.worker import DeliverySettings
from chatlane.errors import ConfigError
from chatlane.runtime.capacity import CapacitySettings
from chatlane.runtime.limits import MAX_BYTES, MAX_COUNT, MAX_SECONDS, MIN_LEASE_TTL
from chatlane.runtime.settings import LeaseSettings, RuntimeSettings
from chatlane.scheduler import SchedulerSettings

TOO_MANY = 99999999999999999999999


@pytest.mark.parametrize(
    ("record", "fields", "message"),
    [
        (
            LeaseSettings,
            {"ttl": 0.001},
            "LeaseSettings.ttl = 0.001: expected a finite number >= 0.1",
        ),
        (
            LeaseSettings,
            {"ttl": 1e300},
            "LeaseSettings.ttl = 1e+300: expected a finite number >= 0.1",
        ),
        (LeaseSettings, {"max_active_sessions": TOO_MANY}, "and <= 1000000000"),
        (LeaseSettings, {"adopt_batch": MAX_COUNT + 1}, "LeaseSettings.adopt_batch = 1000000001"),
        (LeaseSettings, {"poll": 1e300}, "LeaseSettings.poll = 1e+300"),
        (RuntimeSettings, {"queue_cap": TOO_MANY}, "RuntimeSettings.queue_cap"),
        (RuntimeSettings, {"turn_timeout": 1e10}, "RuntimeSettings.turn_timeout"),
        (RuntimeSettings, {"coalesce": {"web": 1e300}}, "coalesce.web = 1e+300"),
        (CapacitySettings, {"queued_bytes": MAX_BYTES + 1}, "and <= 1099511627776"),
        (DeliverySettings, {"max_attempts": TOO_MANY}, "DeliverySettings.max_attempts"),
        (DeliverySettings, {"claim_ttl": 1e300}, "DeliverySettings.claim_ttl"),
        (SchedulerSettings, {"track_cap": TOO_MANY}, "SchedulerSettings.track_cap"),
        (SchedulerSettings, {"claim_ttl": 0}, "SchedulerSettings.claim_ttl = 0: expected"),
        (SchedulerSettings, {"chat_job_cap": 2.5}, "SchedulerSettings.chat_job_cap = 2.5"),
        (SchedulerSettings, {"min_interval": float("inf")}, "SchedulerSettings.min_interval"),
    ],
)
def test_a_number_out_of_bounds_stops_construction(
    record: type[Any], fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        record(**fields)
    assert message in str(raised.value)


def test_the_ends_of_each_range_are_taken() -> None:
    leases = LeaseSettings(ttl=MIN_LEASE_TTL, max_active_sessions=MAX_COUNT)
    assert (leases.ttl, leases.max_active_sessions) == (MIN_LEASE_TTL, MAX_COUNT)
    assert LeaseSettings(ttl=MAX_SECONDS).ttl == MAX_SECONDS
    assert RuntimeSettings(turn_timeout=MAX_SECONDS, coalesce={"web": MAX_SECONDS}).turn_timeout
    assert CapacitySettings(queued_bytes=MAX_BYTES).queued_bytes == MAX_BYTES
    assert SchedulerSettings(total_job_cap=MAX_COUNT).total_job_cap == MAX_COUNT


def test_code_may_use_leases_shorter_than_the_configuration_takes() -> None:
    """Tests watch leases expire within a fraction of a second; the file takes 1 s at least."""
    assert LeaseSettings(ttl=0.15).renew_every == pytest.approx(0.015)
