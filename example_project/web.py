"""The HTTP and HTML plumbing of the two stories, kept out of ``tasks.py``: nothing here is
about the semaphore, and a real project would use its own HTTP client and parser instead.

Every request goes to 127.0.0.1, whatever host it poses as: the sites of the crawler are
fictitious (``alpha.test``...) and served by the demo on one loopback port, told apart by the
``Host`` header, so demo traffic can never leak onto the network.
"""

from __future__ import annotations

import http.client
import re
from urllib.parse import urlsplit

#: The only address the demo's servers bind to and its clients connect to.
LOOPBACK_HOST = "127.0.0.1"

_CRAWL_CONCURRENCY = re.compile(r"^\s*crawl-concurrency\s*:\s*(\S+)", re.IGNORECASE)
_HREF = re.compile(r"""<a\s[^>]*?href\s*=\s*["']([^"']+)["']""", re.IGNORECASE)


def http_get(port: int, host: str, path: str, timeout: float = 10) -> tuple[int, str]:
    """GET ``path`` from the local server on ``port`` posing as ``host``: (status, body)."""
    return _request("GET", port, path, {"Host": host}, None, timeout)


def http_post(port: int, path: str, timeout: float = 10) -> tuple[int, str]:
    """POST an empty JSON object to ``path`` on the local server on ``port``: (status, body)."""
    return _request("POST", port, path, {"Content-Type": "application/json"}, b"{}", timeout)


def _request(
    method: str, port: int, path: str, headers: dict[str, str], body: bytes | None, timeout: float
) -> tuple[int, str]:
    conn = http.client.HTTPConnection(LOOPBACK_HOST, port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return int(response.status), response.read().decode("utf-8", errors="replace")
    finally:
        conn.close()


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
