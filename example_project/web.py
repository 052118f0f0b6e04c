"""The HTTP and HTML plumbing of the two stories, kept out of ``tasks.py``: nothing here is
about the semaphore, and a real project would use its own HTTP client and parser instead.

Every request goes to 127.0.0.1, whatever host it poses as: the sites of the crawler are
fictitious (``alpha.test``...) and served by the demo on one loopback port, told apart by the
``Host`` header, so demo traffic can never leak onto the network.
"""

from __future__ import annotations

import http.client
import math
import re
from typing import NamedTuple
from urllib.parse import urlsplit

#: The only address the demo's servers bind to and its clients connect to.
LOOPBACK_HOST = "127.0.0.1"

_CRAWL_CONCURRENCY = re.compile(r"^\s*crawl-concurrency\s*:\s*(\S+)", re.IGNORECASE)
_CRAWL_DELAY = re.compile(r"^\s*crawl-delay\s*:\s*(\S+)", re.IGNORECASE)
_HREF = re.compile(r"""<a\s[^>]*?href\s*=\s*["']([^"']+)["']""", re.IGNORECASE)


class Reply(NamedTuple):
    """An HTTP answer: the status, the body, and the ``Retry-After`` header in seconds (None
    when absent or not a number of seconds), which a 429 carries."""

    status: int
    body: str
    retry_after: float | None


def http_get(port: int, host: str, path: str, timeout: float = 10) -> tuple[int, str]:
    """GET ``path`` from the local server on ``port`` posing as ``host``: (status, body)."""
    reply = _request("GET", port, path, {"Host": host}, None, timeout)
    return reply.status, reply.body


def http_post(port: int, path: str, timeout: float = 10) -> Reply:
    """POST an empty JSON object to ``path`` on the local server on ``port``."""
    return _request("POST", port, path, {"Content-Type": "application/json"}, b"{}", timeout)


def _request(method: str, port: int, path: str, headers: dict[str, str], body: bytes | None, timeout: float) -> Reply:
    conn = http.client.HTTPConnection(LOOPBACK_HOST, port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        text = response.read().decode("utf-8", errors="replace")
        return Reply(int(response.status), text, parse_retry_after(response.getheader("Retry-After")))
    finally:
        conn.close()


def parse_retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds, above zero; else None, and the caller waits as long as it
    sees fit. The HTTP-date form is not understood: the demo's API sends seconds."""
    try:
        seconds = float(value) if value is not None else math.nan
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds > 0 else None


def parse_crawl_concurrency(robots_text: str) -> int | None:
    """The first valid ``Crawl-concurrency`` value in a robots.txt.

    None means "the site states no limit" (or states nonsense), so the caller keeps its safe
    default instead of trusting a bogus number. Values below 1 are invalid: a limit of zero
    would stall the crawl of that host.
    """
    for line in robots_text.splitlines():
        match = _CRAWL_CONCURRENCY.match(line.split("#", 1)[0])
        if match is None:
            continue
        try:
            value = int(match.group(1))
        except ValueError:
            continue
        if value >= 1:
            return value
    return None


def parse_crawl_delay(robots_text: str) -> float | None:
    """The first valid ``Crawl-delay`` of a robots.txt: seconds to wait between two requests.

    Fractions are fine (``Crawl-delay: 0.5``, as Bing and Yandex read it). None means "the site
    states no delay" (or nonsense, zero or less), so the caller keeps its safe default.
    """
    for line in robots_text.splitlines():
        match = _CRAWL_DELAY.match(line.split("#", 1)[0])
        if match is None:
            continue
        try:
            value = float(match.group(1))
        except ValueError:
            continue
        if math.isfinite(value) and value > 0:
            return value
    return None


def extract_links(html: str) -> list[str]:
    """Every ``<a href>`` of a page, in document order. A regex suffices because the demo's
    pages have known markup; this is not a general HTML parser."""
    return _HREF.findall(html)


def resolve_link(current_host: str, href: str) -> tuple[str, str]:
    """An href found on ``current_host`` as ``(host, path)``: the pair the crawler needs, since
    it sends the host as a header rather than connecting to it."""
    parts = urlsplit(href)
    host = normalise_host(parts.netloc or current_host)
    path = parts.path or "/"
    if parts.query:
        path = f"{path}?{parts.query}"
    return host, path


def normalise_host(host: str) -> str:
    """Lower-case and drop any ``:port`` suffix, as HTTP clients often add one."""
    host = host.strip().lower()
    if host.startswith("["):  # bracketed IPv6 literal, e.g. [::1]:8080
        return host.split("]", 1)[0] + "]"
    return host.rsplit(":", 1)[0] if ":" in host else host
