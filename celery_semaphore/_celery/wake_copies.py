"""A wake copy as bytes, kept in Redis beside a parked task's record (``parking.py``).

Any process of the deployment may have to send a parked task's wake copy: the one whose release
offered it the slot, or one sweeping records whose time is up. So the copy is stored as the
app's task serializer writes it, and read back into a signature of the reading process's app.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import signature
from kombu.serialization import dumps, loads, prepare_accept_content

logger = logging.getLogger("celery_semaphore")


def serialized(wake_copy: Any) -> bytes | None:
    """A wake copy as the app's task serializer writes it (content type and encoding in front),
    or None when it cannot be written that way."""
    try:
        content_type, encoding, data = dumps(  # type: ignore[no-untyped-call]
            dict(wake_copy), serializer=wake_copy.app.conf.task_serializer
        )
    except Exception as error:
        logger.debug("a wake copy is kept in this process only (it cannot be serialized): %s", error)
        return None
    body = data if isinstance(data, bytes) else data.encode(encoding)
    return f"{content_type}\n{encoding}\n".encode() + body


def deserialized(copy: bytes, app: Any) -> Any:
    """The wake copy ``serialized`` wrote, as a signature of ``app``."""
    content_type, encoding, body = copy.split(b"\n", 2)
    accept = prepare_accept_content(app.conf.accept_content)  # type: ignore[no-untyped-call]
    fields = loads(body, content_type.decode(), encoding.decode(), accept=accept)  # type: ignore[no-untyped-call]
    return signature(fields, app=app)
