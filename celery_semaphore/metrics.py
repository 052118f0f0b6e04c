"""Prometheus metrics, when ``prometheus_client`` is installed (the ``prometheus`` extra).

Placeholder: every function is a no-op until filled in.
"""

from __future__ import annotations


def acquired(family: str, waited: float) -> None:
    """A task of ``family`` got its slot after waiting ``waited`` seconds since it first asked."""


def refused(family: str) -> None:
    """A task of ``family`` found no free slot and will wait."""


def lease_lost(family: str) -> None:
    """A renewal found a lease gone and could not take it back."""


def reclaimed(family: str, count: int) -> None:
    """``count`` slots of dead holders were given back by a worker's parent process."""
