"""An example project for celery_semaphore.

``tasks.py`` is the part to read and copy: a Celery app and the two stories (a paid API capped
at N concurrent calls, a polite crawler limited per host from robots.txt), on the public API
only. ``web.py`` is their HTTP and HTML plumbing. ``demo/`` is the harness behind
``python -m example_project``, which runs the stories on real workers and checks the result.
"""
