"""Local stand-ins for the remote services the demo's Celery tasks talk to.

The demo tells two stories, and each needs a server that *punishes* clients
that ignore its rules, so the effect of ``celery_semaphore`` is visible in
numbers rather than asserted in prose:

* :class:`PaidApiServer` plays a metered third-party API that answers 429,
  with ``Retry-After``, the moment a caller exceeds its plan's
  concurrent-request allowance or its quota (calls in any window of so many
  seconds), and that can be sent down for maintenance (429 for a while).
* :class:`CrawlSiteServer` plays several websites at once (told apart by the
  ``Host`` header) whose ``robots.txt`` publishes a per-site
  ``Crawl-concurrency`` allowance and ``Crawl-delay``, and which record every
  breach of either.

Both use only the standard library so the demo has no extra dependencies, and
both bind to ``127.0.0.1`` exclusively: they are test fixtures, and nothing
outside this machine should ever be able to reach them.

Counting rules shared by both servers, chosen so that a well-behaved client
can never be blamed for a race it did not cause:

* A request is *active* from the moment the server starts handling it until
  just before its response is written.  The concurrency slot is released
  *before* the response goes out, because a client holding a semaphore only
  releases it after reading the response; releasing afterwards would let the
  next permitted request arrive while the slot still looked occupied.
* ``max_observed_concurrency`` is the peak number of active requests,
  rejected ones included, so a client that overshoots shows up as a peak
  above the limit even though the server only ever *serves* up to the limit.
* Time is counted as requests arrive, give or take ``ARRIVAL_SLACK``: a
  client controls when it sends a request, not how long the way takes.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import re
import socketserver
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar
from urllib.parse import urlsplit

# LOOPBACK_HOST is the only address these servers ever bind to.  Deliberately
# not a parameter: exposing a demo server that accepts anything on a real
# interface would be a needless risk.
from ..web import LOOPBACK_HOST, normalise_host

__all__ = ["ARRIVAL_SLACK", "LOOPBACK_HOST", "CrawlSiteServer", "PaidApiServer", "SiteSpec"]

JsonDict = dict[str, Any]

_ServerT = TypeVar("_ServerT", bound="_DemoServer")

# The way from a worker's grant to a server takes a few ms, and how many varies with the load of
# the box: 1 to 40 ms seen on a 2-core box running the demo alone (most for calls that start
# together), about 100 ms when other programs keep both its cores busy (the demo's checks can then
# fail). So two requests that the semaphore let start exactly a Crawl-delay apart can reach the
# site closer than that, and a call can come in before its place in a quota's window is free. The
# servers, like real ones, do not count to the ms: a request may arrive up to a tenth of a second
# early, and calls that close may arrive in either order.
ARRIVAL_SLACK = 0.1


# --------------------------------------------------------------------------
# Shared plumbing
# --------------------------------------------------------------------------


class _ConcurrencyGate:
    """Admission control plus the counters the demo reports.

    One lock guards every counter so a stats snapshot is always internally
    consistent (``ok + rejected + in_flight`` never disagrees with
    ``requests``).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._admitted = 0
        self._active = 0
        self._requests = 0
        self._ok = 0
        self._rejected = 0
        self._peak = 0

    def enter(self) -> bool:
        """Register an arriving request; ``False`` means answer 429 now."""
        with self._lock:
            self._requests += 1
            self._active += 1
            self._peak = max(self._peak, self._active)
            if self._admitted >= self.limit:
                self._rejected += 1
                return False
            self._admitted += 1
            return True

    def leave(self, *, admitted: bool) -> None:
        """Free the slot; call *before* writing the response (see module doc)."""
        with self._lock:
            self._active -= 1
            if admitted:
                self._admitted -= 1
                self._ok += 1

    def reset(self) -> None:
        """Zero the counters but keep in-flight bookkeeping intact.

        Requests still being served when a reset happens must still release
        their slot afterwards, so only the historical counters are cleared
        and the peak restarts from what is active right now.
        """
        with self._lock:
            self._requests = self._admitted
            self._ok = 0
            self._rejected = 0
            self._peak = self._active

    def snapshot(self) -> JsonDict:
        with self._lock:
            return {
                "requests": self._requests,
                "ok": self._ok,
                "rejected": self._rejected,
                "in_flight": self._admitted,
                "max_observed_concurrency": self._peak,
            }


class _LoopbackHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer that knows which demo server owns it."""

    # Bursts of simultaneous connections are the whole point of the demo;
    # the default backlog of 5 would turn them into SYN retries and make the
    # "simultaneous" requests arrive seconds apart.
    request_queue_size = 128
    daemon_threads = True

    def __init__(self, owner: _DemoServer) -> None:
        self.owner = owner
        super().__init__((LOOPBACK_HOST, 0), _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind does a reverse DNS lookup (getfqdn) that can
        # stall for seconds in sandboxes; we already know the name.
        socketserver.TCPServer.server_bind(self)
        self.server_name = LOOPBACK_HOST
        self.server_port = int(self.server_address[1])


class _Handler(BaseHTTPRequestHandler):
    """Thin adapter: all behaviour lives in the owning demo server."""

    server_version = "celery-semaphore-demo/1.0"

    def log_message(self, format: str, *args: Any) -> None:
        # Per-request access logs would drown the demo's own output.
        return

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        # Drain the body so the client never sees a reset mid-upload.
        length = int(self.headers.get("Content-Length") or 0)
        if length > 0:
            self.rfile.read(length)
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        server = self.server
        if not isinstance(server, _LoopbackHTTPServer):  # pragma: no cover
            raise TypeError("handler attached to a foreign server")
        server.owner._handle(self, method)

    def send_body(
        self,
        status: int,
        body: bytes,
        content_type: str,
        extra_headers: dict[str, str] | None = None,
    ) -> None:
        """Write a complete response, tolerating clients that hung up."""
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            for name, value in (extra_headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            # A client that timed out is its own problem, not a server error.
            pass

    def send_json(
        self,
        status: int,
        payload: Any,
        extra_headers: dict[str, str] | None = None,
    ) -> None:
        body = json.dumps(payload, sort_keys=True).encode("utf-8")
        self.send_body(status, body, "application/json", extra_headers)

    def send_text(self, status: int, text: str, content_type: str = "text/plain") -> None:
        body = text.encode("utf-8")
        self.send_body(status, body, f"{content_type}; charset=utf-8")


class _DemoServer:
    """Lifecycle shared by both servers: start, stop, context manager."""

    def __init__(self) -> None:
        self._httpd: _LoopbackHTTPServer | None = None
        self._thread: threading.Thread | None = None
        # Set on stop() so requests sleeping out their service time wake up
        # immediately instead of delaying shutdown.
        self._stopping = threading.Event()

    @property
    def port(self) -> int:
        """Port of the running server; raises if not started."""
        if self._httpd is None:
            raise RuntimeError(f"{type(self).__name__} is not running")
        return self._httpd.server_port

    def _start(self) -> int:
        if self._httpd is not None:
            raise RuntimeError(f"{type(self).__name__} is already running")
        self._stopping.clear()
        httpd = _LoopbackHTTPServer(self)
        thread = threading.Thread(
            target=httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"{type(self).__name__}:{httpd.server_port}",
            daemon=True,
        )
        thread.start()
        self._httpd, self._thread = httpd, thread
        return httpd.server_port

    def stop(self) -> None:
        """Stop serving and free the port; safe to call more than once."""
        httpd, thread = self._httpd, self._thread
        self._httpd = self._thread = None
        if httpd is None:
            return
        self._stopping.set()
        httpd.shutdown()
        httpd.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def _serve_for(self, seconds: float) -> None:
        """Simulate work, but give up early if the server is stopping."""
        if seconds > 0:
            self._stopping.wait(seconds)

    def __enter__(self: _ServerT) -> _ServerT:
        self._start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _handle(self, handler: _Handler, method: str) -> None:
        raise NotImplementedError


def _served_stats(
    handler: _Handler, method: str, path: str, stats: Callable[[], Any], reset: Callable[[], None]
) -> bool:
    """Answer the two bookkeeping endpoints every demo server has; False for any other request."""
    if method == "GET" and path == "/stats":
        handler.send_json(200, stats())
        return True
    if method == "POST" and path == "/stats/reset":
        reset()
        handler.send_json(200, stats())
        return True
    return False


def _path_only(raw_path: str) -> str:
    return urlsplit(raw_path).path or "/"


# --------------------------------------------------------------------------
# Story 1: a paid API with a concurrency allowance, a quota and maintenance
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Call:
    """One API call as the server saw it: when it arrived (``time.monotonic``), its path, and
    why it was answered 429 (None: served)."""

    at: float
    path: str
    refused_for: str | None


class _Quota:
    """A plan's "``count`` calls per ``period`` seconds" over a sliding window (any ``period``
    seconds, not calendar windows). Every call counts, answered 429 or not, as many APIs count
    requests (and as a semaphore's rate counts every start)."""

    def __init__(self, count: int, period: float) -> None:
        if count < 1 or period <= ARRIVAL_SLACK:
            raise ValueError(f"a quota needs a count of at least 1 and a period above {ARRIVAL_SLACK} s")
        self.count = count
        self.period = period
        self._calls: deque[float] = deque()

    def take(self, now: float) -> float:
        """Count a call arriving ``now``; the seconds until it would have fitted (0: it fits).
        The window is ``ARRIVAL_SLACK`` shorter than the period."""
        window = self.period - ARRIVAL_SLACK
        while self._calls and self._calls[0] <= now - window:
            self._calls.popleft()
        wait = self._calls[-self.count] + window - now if len(self._calls) >= self.count else 0.0
        self._calls.append(now)
        return wait

    def reset(self) -> None:
        self._calls.clear()


class _Maintenance:
    """A maintenance window, armed in advance: the next API call starts it and hears 429 with
    ``Retry-After: seconds``, as does any call that arrives before it ends."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started: float | None = None
        self.told = 0  # the index of the call that started it, in the server's log

    def retry_after(self, now: float, index: int) -> float | None:
        """Seconds left of the window for call ``index`` arriving ``now`` (it starts the window
        if none started yet); None when the API is up."""
        if self.started is None:
            self.started, self.told = now, index
        left = self.started + self.seconds - now
        return left if left > 0 else None


def _most_in_any_window(moments: list[float], seconds: float) -> int:
    """The most of ``moments`` (sorted) that fall within any window of ``seconds``."""
    return max((bisect.bisect_left(moments, at + seconds) - i for i, at in enumerate(moments)), default=0)


class PaidApiServer(_DemoServer):
    """A metered API that rejects, rather than queues, what its plan does not allow.

    Real paid APIs bill or ban you for 429s, so the demo needs a server that
    makes over-eager workers visible immediately: a call beyond
    ``max_concurrent`` in flight, or beyond the ``quota`` (``(count, seconds)``:
    calls, answered or not, in any window of that many seconds), is refused at
    once, with ``Retry-After``, and no queueing that could hide the overshoot.
    :meth:`begin_maintenance` arms a maintenance window: its first call, and
    any other arriving before it ends, hear 429 with ``Retry-After``.

    Any path other than ``/stats`` and ``/stats/reset`` is an API call (GET or
    POST).  ``GET /stats`` returns :meth:`stats` as JSON so worker processes
    and the orchestrator can read the counters without sharing memory;
    ``POST /stats/reset`` does :meth:`reset_stats` remotely.
    """

    def __init__(self, max_concurrent: int, service_time: float, quota: tuple[int, float] | None = None) -> None:
        if max_concurrent < 1:
            raise ValueError("max_concurrent must be at least 1")
        if service_time < 0:
            raise ValueError("service_time must not be negative")
        super().__init__()
        self.max_concurrent = max_concurrent
        self.service_time = service_time
        self._gate = _ConcurrencyGate(max_concurrent)
        self._quota = _Quota(*quota) if quota is not None else None
        # one lock over the arrival log, the quota and the maintenance window, so that two
        # calls arriving together cannot both take the quota's last place
        self._lock = threading.Lock()
        self._calls: list[_Call] = []
        self._maintenance: _Maintenance | None = None

    def start(self) -> str:
        """Start serving in a daemon thread; returns the base URL."""
        self._start()
        return self.base_url

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>`` of the running server."""
        return f"http://{LOOPBACK_HOST}:{self.port}"

    def begin_maintenance(self, seconds: float) -> None:
        """Go down for maintenance for ``seconds`` from the next API call on."""
        if seconds <= 0:
            raise ValueError("a maintenance window must last more than zero seconds")
        with self._lock:
            self._maintenance = _Maintenance(seconds)

    def stats(self) -> JsonDict:
        """Counters since start (or the last reset), JSON-serialisable.

        ``requests``, ``ok``, ``rejected`` count every API call; ``rejected_for`` splits the
        429s by reason; ``max_observed_concurrency`` is the peak the concurrency allowance saw
        (calls refused for the quota or maintenance never reach it). ``max_in_window``: the
        most calls (429s included) that arrived within any window of the quota's period, less
        ``ARRIVAL_SLACK``. ``maintenance``: the window, if one started: the path of the call
        it ``told`` to wait, ``calls_during`` it besides that one, ``quiet_for`` (seconds from
        that call to the next), ``first_after`` (the path of the first call after it) and
        ``told_lag`` (seconds from that first call to the told call's return; 0: it was first)
        and ``told_place`` (how many calls after the window came before the told call's return)."""
        snap = self._gate.snapshot()  # of the calls that got as far as the concurrency allowance
        with self._lock:
            calls = list(self._calls)
            maintenance = self._maintenance
        refused = Counter(call.refused_for for call in calls if call.refused_for in ("quota", "maintenance"))
        snap["rejected_for"] = {"concurrency": snap["rejected"], **{r: refused[r] for r in ("quota", "maintenance")}}
        snap["requests"] += sum(refused.values())
        snap["rejected"] += sum(refused.values())
        snap["max_concurrent"] = self.max_concurrent
        snap["service_time"] = self.service_time
        snap["quota"] = [self._quota.count, self._quota.period] if self._quota is not None else None
        period = self._quota.period if self._quota is not None else 0.0
        window = period - ARRIVAL_SLACK
        snap["max_in_window"] = _most_in_any_window([call.at for call in calls], window) if period else 0
        snap["maintenance"] = _maintenance_report(maintenance, calls)
        return snap

    def reset_stats(self) -> None:
        """Zero the counters, forget the quota's window and any maintenance window, so each
        demo run is measured on its own (and starts with a fresh quota)."""
        self._gate.reset()
        with self._lock:
            self._calls.clear()
            self._maintenance = None
            if self._quota is not None:
                self._quota.reset()

    def _refusal(self, path: str) -> tuple[str, float] | None:
        """Why an API call arriving now is answered 429, and its Retry-After; None: the call
        may be served."""
        now = time.monotonic()
        with self._lock:
            index = len(self._calls)
            left = self._maintenance.retry_after(now, index) if self._maintenance is not None else None
            wait = self._quota.take(now) if self._quota is not None else 0.0
            refusal: tuple[str, float] | None = None
            if left is not None:
                refusal = ("maintenance", left)
            elif wait > 0:
                refusal = ("quota", wait)
            elif not self._gate.enter():
                refusal = ("concurrency", self.service_time)
            self._calls.append(_Call(now, path, refusal[0] if refusal else None))
        return refusal

    def _handle(self, handler: _Handler, method: str) -> None:
        path = _path_only(handler.path)
        if _served_stats(handler, method, path, self.stats, self.reset_stats):
            return

        refusal = self._refusal(path)
        if refusal is not None:
            reason, retry_after = refusal
            if reason == "concurrency":
                self._gate.leave(admitted=False)
            handler.send_json(
                429,
                {"error": _REFUSALS[reason], "max_concurrent": self.max_concurrent},
                {"Retry-After": _retry_after_header(retry_after)},
            )
            return
        try:
            self._serve_for(self.service_time)
        finally:
            self._gate.leave(admitted=True)
        handler.send_json(200, {"ok": True, "method": method, "path": path})


_REFUSALS = {
    "concurrency": "too many concurrent requests",
    "quota": "quota exceeded",
    "maintenance": "down for maintenance",
}


def _retry_after_header(seconds: float) -> str:
    """Whole seconds, at least 1, as HTTP says; a whole number of seconds stays exact."""
    return str(max(1, math.ceil(round(seconds, 3))))


def _maintenance_report(maintenance: _Maintenance | None, calls: list[_Call]) -> JsonDict | None:
    """What happened around a maintenance window: see :meth:`PaidApiServer.stats`."""
    if maintenance is None or maintenance.started is None:
        return None
    told = calls[maintenance.told].path
    end = maintenance.started + maintenance.seconds
    later = calls[maintenance.told + 1 :]
    after = [call for call in later if call.at >= end]
    back = next((call.at for call in after if call.path == told), None)
    return {
        "seconds": maintenance.seconds,
        "told": told,
        "calls_during": len(later) - len(after),
        "quiet_for": later[0].at - maintenance.started if later else None,
        "first_after": after[0].path if after else None,
        "told_lag": back - after[0].at if back is not None else None,
        "told_place": next((place for place, call in enumerate(after) if call.path == told), None),
    }


# --------------------------------------------------------------------------
# Story 2: several crawlable sites, each with its own allowance
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class SiteSpec:
    """One simulated website.

    ``max_concurrent`` and ``crawl_delay`` are what the site publishes as
    ``Crawl-concurrency`` and ``Crawl-delay`` (seconds between two requests)
    in its robots.txt; a polite crawler must discover them there rather than
    be configured with them, which is why the demo needs per-site rules at all.
    """

    max_concurrent: int
    pages: int
    service_time: float
    crawl_delay: float | None = None

    def __post_init__(self) -> None:
        if self.max_concurrent < 1:
            raise ValueError("max_concurrent must be at least 1")
        if self.pages < 1:
            raise ValueError("pages must be at least 1")
        if self.service_time < 0:
            raise ValueError("service_time must not be negative")
        if self.crawl_delay is not None and not self.crawl_delay > ARRIVAL_SLACK:
            raise ValueError(f"crawl_delay must be above {ARRIVAL_SLACK} s (or None)")


_PAGE_PATH = re.compile(r"^/page/(0|[1-9][0-9]*)$")


class _Site:
    """Per-host state: the spec, its gate, the page requests' arrival times and the robots.txt
    counter."""

    def __init__(self, host: str, spec: SiteSpec, neighbour: str | None) -> None:
        self.host = host
        self.spec = spec
        self.neighbour = neighbour
        self.gate = _ConcurrencyGate(spec.max_concurrent)
        self._lock = threading.Lock()
        self._robots_requests = 0
        self._not_found = 0
        self._arrivals: list[float] = []
        self._too_early = 0

    def count_robots(self) -> None:
        with self._lock:
            self._robots_requests += 1

    def count_not_found(self) -> None:
        with self._lock:
            self._not_found += 1

    def too_early(self) -> bool:
        """Record a page request arriving now; True if it came sooner after the previous one
        than the site's Crawl-delay allows (less ``ARRIVAL_SLACK``)."""
        now = time.monotonic()
        with self._lock:
            previous = self._arrivals[-1] if self._arrivals else None
            self._arrivals.append(now)
            delay = self.spec.crawl_delay
            early = delay is not None and previous is not None and now - previous < delay - ARRIVAL_SLACK
            self._too_early += early
        return early

    def reset(self) -> None:
        self.gate.reset()
        with self._lock:
            self._robots_requests = 0
            self._not_found = 0
            self._arrivals.clear()
            self._too_early = 0

    def stats(self) -> JsonDict:
        snap = self.gate.snapshot()
        with self._lock:
            arrivals = list(self._arrivals)
            too_early = self._too_early
            snap["robots_requests"] = self._robots_requests
            snap["not_found"] = self._not_found
        # Every rejection on a crawl site *is* a breach of its robots.txt:
        # over its Crawl-concurrency (the gate's), or sooner than its Crawl-delay.
        snap["requests"] += too_early
        snap["rejected"] += too_early
        snap["too_early"] = too_early
        snap["violations"] = snap["rejected"]
        gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
        snap["min_gap"] = min(gaps, default=None)
        snap["max_concurrent"] = self.spec.max_concurrent
        snap["crawl_delay"] = self.spec.crawl_delay
        snap["pages"] = self.spec.pages
        snap["service_time"] = self.spec.service_time
        return snap

    def robots_txt(self) -> str:
        delay = f"Crawl-delay: {self.spec.crawl_delay:g}\n" if self.spec.crawl_delay is not None else ""
        return (
            f"# {self.host}: demo site for celery_semaphore\n"
            "User-agent: *\n"
            "Disallow:\n"
            f"Crawl-concurrency: {self.spec.max_concurrent}\n"
            f"{delay}"
        )

    def page_html(self, index: int) -> str:
        links = [
            (f"/page/{child}", f"page {child}") for child in (2 * index + 1, 2 * index + 2) if child < self.spec.pages
        ]
        if index != 0:
            # Re-visiting links make the crawler's dedup do real work.
            links.append(("/page/0", "home"))
        if self.neighbour is not None:
            links.append((f"http://{self.neighbour}/page/0", self.neighbour))
        anchors = "\n".join(f'<li><a href="{href}">{text}</a></li>' for href, text in links)
        title = f"{self.host} page {index}"
        return (
            "<!doctype html>\n"
            f"<html><head><title>{title}</title></head><body>\n"
            f"<h1>{title}</h1>\n<ul>\n{anchors}\n</ul>\n</body></html>\n"
        )


class CrawlSiteServer(_DemoServer):
    """Several virtual hosts behind one loopback port.

    One process and one port keep the demo cheap, while the ``Host`` header
    still gives every site its own identity, allowance and counters, so a
    crawler that limits per *domain* can be checked per domain.

    Routes per host: ``/robots.txt`` (publishes ``Crawl-concurrency`` and
    ``Crawl-delay``; not counted towards either, since fetching it is how a
    crawler learns them) and ``/page/<i>`` for ``0 <= i < pages``.  Following
    links from ``/page/0`` reaches every page of a site (page ``i`` links to
    ``2i+1`` and ``2i+2``), and each page also links to ``/page/0`` of the next
    site.  A page request that would exceed the site's allowance, or that
    comes sooner after the previous one than its Crawl-delay, is answered 429
    and recorded as a violation.  ``GET /stats`` on any host returns
    :meth:`stats`; ``POST /stats/reset`` resets.
    """

    def __init__(self, sites: dict[str, SiteSpec]) -> None:
        if not sites:
            raise ValueError("at least one site is required")
        super().__init__()
        hosts = sorted(normalise_host(h) for h in sites)
        if len(set(hosts)) != len(hosts):
            raise ValueError("site host names must be unique (case-insensitive)")
        specs = {normalise_host(h): spec for h, spec in sites.items()}
        self._sites: dict[str, _Site] = {}
        for i, host in enumerate(hosts):
            neighbour = hosts[(i + 1) % len(hosts)] if len(hosts) > 1 else None
            self._sites[host] = _Site(host, specs[host], neighbour)

    @property
    def hosts(self) -> list[str]:
        """Host names served, sorted."""
        return list(self._sites)

    def start(self) -> int:
        """Start serving in a daemon thread; returns the port."""
        return self._start()

    def stats(self) -> dict[str, JsonDict]:
        """Per-host counters since start (or the last reset)."""
        return {host: site.stats() for host, site in self._sites.items()}

    def reset_stats(self) -> None:
        """Zero every host's counters."""
        for site in self._sites.values():
            site.reset()

    def _handle(self, handler: _Handler, method: str) -> None:
        path = _path_only(handler.path)
        if _served_stats(handler, method, path, self.stats, self.reset_stats):
            return

        site = self._sites.get(normalise_host(handler.headers.get("Host") or ""))
        if site is None:
            handler.send_text(404, "unknown host\n")
            return
        if method != "GET":
            handler.send_text(405, "method not allowed\n")
            return
        if path == "/robots.txt":
            site.count_robots()
            handler.send_text(200, site.robots_txt())
            return
        match = _PAGE_PATH.match(path)
        if match is None or int(match.group(1)) >= site.spec.pages:
            site.count_not_found()
            handler.send_text(404, "no such page\n")
            return

        if site.too_early():
            handler.send_text(429, f"crawl-delay of {site.spec.crawl_delay:g} s not honoured\n")
            return
        admitted = site.gate.enter()
        if not admitted:
            site.gate.leave(admitted=False)
            handler.send_text(
                429,
                f"crawl-concurrency allowance of {site.spec.max_concurrent} exceeded\n",
            )
            return
        try:
            self._serve_for(site.spec.service_time)
        finally:
            site.gate.leave(admitted=True)
        handler.send_text(200, site.page_html(int(match.group(1))), "text/html")
