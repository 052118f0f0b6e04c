"""What the broker's Redis says of a granted copy's run, asked ahead of the result backend.

A copy of a wait that is granted its slot checks, before its body runs, that its run has not
finished already: the semaphore's Redis may have forgotten the run (restarted empty), but the
broker's Redis (``due_copies.py``: the runs remembered as finished, and the stored copy withdrawn
in the same commands) or the result backend may remember it (``task.py``). The broker's question
is sent first and answered last (``sent_ahead.py``), so that the two cost one wait, not two.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from .due_copies import due_copies_for
from .sent_ahead import SentAhead

logger = logging.getLogger("celery_semaphore")


@dataclass(frozen=True)
class RunInBroker:
    """What the broker's Redis said of a granted copy's run."""

    finished: bool  # it remembers the run finished: this copy must not run it
    remembered: bool  # the run is remembered as finished from now (at most once): no need at its end


class GrantedAhead:
    """A copy of ``run`` was granted: the question whether the broker's Redis remembers the run
    finished, sent now and answered by ``answer`` (the app's other check goes out meanwhile,
    see ``sent_ahead.py``). With ``at_most_once`` (no acks_late: Celery runs it at most once),
    its stored copy is forgotten in the same commands, so that nothing runs it again whatever
    kills this worker, and the run is remembered as finished for ``remember_s`` from now: its
    end then has nothing to tell the broker. Where the broker's Redis cannot say (not a Redis
    broker, no run, or an error), the answer is "not finished": a stored copy comes back when
    due, and its run record drops it. A context manager: the connection goes back to its pool
    on the way out, answered or not."""

    def __init__(self, app: Any, run: str | None, *, at_most_once: bool, remember_s: float) -> None:
        self._sent: SentAhead | None = None
        self._remembered = at_most_once and remember_s > 0
        self._run = run
        store = due_copies_for(app) if run is not None else None
        if store is None or run is None:
            return
        commands = store.grant_commands(run, withdraw=at_most_once, remember_s=remember_s if at_most_once else 0.0)
        try:
            self._sent = SentAhead(store.client, commands)
        except Exception as error:
            logger.debug("could not ask the broker's Redis about run %s: %s", run, error)

    def answer(self) -> RunInBroker:
        """What the broker's Redis said (waiting for its reply if need be)."""
        sent, self._sent = self._sent, None
        if sent is None:
            return RunInBroker(finished=False, remembered=False)
        try:
            finished = sent.replies()[0] is not None
        except Exception as error:
            logger.debug("could not ask the broker's Redis about run %s: %s", self._run, error)
            return RunInBroker(finished=False, remembered=False)
        return RunInBroker(finished=finished, remembered=self._remembered)

    def __enter__(self) -> GrantedAhead:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._sent is not None:
            self._sent.close()
            self._sent = None
