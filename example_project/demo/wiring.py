"""The tasks' app, wired for one demo run: ``celery -A example_project.demo.wiring worker``.

``example_project/tasks.py`` is configured for a local Redis and local services, as a project of
your own would be. A demo run has its own: an embedded Redis (or a shared one under a prefix of
its own), HTTP servers on ports picked at start, a queue of its own. The orchestrator puts them
in the environment (``settings.py``); this module applies them to the app, in the orchestrator and
in every worker alike, and connects the demo's bookkeeping (``records.py``).
"""

from __future__ import annotations

from ..tasks import app
from . import records
from .settings import DemoSettings


def configure(settings: DemoSettings) -> None:
    """Point the app at this run's Redis, servers and queue (before any worker or client uses it)."""
    names = records.Keys(settings.prefix)
    app.conf.update(
        broker_url=settings.broker_url,
        result_backend=settings.result_url,
        semaphore_backend_url=settings.semaphore_url,
        semaphore_prefix=settings.semaphore_prefix,
        task_default_queue=settings.queue,
        # The demo never inspects workers: no pidbox, so no broadcast keys in a shared Redis.
        worker_enable_remote_control=False,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        result_expires=600,
        # the tasks' own settings (see tasks.py)
        paid_api_port=settings.api_port,
        sites_port=settings.crawl_port,
        crawl_frontier_url=settings.records_url,
        crawl_frontier_prefix=names.crawl_frontier,
    )
    if settings.broker_keyprefix is not None:
        app.conf.broker_transport_options = {"global_keyprefix": settings.broker_keyprefix}
    if settings.result_keyprefix is not None:
        app.conf.result_backend_transport_options = {"global_keyprefix": settings.result_keyprefix}


configure(DemoSettings.from_env())
records.connect_signals()

__all__ = ["app", "configure"]
