"""Tests for the demo's local HTTP servers, over real loopback sockets.

Timing-sensitive checks never rely on a sleep winning a race: to prove that
requests overlap, the tests wait (with a deadline) until the server itself
reports them in flight, and only then send the request under test.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter, deque
from collections.abc import Callable, Iterator

import pytest

from example_project.demo.servers import ARRIVAL_SLACK, LOOPBACK_HOST, CrawlSiteServer, PaidApiServer, SiteSpec
from example_project.web import (
    extract_links,
    http_get,
    http_post,
    parse_crawl_concurrency,
    parse_crawl_delay,
    parse_retry_after,
    resolve_link,
)

from ..waiting import wait_until

DEADLINE = 5.0


def url_status(url: str, data: bytes | None = None) -> tuple[int, str]:
    """GET (or POST if ``data``) ``url``; returns (status, body) even for 4xx."""
    try:
        with urllib.request.urlopen(url, data=data, timeout=DEADLINE) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def run_parallel(n: int, call: Callable[[], int]) -> list[int]:
    """Run ``call`` in ``n`` threads released together by a barrier."""
    barrier = threading.Barrier(n)
    results: list[int] = []
    lock = threading.Lock()

    def worker() -> None:
        barrier.wait(timeout=DEADLINE)
        status = call()
        with lock:
            results.append(status)

    threads = [threading.Thread(target=worker) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=DEADLINE)
        assert not t.is_alive()
    assert len(results) == n
    return results


def start_background(n: int, call: Callable[[], int]) -> tuple[list[int], list[threading.Thread]]:
    """Start ``n`` threads running ``call``; statuses land in the list."""
    results: list[int] = []
    lock = threading.Lock()

    def worker() -> None:
        status = call()
        with lock:
            results.append(status)

    threads = [threading.Thread(target=worker) for _ in range(n)]
    for t in threads:
        t.start()
    return results, threads


def join_all(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(timeout=DEADLINE)
        assert not t.is_alive()


# --------------------------------------------------------------------------
# PaidApiServer
# --------------------------------------------------------------------------


@pytest.fixture
def paid_api() -> Iterator[Callable[[int, float], PaidApiServer]]:
    servers: list[PaidApiServer] = []

    def make(max_concurrent: int, service_time: float) -> PaidApiServer:
        server = PaidApiServer(max_concurrent, service_time)
        server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


def test_paid_api_binds_loopback_and_answers_json(
    paid_api: Callable[[int, float], PaidApiServer],
) -> None:
    server = paid_api(2, 0.0)
    assert server.base_url == f"http://{LOOPBACK_HOST}:{server.port}"
    status, body = url_status(server.base_url + "/v1/charge?x=1")
    assert status == 200
    assert json.loads(body)["ok"] is True
    status, body = url_status(server.base_url + "/v1/charge", data=b'{"a": 1}')
    assert status == 200
    assert json.loads(body)["method"] == "POST"
    assert server.stats()["requests"] == 2
    assert server.stats()["ok"] == 2


def test_paid_api_burst_over_limit_gets_429(
    paid_api: Callable[[int, float], PaidApiServer],
) -> None:
    server = paid_api(2, 0.5)
    n = 8
    statuses = run_parallel(n, lambda: url_status(server.base_url + "/call")[0])
    counts = Counter(statuses)
    assert set(counts) <= {200, 429}
    assert counts[200] >= 2
    assert counts[429] >= 1
    stats = server.stats()
    assert stats["requests"] == n
    assert stats["ok"] == counts[200]
    assert stats["rejected"] == counts[429]
    assert stats["in_flight"] == 0
    # A rejection happens only while the limit is fully used, so the peak
    # (which counts the rejected arrival) must exceed the limit.
    assert stats["max_observed_concurrency"] >= 3


def test_paid_api_rejects_exactly_the_requests_beyond_the_limit(
    paid_api: Callable[[int, float], PaidApiServer],
) -> None:
    server = paid_api(3, 0.6)
    results, threads = start_background(3, lambda: url_status(server.base_url)[0])
    wait_until(lambda: server.stats()["in_flight"] == 3, timeout=DEADLINE)

    status, body = url_status(server.base_url + "/extra")
    assert status == 429
    assert json.loads(body)["max_concurrent"] == 3
    assert url_status(server.base_url + "/extra")[0] == 429

    join_all(threads)
    assert results == [200, 200, 200]
    stats = server.stats()
    assert (stats["requests"], stats["ok"], stats["rejected"]) == (5, 3, 2)
    assert stats["max_observed_concurrency"] == 4


def test_paid_api_no_429_when_limit_respected(
    paid_api: Callable[[int, float], PaidApiServer],
) -> None:
    server = paid_api(3, 0.05)
    # Exactly max_concurrent clients, each calling back-to-back: the server
    # frees a slot before responding, so a follow-up can never be rejected.
    statuses = run_parallel(3, lambda: max(url_status(server.base_url)[0] for _ in range(4)))
    assert statuses == [200, 200, 200]
    assert server.stats()["rejected"] == 0

    # More clients than slots, but gated by a client-side semaphore: the
    # behaviour celery_semaphore provides across processes.
    server.reset_stats()
    gate = threading.BoundedSemaphore(3)

    def polite() -> int:
        with gate:
            return url_status(server.base_url)[0]

    statuses = run_parallel(12, polite)
    assert Counter(statuses) == {200: 12}
    stats = server.stats()
    assert stats["rejected"] == 0
    assert stats["ok"] == 12
    assert 1 <= stats["max_observed_concurrency"] <= 3


def test_paid_api_max_observed_concurrency_is_exact(
    paid_api: Callable[[int, float], PaidApiServer],
) -> None:
    server = paid_api(10, 0.3)
    results, threads = start_background(4, lambda: url_status(server.base_url)[0])
    wait_until(lambda: server.stats()["in_flight"] == 4, timeout=DEADLINE)
    join_all(threads)
    assert results == [200] * 4
    stats = server.stats()
    assert stats["max_observed_concurrency"] == 4
    assert stats["in_flight"] == 0


def test_paid_api_stats_endpoint_and_reset(
    paid_api: Callable[[int, float], PaidApiServer],
) -> None:
    server = paid_api(1, 0.0)
    for _ in range(3):
        url_status(server.base_url + "/x")
    status, body = url_status(server.base_url + "/stats")
    assert status == 200
    remote = json.loads(body)
    assert remote == server.stats()  # reading /stats is not itself counted
    assert remote["requests"] == 3
    assert remote["ok"] == 3
    assert remote["max_concurrent"] == 1
    json.dumps(server.stats())  # JSON-friendly

    server.reset_stats()
    assert server.stats()["requests"] == 0
    url_status(server.base_url + "/x")
    status, body = url_status(server.base_url + "/stats/reset", data=b"")
    assert status == 200
    assert json.loads(body)["requests"] == 0
    assert server.stats()["max_observed_concurrency"] == 0


def test_paid_api_quota_counts_every_call_in_a_sliding_window() -> None:
    """A quota of 2 calls per 0.5 s: the third call within the window hears 429 with a
    Retry-After, counts against the quota all the same, and calls fit again once the window
    has moved past the calls in it."""
    server = PaidApiServer(10, 0.0, quota=(2, 0.5))
    with server:
        port = server.port
        assert [http_post(port, f"/v1/reports/{i}").status for i in range(2)] == [200, 200]
        refused = http_post(port, "/v1/reports/2")
        assert (refused.status, refused.retry_after) == (429, 1.0)
        assert json.loads(refused.body)["error"] == "quota exceeded"
        stats = server.stats()
        assert (stats["requests"], stats["ok"], stats["rejected"]) == (3, 2, 1)
        assert stats["rejected_for"] == {"concurrency": 0, "quota": 1, "maintenance": 0}
        assert stats["quota"] == [2, 0.5]
        assert stats["max_in_window"] == 3
        time.sleep(0.5)
        assert http_post(port, "/v1/reports/3").status == 200
        server.reset_stats()
        assert server.stats()["max_in_window"] == 0
        assert [http_post(port, f"/v1/reports/{i}").status for i in range(2)] == [200, 200]


def test_paid_api_maintenance_window(paid_api: Callable[[int, float], PaidApiServer]) -> None:
    """Armed, a maintenance window starts at the next call: that call and any other before it
    ends hear 429 with the seconds left; the report says who was told, how many came during
    it, who came first after it and how long after that the told call came back."""
    server = paid_api(4, 0.0)
    server.begin_maintenance(0.4)
    assert server.stats()["maintenance"] is None
    told = http_post(server.port, "/v1/reports/0")
    assert (told.status, told.retry_after) == (429, 1.0)
    assert json.loads(told.body)["error"] == "down for maintenance"
    assert http_post(server.port, "/v1/reports/1").status == 429
    time.sleep(0.4)
    assert http_post(server.port, "/v1/reports/2").status == 200
    assert http_post(server.port, "/v1/reports/0").status == 200
    stats = server.stats()
    assert stats["rejected_for"] == {"concurrency": 0, "quota": 0, "maintenance": 2}
    report = stats["maintenance"]
    assert (report["seconds"], report["told"], report["calls_during"]) == (0.4, "/v1/reports/0", 1)
    assert report["first_after"] == "/v1/reports/2"
    assert 0 < report["told_lag"] < DEADLINE
    assert report["told_place"] == 1  # one call after the window came back before it
    assert 0 < report["quiet_for"] < 0.4
    with pytest.raises(ValueError, match="more than zero"):
        server.begin_maintenance(0)


def test_paid_api_lifecycle() -> None:
    with pytest.raises(ValueError, match="max_concurrent"):
        PaidApiServer(0, 0.1)
    with pytest.raises(ValueError, match="service_time"):
        PaidApiServer(1, -1)

    server = PaidApiServer(1, 5.0)
    with pytest.raises(RuntimeError):
        _ = server.port
    with server:
        with pytest.raises(RuntimeError, match="already running"):
            server.start()
        port = server.port
        # stop() must not wait out a long service time.
        _, threads = start_background(1, lambda: url_status(server.base_url)[0])
        wait_until(lambda: server.stats()["in_flight"] == 1, timeout=DEADLINE)
        began = time.monotonic()
    assert time.monotonic() - began < 2.0
    join_all(threads)
    server.stop()  # idempotent
    with pytest.raises(ConnectionRefusedError):
        http_get(port, "x", "/", timeout=1)


# --------------------------------------------------------------------------
# robots.txt parsing and link helpers
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("User-agent: *\nCrawl-concurrency: 3\n", 3),
        ("user-agent: *\r\ncrawl-CONCURRENCY :  7  \r\n", 7),
        ("Crawl-delay: 2\nCrawl-concurrency: 4 # per host\n", 4),
        ("# Crawl-concurrency: 9\nUser-agent: *\n", None),
        ("Crawl-concurrency: lots\nCrawl-concurrency: 2\n", 2),
        ("Crawl-concurrency: 0\n", None),
        ("Crawl-concurrency: -1\n", None),
        ("X-Crawl-concurrency: 5\n", None),
        ("", None),
    ],
)
def test_parse_crawl_concurrency(text: str, expected: int | None) -> None:
    assert parse_crawl_concurrency(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("User-agent: *\nCrawl-delay: 2\n", 2.0),
        ("crawl-DELAY :  0.5  # seconds\r\n", 0.5),
        ("# Crawl-delay: 9\nCrawl-concurrency: 3\n", None),
        ("Crawl-delay: soon\nCrawl-delay: 1.5\n", 1.5),
        ("Crawl-delay: 0\n", None),
        ("Crawl-delay: -1\n", None),
        ("Crawl-delay: nan\nCrawl-delay: inf\n", None),
        ("", None),
    ],
)
def test_parse_crawl_delay(text: str, expected: float | None) -> None:
    assert parse_crawl_delay(text) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [("2", 2.0), ("0.5", 0.5), (None, None), ("0", None), ("-3", None), ("Wed, 21 Oct 2015 07:28:00 GMT", None)],
)
def test_parse_retry_after(value: str | None, expected: float | None) -> None:
    assert parse_retry_after(value) == expected


def test_link_helpers() -> None:
    html = '<a href="/page/1">1</a> <A class="x" HREF=\'http://beta.test/page/0\'>b</A>'
    assert extract_links(html) == ["/page/1", "http://beta.test/page/0"]
    assert resolve_link("alpha.test", "/page/3") == ("alpha.test", "/page/3")
    assert resolve_link("alpha.test", "http://Beta.Test:80/page/0") == (
        "beta.test",
        "/page/0",
    )


# --------------------------------------------------------------------------
# CrawlSiteServer
# --------------------------------------------------------------------------


@pytest.fixture
def crawl_sites() -> Iterator[Callable[[dict[str, SiteSpec]], CrawlSiteServer]]:
    servers: list[CrawlSiteServer] = []

    def make(sites: dict[str, SiteSpec]) -> CrawlSiteServer:
        server = CrawlSiteServer(sites)
        server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


def test_robots_txt_per_host_is_not_counted(
    crawl_sites: Callable[[dict[str, SiteSpec]], CrawlSiteServer],
) -> None:
    server = crawl_sites(
        {
            "alpha.test": SiteSpec(max_concurrent=2, pages=5, service_time=0),
            "beta.test": SiteSpec(max_concurrent=5, pages=3, service_time=0),
        }
    )
    port = server.port
    for host, expected in [("alpha.test", 2), ("beta.test", 5)]:
        status, text = http_get(port, host, "/robots.txt")
        assert status == 200
        assert "User-agent: *" in text
        assert parse_crawl_concurrency(text) == expected
    # A Host header carrying the port (as most clients send it) still matches.
    status, text = http_get(port, f"Alpha.Test:{port}", "/robots.txt")
    assert parse_crawl_concurrency(text) == 2

    stats = server.stats()
    assert stats["alpha.test"]["robots_requests"] == 2
    assert stats["alpha.test"]["requests"] == 0
    assert stats["alpha.test"]["max_observed_concurrency"] == 0
    assert stats["beta.test"]["robots_requests"] == 1


def test_link_graph_reaches_every_page(
    crawl_sites: Callable[[dict[str, SiteSpec]], CrawlSiteServer],
) -> None:
    sites = {
        "alpha.test": SiteSpec(max_concurrent=1, pages=23, service_time=0),
        "beta.test": SiteSpec(max_concurrent=2, pages=1, service_time=0),
        "gamma.test": SiteSpec(max_concurrent=3, pages=8, service_time=0),
    }
    server = crawl_sites(sites)
    assert server.hosts == sorted(sites)
    port = server.port

    seen: set[tuple[str, str]] = set()
    queue = deque([("alpha.test", "/page/0")])
    while queue:
        host, path = queue.popleft()
        if (host, path) in seen:
            continue
        seen.add((host, path))
        status, html = http_get(port, host, path)
        assert status == 200, (host, path)
        for href in extract_links(html):
            queue.append(resolve_link(host, href))

    # Cross-site links chain every host, and within a host every page is
    # reachable from /page/0.
    expected = {(h, f"/page/{i}") for h, spec in sites.items() for i in range(spec.pages)}
    assert seen == expected

    stats = server.stats()
    for host, spec in sites.items():
        assert stats[host]["requests"] == spec.pages
        assert stats[host]["ok"] == spec.pages
        assert stats[host]["violations"] == 0
        assert stats[host]["max_observed_concurrency"] == 1


def test_page_links_shape(
    crawl_sites: Callable[[dict[str, SiteSpec]], CrawlSiteServer],
) -> None:
    server = crawl_sites(
        {
            "alpha.test": SiteSpec(max_concurrent=1, pages=10, service_time=0),
            "beta.test": SiteSpec(max_concurrent=1, pages=10, service_time=0),
        }
    )
    status, html = http_get(server.port, "alpha.test", "/page/3")
    assert status == 200
    links = extract_links(html)
    assert "/page/7" in links
    assert "/page/8" in links
    assert "http://beta.test/page/0" in links
    assert all(resolve_link("alpha.test", h)[0] in server.hosts for h in links)


def test_unknown_host_and_missing_pages(
    crawl_sites: Callable[[dict[str, SiteSpec]], CrawlSiteServer],
) -> None:
    server = crawl_sites({"alpha.test": SiteSpec(1, 3, 0)})
    port = server.port
    assert http_get(port, "nowhere.test", "/page/0")[0] == 404
    assert http_get(port, "alpha.test", "/page/3")[0] == 404
    assert http_get(port, "alpha.test", "/page/01")[0] == 404
    assert http_get(port, "alpha.test", "/")[0] == 404
    stats = server.stats()["alpha.test"]
    assert stats["not_found"] == 3
    assert stats["requests"] == 0


def test_allowance_violations_counted_per_host(
    crawl_sites: Callable[[dict[str, SiteSpec]], CrawlSiteServer],
) -> None:
    server = crawl_sites(
        {
            "alpha.test": SiteSpec(max_concurrent=2, pages=10, service_time=0.6),
            "beta.test": SiteSpec(max_concurrent=1, pages=10, service_time=0.6),
        }
    )
    port = server.port
    results, threads = start_background(2, lambda: http_get(port, "alpha.test", "/page/1")[0])
    wait_until(lambda: server.stats()["alpha.test"]["in_flight"] == 2, timeout=DEADLINE)

    # alpha is saturated: every extra page request is a violation...
    assert http_get(port, "alpha.test", "/page/2")[0] == 429
    assert http_get(port, "alpha.test", "/page/3")[0] == 429
    # ...but robots.txt is still served, and beta's allowance is independent.
    assert http_get(port, "alpha.test", "/robots.txt")[0] == 200
    beta_results, beta_threads = start_background(1, lambda: http_get(port, "beta.test", "/page/0")[0])
    wait_until(lambda: server.stats()["beta.test"]["in_flight"] == 1, timeout=DEADLINE)

    join_all(threads + beta_threads)
    assert results == [200, 200]
    assert beta_results == [200]

    stats = server.stats()
    alpha = stats["alpha.test"]
    assert alpha["requests"] == 4
    assert alpha["ok"] == 2
    assert alpha["violations"] == 2
    assert alpha["max_observed_concurrency"] == 3
    beta = stats["beta.test"]
    assert (beta["requests"], beta["violations"]) == (1, 0)
    assert beta["max_observed_concurrency"] == 1


def test_crawl_burst_with_barrier_records_violations(
    crawl_sites: Callable[[dict[str, SiteSpec]], CrawlSiteServer],
) -> None:
    server = crawl_sites({"alpha.test": SiteSpec(2, 20, 0.5)})
    port = server.port
    statuses = run_parallel(6, lambda: http_get(port, "alpha.test", "/page/0")[0])
    counts = Counter(statuses)
    stats = server.stats()["alpha.test"]
    assert counts[429] >= 1
    assert stats["violations"] == counts[429]
    assert stats["requests"] == 6
    assert stats["max_observed_concurrency"] > 2


def test_crawl_stats_endpoint_any_host(
    crawl_sites: Callable[[dict[str, SiteSpec]], CrawlSiteServer],
) -> None:
    server = crawl_sites({"alpha.test": SiteSpec(1, 2, 0), "beta.test": SiteSpec(4, 2, 0)})
    port = server.port
    http_get(port, "alpha.test", "/page/0")
    http_get(port, "beta.test", "/page/1")
    http_get(port, "beta.test", "/robots.txt")
    for host in ("alpha.test", "unknown.test", f"127.0.0.1:{port}"):
        status, body = http_get(port, host, "/stats")
        assert status == 200
        remote = json.loads(body)
        assert remote == server.stats()
    assert set(remote) == {"alpha.test", "beta.test"}
    assert remote["alpha.test"]["requests"] == 1
    assert remote["beta.test"]["robots_requests"] == 1
    assert remote["beta.test"]["max_concurrent"] == 4
    assert remote["beta.test"]["pages"] == 2

    server.reset_stats()
    assert all(s["requests"] == 0 for s in server.stats().values())
    status, body = url_status(f"http://{LOOPBACK_HOST}:{port}/stats/reset", data=b"")
    assert status == 200
    assert json.loads(body)["beta.test"]["robots_requests"] == 0


def test_crawl_delay_published_and_every_early_request_refused(
    crawl_sites: Callable[[dict[str, SiteSpec]], CrawlSiteServer],
) -> None:
    """A site publishes its Crawl-delay in robots.txt; a page request sooner than that after
    the previous one (``ARRIVAL_SLACK`` aside) is a violation, answered 429, and the shortest
    gap between page requests is reported."""
    server = crawl_sites(
        {
            "alpha.test": SiteSpec(max_concurrent=2, pages=4, service_time=0, crawl_delay=0.3),
            "beta.test": SiteSpec(max_concurrent=2, pages=4, service_time=0),
        }
    )
    port = server.port
    assert parse_crawl_delay(http_get(port, "alpha.test", "/robots.txt")[1]) == 0.3
    assert parse_crawl_delay(http_get(port, "beta.test", "/robots.txt")[1]) is None
    assert http_get(port, "alpha.test", "/page/0")[0] == 200
    status, text = http_get(port, "alpha.test", "/page/1")
    assert (status, text) == (429, "crawl-delay of 0.3 s not honoured\n")
    time.sleep(0.3 - ARRIVAL_SLACK)
    assert http_get(port, "alpha.test", "/page/1")[0] == 200
    # no Crawl-delay: back-to-back requests are fine
    assert [http_get(port, "beta.test", f"/page/{i}")[0] for i in range(3)] == [200, 200, 200]

    stats = server.stats()
    alpha = stats["alpha.test"]
    assert (alpha["requests"], alpha["ok"], alpha["too_early"], alpha["violations"]) == (3, 2, 1, 1)
    assert alpha["crawl_delay"] == 0.3
    assert alpha["min_gap"] is not None and alpha["min_gap"] < 0.3 - ARRIVAL_SLACK
    beta = stats["beta.test"]
    assert (beta["too_early"], beta["violations"], beta["crawl_delay"]) == (0, 0, None)
    server.reset_stats()
    assert server.stats()["alpha.test"]["min_gap"] is None


def test_crawl_site_validation() -> None:
    with pytest.raises(ValueError, match="max_concurrent"):
        SiteSpec(0, 1, 0)
    with pytest.raises(ValueError, match="pages"):
        SiteSpec(1, 0, 0)
    with pytest.raises(ValueError, match="service_time"):
        SiteSpec(1, 1, -0.5)
    with pytest.raises(ValueError, match="crawl_delay"):
        SiteSpec(1, 1, 0, crawl_delay=ARRIVAL_SLACK)
    with pytest.raises(ValueError, match="at least one site"):
        CrawlSiteServer({})
    with pytest.raises(ValueError, match="unique"):
        CrawlSiteServer({"a.test": SiteSpec(1, 1, 0), "A.TEST": SiteSpec(1, 1, 0)})


def test_the_pause_check_takes_the_told_call_in_the_first_wave() -> None:
    """The end of a pause frees every slot at once: the told call, offered the first, may reach
    the API after the waiters already present took the others. Among the first ``limit`` calls
    after the window it passes; behind them it fails."""
    from example_project.demo.report import Pause, _pause_check

    def pause(place: int, lag: float) -> Pause:
        return Pause(2.0, "/v1/reports/0", 0, 2.0, "/v1/reports/2", lag, place)

    assert _pause_check("k", pause(0, 0.0), 4).ok
    assert _pause_check("k", pause(3, 0.4), 4).ok
    assert not _pause_check("k", pause(4, 0.4), 4).ok
    assert "first, not report 0" in _pause_check("k", pause(4, 0.4), 4).text
