"""The hand-off benchmark's split of a sample into hops (``benchmarks.bench_celery.hops_of``):
which delivery of the waiter it reads, and when it says the waiter was woken ahead. Pure
arithmetic over recorded moments: no servers."""

from __future__ import annotations

import pytest

from benchmarks.bench_celery import HOPS, hops_of


def moments(**by_name: list[float]) -> dict[str, dict[str, list[float]]]:
    names = ("sent", "received_at", "prerun_at", "granted_at")
    return {name: {"w": by_name.get(name, [])} for name in names}


def test_a_waiter_woken_at_the_release_is_split_into_every_hop() -> None:
    # its refused first delivery (received 1.0, run 1.1) comes before the release at 10.0
    found = hops_of(
        9.9,
        10.0,
        10.010,
        "w",
        moments(sent=[10.002], received_at=[1.0, 10.004], prerun_at=[1.1, 10.006], granted_at=[10.008]),
    )
    assert set(found) == {"store", "send", "deliver", "dispatch", "claim", "checks"} <= set(HOPS)
    expected = {"store": 100, "send": 2, "deliver": 2, "dispatch": 2, "claim": 2, "checks": 2}
    assert found == {name: pytest.approx(ms, abs=1e-6) for name, ms in expected.items()}
    assert sum(found.values()) - found["store"] == pytest.approx(10.0, abs=1e-6)  # release to start


def test_a_waiter_whose_copy_came_before_the_release_was_woken_ahead() -> None:
    found = hops_of(9.9, 10.0, 10.003, "w", moments(sent=[9.5], received_at=[9.6], prerun_at=[9.7]))
    assert set(found) == {"store", "ahead"}
    assert found["ahead"] == pytest.approx(3.0, abs=1e-6)


def test_stamps_missing_or_out_of_order_leave_their_hops_out() -> None:
    # no copy sent since the release (sent by a process that recorded nothing), no grant stamp
    found = hops_of(9.9, 10.0, 10.010, "w", moments(sent=[9.0], received_at=[10.004], prerun_at=[10.006]))
    assert set(found) == {"store", "dispatch"}
    # nothing received: only the store is known
    assert set(hops_of(9.9, 10.0, 10.010, "w", moments())) == {"store"}
