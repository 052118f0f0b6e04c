"""The demo harness behind ``python -m example_project``: nothing here is needed to use the library.

``orchestrator.py`` starts everything (Redis, the HTTP servers, two ``celery worker`` processes),
tells the stories of ``example_project/tasks.py`` and stops everything again; ``wiring.py`` points
the tasks' app at the run's Redis and servers; ``records.py`` is what the tasks and workers record
for it; ``servers.py`` the local stand-ins of the paid API and the crawled sites; ``report.py``
the checks, the summary and the chart; ``processes.py`` signals and worker processes.

Kept free of imports: ``tasks.py`` imports ``records``, and must not pull in rich or matplotlib.
"""
