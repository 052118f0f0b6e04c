"""Settings, task options and declaration-time checks of the Celery layer (no worker needed)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_semaphore import ConfigurationError, SemaphoreTask, limit_concurrency
from celery_semaphore._celery.catalogue import semaphore_for_call
from celery_semaphore._celery.config import config_for, forget_config, parse_config
from celery_semaphore._core.rules import Rate

from ..redis_server import RedisServer
from ..workers import Worker


def make_app(**conf: Any) -> Celery:
    app = Celery("cfg", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.update(conf)
    return app


def test_defaults_with_a_redis_broker() -> None:
    """With nothing set, the backend is the Redis broker and every default applies."""
    config = config_for(make_app())
    assert config.backend.url == "redis://127.0.0.1:1/0"
    assert (config.prefix, config.lease, config.countdown, config.max_wait, config.fail_open) == (
        "semaphore",
        60.0,
        (1.0, 30.0),
        None,
        False,
    )
    assert config.visibility_timeout == 3600


def test_settings_are_parsed_once_and_cached_per_app() -> None:
    """config_for returns the same frozen object until forget_config."""
    app = make_app(semaphore_lease=10)
    first = config_for(app)
    app.conf.semaphore_lease = 20
    assert config_for(app) is first
    forget_config(app)
    assert config_for(app).lease == 20


def test_django_style_namespaced_settings_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CELERY_SEMAPHORE_* settings read through config_from_object(namespace="CELERY")."""
    (tmp_path / "djsettings_for_test.py").write_text(
        "CELERY_BROKER_URL = 'redis://127.0.0.1:1/0'\n"
        "CELERY_SEMAPHORE_LIMITS = {'crawl:*': 4}\n"
        "CELERY_SEMAPHORE_LEASE = 45\n"
        "CELERY_SEMAPHORE_BACKEND_URL = 'redis://127.0.0.1:2/3'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    app = Celery("dj", set_as_current=False)
    app.config_from_object("djsettings_for_test", namespace="CELERY")
    config = config_for(app)
    assert config.lease == 45
    assert config.backend.url == "redis://127.0.0.1:2/3"
    assert config.limit_for("crawl:example.org", "t", None).limit == 4  # type: ignore[union-attr]
    sys.modules.pop("djsettings_for_test", None)


def test_a_key_may_have_a_rate_and_a_spacing_beside_its_limit() -> None:
    """A mapping entry gives the parts it names; the task's own options fill in the rest."""
    config = config_for(
        make_app(semaphore_limits={"api": {"limit": 5, "rate": "500/m"}, "crawl:*": {"spacing": 2}, "solo": 3})
    )
    api = config.limit_for("api", "proj.api", _Options(1, spacing=0.5))
    assert api is not None and (api.limit, api.rate, api.spacing) == (5, Rate(500, 60.0), 0.5)
    crawl = config.limit_for("crawl:h", "proj.crawl", _Options(2))
    assert crawl is not None and (crawl.limit, crawl.rate, crawl.spacing) == (2, None, 2.0)
    rate_only = config.limit_for("x", "proj.x", _Options(rate=(10, 30)))
    assert rate_only is not None and (rate_only.limit, rate_only.rate) == (None, Rate(10, 30.0))
    solo = config.limit_for("solo", "proj.solo", None)
    assert solo is not None and (solo.limit, solo.rate, solo.spacing) == (3, None, None)


@pytest.mark.parametrize(
    "entry",
    [{"limit": 0}, {"rate": "30/x"}, {"spacing": -1}, {"burst": 3}, {}, {"rate": (0, 60)}],
)
def test_a_bad_key_rule_names_the_setting_and_the_part(entry: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError) as caught:
        parse_config(make_app(semaphore_limits={"api": entry}))
    assert caught.value.setting.startswith("semaphore_limits['api']")


def test_a_key_may_cap_its_line_in_the_settings_and_the_cap_reaches_its_semaphore() -> None:
    """max_waiters with on_full in an entry: the key's semaphore refuses (or drops) past it,
    whatever the task's own options say; a key without it keeps the task's."""
    app = make_app(
        semaphore_limits={"api": {"limit": 5, "max_waiters": 100, "on_full": "drop_oldest"}, "other": 2},
        semaphore_backend_url="redis://127.0.0.1:1/1",
    )

    @app.task(base=SemaphoreTask, semaphore_key="{name}", shared=False, lazy=False)
    def call(name: str) -> None: ...

    rule = config_for(app).limit_for("api", call.name, call)
    assert rule is not None and rule.full_line == (100, "drop_oldest")
    capped = semaphore_for_call(call, ("api",), {})
    assert (capped.max_waiters, capped.on_full) == (100, "drop_oldest")  # type: ignore[union-attr]
    uncapped = semaphore_for_call(call, ("other",), {})
    assert uncapped.max_waiters is None  # type: ignore[union-attr]


def test_a_cap_per_tenant_in_the_settings_reaches_the_keys_semaphore() -> None:
    """per_tenant in an entry: most slots one tenant's calls may hold of that key, passed to
    the scripts in the rules of every call; a key without it has no cap."""
    app = make_app(
        semaphore_limits={"api": {"limit": 5, "per_tenant": 2}, "other": 2},
        semaphore_backend_url="redis://127.0.0.1:1/1",
    )

    @app.task(base=SemaphoreTask, semaphore_key="{name}", semaphore_fair_by="{customer}", shared=False, lazy=False)
    def call(name: str, customer: str) -> None: ...

    rule = config_for(app).limit_for("api", call.name, call)
    assert rule is not None and rule.per_tenant == 2
    capped = semaphore_for_call(call, ("api", "acme"), {})
    assert capped.per_tenant == 2 and capped.rules.arg == b"5/0/0/0/2"  # type: ignore[union-attr]
    uncapped = semaphore_for_call(call, ("other", "acme"), {})
    assert uncapped.per_tenant is None and uncapped.rules.arg == b"2"  # type: ignore[union-attr]


def test_a_calls_semaphore_is_built_once_per_key_and_settings() -> None:
    """Every call of a key gets the same semaphore object (built once: a FairSemaphore holds its
    settings only); another key, or the settings parsed again, build their own; the cache keeps
    the keys used last (keys made per call come and go)."""
    from celery_semaphore._celery import catalogue

    app = make_app(semaphore_limits={"api:*": 3}, semaphore_backend_url="redis://127.0.0.1:1/1")

    @app.task(base=SemaphoreTask, semaphore_key="api:{name}", shared=False, lazy=False)
    def call(name: str) -> None: ...

    first = semaphore_for_call(call, ("a",), {})
    assert semaphore_for_call(call, ("a",), {}) is first
    other = semaphore_for_call(call, ("b",), {})
    assert other is not first and other.name == "api:b" and first.name == "api:a"  # type: ignore[union-attr]
    forget_config(app)  # settings changed: parsed again, built again
    again = semaphore_for_call(call, ("a",), {})
    assert again is not first and again.name == first.name and again.limit == 3  # type: ignore[union-attr]
    kept = catalogue.BUILT_PER_CONFIG
    catalogue.BUILT_PER_CONFIG = 2
    try:
        semaphore_for_call(call, ("c",), {})
        semaphore_for_call(call, ("d",), {})
        assert semaphore_for_call(call, ("a",), {}) is not again  # the least lately used went
    finally:
        catalogue.BUILT_PER_CONFIG = kept


def test_a_key_template_fills_from_a_callable_that_cannot_be_hashed() -> None:
    """Signatures are cached by callable; one that cannot be hashed (an ``__eq__`` without a
    ``__hash__``) is read anew, and its call's key fills as any other's."""
    from celery_semaphore._celery.keys import render

    class Unhashable:
        def __eq__(self, other: object) -> bool:
            return self is other

        def __call__(self, host: str, path: str = "/") -> None: ...

    function = Unhashable()
    with pytest.raises(TypeError):
        hash(function)
    assert render("t.semaphore_key", "crawl:{host}{path}", function, ("h",), {}) == "crawl:h/"
    assert render("t.semaphore_key", "crawl:{host}{path}", function, (), {"host": "g", "path": "/x"}) == "crawl:g/x"
    with pytest.raises(ConfigurationError, match="does not fit the task's signature"):
        render("t.semaphore_key", "crawl:{host}", function, ("h", "/", "extra"), {})


@pytest.mark.parametrize(
    ("entry", "part", "says"),
    [
        ({"limit": 5, "per_tenant": 0}, "['per_tenant']", ""),
        ({"limit": 5, "per_tenant": "2"}, "['per_tenant']", ""),
        ({"limit": 5, "max_waiters": 10}, "['on_full']", 'expected "reject" or "drop_oldest"'),
        ({"limit": 5, "on_full": "reject"}, "['on_full']", "needs max_waiters"),
        ({"limit": 5, "max_waiters": 10, "on_full": "keep_latest"}, "['on_full']", "semaphore_coalesce_by"),
        ({"limit": 5, "max_waiters": 10, "on_full": "wait"}, "['on_full']", "expected"),
        ({"limit": 5, "max_waiters": 0, "on_full": "reject"}, "['max_waiters']", ""),
        ({"max_waiters": 10, "on_full": "reject"}, "", "at least one of limit, rate and spacing"),
    ],
)
def test_a_bad_line_cap_in_the_settings_names_the_part(entry: dict[str, Any], part: str, says: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        parse_config(make_app(semaphore_limits={"api": entry}))
    assert caught.value.setting == f"semaphore_limits['api']{part}"
    assert says in str(caught.value)


def test_a_line_cap_on_a_key_of_a_key_list_task_stops_the_worker_at_start() -> None:
    """A cap acts on one key's line; a task waiting in several lines cannot honour it."""
    from celery_semaphore._celery.worker import check_limits

    app = make_app(
        semaphore_limits={"a": {"limit": 2, "max_waiters": 5, "on_full": "reject"}, "b": 2},
        semaphore_backend_url="redis://127.0.0.1:1/1",
    )

    @app.task(base=SemaphoreTask, semaphore_key=["a", "b"], shared=False, lazy=False)
    def both() -> None: ...

    with pytest.raises(ConfigurationError, match="max_waiters applies to a task of one key") as caught:
        check_limits(both, config_for(app))
    assert caught.value.setting == "semaphore_limits['a']"
    with pytest.raises(ConfigurationError, match="max_waiters applies to a task of one key"):
        semaphore_for_call(both, (), {})


@pytest.mark.parametrize(("key", "shown"), [(5, "semaphore_limits[5]"), ("", "semaphore_limits['']")])
def test_a_bad_key_of_semaphore_limits_names_that_entry_and_its_value(key: Any, shown: str) -> None:
    """A key that is no task name or semaphore key is reported as that one entry, with the
    entry's value, not as if the key were the whole setting."""
    with pytest.raises(ConfigurationError) as caught:
        parse_config(make_app(semaphore_limits={"api": 3, key: {"limit": 7}}))
    assert (caught.value.setting, caught.value.value) == (shown, {"limit": 7})
    assert str(caught.value).startswith(f"{shown}={{'limit': 7}}: "), str(caught.value)


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("semaphore_backend_url", "http://127.0.0.1:6379"),
        ("semaphore_limits", {"a": 0}),
        ("semaphore_limits", {"a": "3"}),
        ("semaphore_limits", ["a"]),
        ("semaphore_prefix", ""),
        ("semaphore_prefix", "a{b}"),
        ("semaphore_lease", 0),
        ("semaphore_lease", "60"),
        ("semaphore_countdown", 0.5),
        ("semaphore_countdown", (5, 2)),
        ("semaphore_countdown", (1, 2, 3)),
        ("semaphore_max_wait", -1),
        ("semaphore_fail_open", "yes"),
        ("semaphore_inline_wait", -1),
        ("semaphore_broker_consumer_timeout", 0),
        ("semaphore_broker_consumer_timeout", "30m"),
    ],
)
def test_each_bad_setting_is_a_configuration_error_naming_it(setting: str, value: Any) -> None:
    """Bad values are refused when the settings are parsed, naming the setting."""
    with pytest.raises(ConfigurationError) as caught:
        parse_config(make_app(**{setting: value}))
    assert caught.value.setting.startswith(setting)


def test_no_backend_url_and_a_non_redis_broker_is_an_error() -> None:
    """Without semaphore_backend_url, an AMQP broker gives nothing to default to."""
    app = Celery("amqp", broker="amqp://guest@127.0.0.1//", set_as_current=False)
    with pytest.raises(ConfigurationError, match="semaphore_backend_url"):
        parse_config(app)


class _Options:
    """A task's own semaphore options, as ``limit_for`` reads them."""

    def __init__(self, limit: int | None = None, rate: Any = None, spacing: Any = None, name: str = "t") -> None:
        self.semaphore_limit, self.semaphore_rate, self.semaphore_spacing, self.name = limit, rate, spacing, name


def test_limit_precedence_exact_key_task_name_globs_then_code() -> None:
    """semaphore_limits: the exact key wins, then the task name, then globs, then the option."""
    config = config_for(make_app(semaphore_limits={"crawl:a": 1, "proj.crawl": 2, "crawl:*": 3, "proj.*": 4}))
    nine = _Options(9)
    assert config.limit_for("crawl:a", "proj.crawl", nine).source == "semaphore_limits['crawl:a']"  # type: ignore[union-attr]
    assert config.limit_for("crawl:b", "proj.crawl", nine).limit == 2  # type: ignore[union-attr]
    assert config.limit_for("crawl:b", "proj.other", nine).limit == 3  # type: ignore[union-attr]
    assert config.limit_for("x", "proj.other", nine).limit == 4  # type: ignore[union-attr]
    assert config.limit_for("x", "other", nine).limit == 9  # type: ignore[union-attr]
    assert config.limit_for("x", "other", None) is None


def test_a_key_template_naming_a_missing_argument_fails_at_declaration() -> None:
    """limit_concurrency checks the template against the function when decorating."""
    app = make_app()
    with pytest.raises(ConfigurationError) as caught:

        @limit_concurrency(3, key="crawl:{hostname}", app=app, shared=False)
        def crawl(host: str, path: str) -> None: ...

    assert "hostname" in str(caught.value)
    assert caught.value.setting.endswith("semaphore_key")


def test_app_task_with_a_bad_template_fails_when_the_task_is_created() -> None:
    """base=SemaphoreTask checks the template when Celery builds the task class."""
    app = make_app()
    with pytest.raises(ConfigurationError, match="missing"):

        @app.task(base=SemaphoreTask, semaphore_limit=1, semaphore_key="k:{missing}", lazy=False, shared=False)
        def work(present: int) -> None: ...


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("semaphore_limit", 0),
        ("semaphore_limit", True),
        ("semaphore_lease", -5),
        ("semaphore_countdown", (0, 1)),
        ("semaphore_max_wait", 0),
        ("semaphore_key", 42),
        ("semaphore_rate", "30 per minute"),
        ("semaphore_spacing", 0),
    ],
)
def test_bad_task_options_fail_at_declaration(option: str, value: Any) -> None:
    """Each bad option value raises ConfigurationError naming the task and the option."""
    app = make_app()
    with pytest.raises(ConfigurationError) as caught:

        @app.task(base=SemaphoreTask, lazy=False, shared=False, name="cfg.bad", **{option: value})
        def bad() -> None: ...

    assert caught.value.setting == f"cfg.bad.{option}"


def test_a_bad_limit_in_the_decorator_fails_at_once() -> None:
    """limit_concurrency(0) is refused before any function is decorated."""
    with pytest.raises(ConfigurationError, match="limit"):
        limit_concurrency(0)


def test_keys_from_templates_positional_fields_and_functions() -> None:
    """A key is the task name, a template over bound arguments (defaults included), or a function."""
    app = make_app()

    @limit_concurrency(2, key="crawl:{host}:{0}:{depth}", app=app, lazy=False, shared=False)
    def crawl(host: str, path: str, depth: int = 1) -> None: ...

    @app.task(base=SemaphoreTask, semaphore_limit=1, semaphore_key=lambda a, k: f"fn:{a[0]}", lazy=False, shared=False)
    def by_function(x: int) -> None: ...

    @app.task(base=SemaphoreTask, semaphore_limit=1, lazy=False, shared=False, name="cfg.plain")
    def plain() -> None: ...

    def key(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        return semaphore_for_call(task, args, kwargs).name

    assert key(crawl, ("a.org", "/x"), {}) == "crawl:a.org:a.org:1"
    assert key(crawl, (), {"host": "b.org", "path": "/", "depth": 3}) == "crawl:b.org:b.org:3"
    assert key(by_function, (7,), {}) == "fn:7"
    assert key(plain, (), {}) == "cfg.plain"


def test_calling_the_function_directly_bypasses_the_semaphore() -> None:
    """task(...) in plain code runs the body without Redis (the backend here does not exist)."""
    app = make_app(semaphore_backend_url="redis://127.0.0.1:1/0")

    @limit_concurrency(1, app=app, lazy=False, shared=False)
    def add(a: int, b: int) -> int:
        return a + b

    assert add(2, 3) == 5


def _worker_start_error(tmp_path: Path, module_body: str) -> str:
    """Start a real worker on an app with a configuration problem; return what it printed."""
    with RedisServer() as broker:
        (tmp_path / "badapp.py").write_text(
            "from celery import Celery\n"
            "from celery_semaphore import SemaphoreTask\n"
            f"app = Celery('badapp', broker='{broker.url}')\n" + module_body
        )
        worker = Worker({"PYTHONPATH": str(tmp_path)}, name="bad", concurrency=1, app="badapp")
        worker.env["PYTHONPATH"] = f"{tmp_path}:{worker.env['PYTHONPATH']}"
        worker.start(wait_ready=False)
        code = worker.wait_exit(timeout=60)
        assert code != 0, "the worker must refuse to start"
        return worker.log()


@pytest.mark.workers
def test_a_worker_refuses_to_start_with_a_task_that_has_no_limit(tmp_path: Path) -> None:
    """A SemaphoreTask with no limit anywhere stops the worker at start, naming the task."""
    log = _worker_start_error(
        tmp_path, "@app.task(base=SemaphoreTask, name='badapp.unlimited')\ndef unlimited(): pass\n"
    )
    assert "badapp.unlimited.semaphore_limit" in log
    assert "ConfigurationError" in log


@pytest.mark.workers
def test_a_worker_refuses_to_start_with_a_bad_setting(tmp_path: Path) -> None:
    """A bad semaphore_* setting stops the worker at start, naming the setting and value."""
    log = _worker_start_error(
        tmp_path,
        "app.conf.semaphore_countdown = (10, 2)\n"
        "@app.task(base=SemaphoreTask, semaphore_limit=1)\ndef limited(): pass\n",
    )
    assert "semaphore_countdown=(10, 2)" in log


def test_an_inherited_key_template_is_checked_against_each_task() -> None:
    """A template set on a SemaphoreTask subclass is checked against every task built on it."""
    app = make_app()

    class AccountTask(SemaphoreTask):  # type: ignore[misc]
        semaphore_key = "api:{account}"
        semaphore_limit = 2

    @app.task(base=AccountTask, lazy=False, shared=False)
    def good(account: str) -> None: ...

    with pytest.raises(ConfigurationError, match="account"):

        @app.task(base=AccountTask, lazy=False, shared=False)
        def bad(user: str) -> None: ...


def test_a_template_field_gathered_by_kwargs_fills_the_key_or_names_what_is_missing() -> None:
    """A key template naming a keyword that goes into ``**kwargs`` fills from it; a call that
    lacks it fails with a ConfigurationError naming the template and the argument, not a KeyError."""
    app = make_app(semaphore_backend_url="redis://127.0.0.1:1/1")

    @limit_concurrency(2, key="t:{tenant}", app=app, lazy=False, shared=False, name="cfg.by_tenant")
    def by_tenant(**options: Any) -> None: ...

    assert semaphore_for_call(by_tenant, (), {"tenant": "acme", "other": 1}).name == "t:acme"
    with pytest.raises(ConfigurationError) as caught:
        semaphore_for_call(by_tenant, (), {"other": 1})
    assert caught.value.setting == "cfg.by_tenant.semaphore_key"
    assert caught.value.value == "t:{tenant}"
    assert "'tenant'" in str(caught.value)


def test_eviction_is_warned_of_only_where_redis_can_evict(caplog: pytest.LogCaptureFixture) -> None:
    """No memory limit means nothing is evicted, whatever the policy; a limit with an evicting
    policy (volatile-* ones included: our keys carry expiries) draws the warning."""
    from celery_semaphore._celery.worker import _warn_about_eviction

    with RedisServer() as server, server.client() as client:
        cases = [
            ("0", "allkeys-lru", False),
            ("1gb", "noeviction", False),
            ("1gb", "volatile-ttl", True),
            ("1gb", "allkeys-lru", True),
        ]
        for maxmemory, policy, warned in cases:
            client.config_set("maxmemory", maxmemory)
            client.config_set("maxmemory-policy", policy)
            caplog.clear()
            with caplog.at_level("WARNING", logger="celery_semaphore"):
                _warn_about_eviction(server.url)
            assert any("may evict" in r.getMessage() for r in caplog.records) is warned, (maxmemory, policy)


def test_a_worker_refuses_state_of_a_newer_protocol_and_records_its_own(redis_server: RedisServer) -> None:
    """Workers of two releases share the keys during a rolling deploy: a worker records the
    protocol of the state it writes, and one of an older release refuses to start against state
    a newer, incompatible release wrote (instead of misreading it), naming the prefix."""
    from celery_semaphore._celery.worker import STATE_PROTOCOL, check_state_protocol

    app = make_app(semaphore_backend_url=redis_server.url, semaphore_prefix="rolling")
    client = redis_server.client()
    check_state_protocol(config_for(app))
    assert client.get("rolling:protocol") == str(STATE_PROTOCOL).encode()
    client.set("rolling:protocol", STATE_PROTOCOL + 1)
    with pytest.raises(ConfigurationError, match=r"semaphore_prefix.*newer celery-semaphore") as caught:
        check_state_protocol(config_for(app))
    assert caught.value.value == "rolling"
    client.set("rolling:protocol", 1)  # state of an older release: read as it is, and recorded anew
    check_state_protocol(config_for(app))
    assert client.get("rolling:protocol") == str(STATE_PROTOCOL).encode()


@pytest.mark.parametrize(
    ("broker", "warned"), [("redis://127.0.0.1:1/0", False), ("amqp://guest@127.0.0.1:1//", False)]
)
def test_worker_eta_task_limit_is_not_warned_of_where_copies_wait_in_the_broker(
    caplog: pytest.LogCaptureFixture, broker: str, warned: bool
) -> None:
    """A waiting task's due-later copies wait in the broker's Redis (the Redis broker) or in
    backstop queues (RabbitMQ), never in a worker's prefetch window, which
    ``worker_eta_task_limit`` caps: the setting is harmless, and the worker says nothing of it
    (it warned on the Redis broker while the copies were countdown messages)."""
    from celery_semaphore._celery.worker import _warn_about_eta_task_limit

    app = make_app(broker_url=broker, worker_eta_task_limit=8)
    with caplog.at_level("WARNING", logger="celery_semaphore"):
        _warn_about_eta_task_limit(app)
    messages = [r.getMessage() for r in caplog.records if "worker_eta_task_limit=8" in r.getMessage()]
    assert not messages, messages
