"""How a Redis URL or setting is shown with no password in it, in every log line and error message.

Separate from the parsers (:mod:`.urls`, :mod:`.broker_urls`) because it must work on any string,
a URL that does not parse included (a malformed URL is exactly the one an error message quotes),
and because everything that names a deployment needs it, the client builder too, without
needing a parser.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

__all__ = ["MASK", "mask_url"]

MASK = "***"
_PASSWORD_OPTION = re.compile(r"(?i)((?:^|[?&;])[^=&;]*password=)([^&;#]*)")


def mask_url(url: str) -> str:
    """``url`` with every password replaced by ``***``: safe for logs and error messages.

    Works on every scheme ``semaphore_backend_url`` takes, on kombu's ``;``-joined broker lists, on comma-separated host
    lists, and on strings that are not valid URLs at all (a malformed URL is exactly the one
    that ends up in an error message). Both the ``user:password@`` part and any
    ``...password=`` query option are masked, and so is any other place the password text
    appears in (a password pasted into the port, say); a user name is kept.
    """
    return _scrub(";".join(_mask_one(part) for part in url.split(";")), url)


def _mask_one(url: str) -> str:
    head, sep, rest = url.partition("://")
    if not sep:
        head, rest = "", url
    else:
        head += sep
    query_at = rest.find("?")
    authority_zone = rest if query_at < 0 else rest[:query_at]
    at = authority_zone.rfind("@")
    if at >= 0:
        userinfo = authority_zone[:at]
        user, colon, _password = userinfo.partition(":")
        if colon:
            rest = f"{user}:{MASK}{rest[at:]}"
    return head + _PASSWORD_OPTION.sub(lambda m: m.group(1) + MASK, rest)


def _scrub(text: str, url: str) -> str:
    """Remove the URL's secrets from a message that may quote parts of it."""
    for secret in _secrets(url):
        text = text.replace(secret, MASK)
    return text


def _secrets(url: str) -> list[str]:
    found: list[str] = []
    for part in url.split(";"):
        rest = part.partition("://")[2] or part
        zone = rest.split("?", 1)[0]
        at = zone.rfind("@")
        if at >= 0 and ":" in zone[:at]:
            found.append(zone[:at].partition(":")[2])
        found.extend(m.group(2) for m in _PASSWORD_OPTION.finditer(rest))
    secrets = [s for s in found if s]
    return sorted({*secrets, *(unquote(s) for s in secrets)}, key=len, reverse=True)


def _mask_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Transport options fit for an error message: every ``*password*`` value masked."""
    return {
        name: MASK if "password" in str(name).lower() else _mask_options(value) if isinstance(value, Mapping) else value
        for name, value in options.items()
    }
