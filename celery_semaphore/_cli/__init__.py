"""The parts of ``celery semaphore ...`` (``celery_semaphore/cli.py``) that are not commands:
what ``status`` reports about a key and how it prints, kept apart so that the command module
stays a list of commands."""
