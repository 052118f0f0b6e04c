"""Backend URLs: every form parses to the deployment it names, every malformed one is a
ConfigurationError naming the setting with the password masked, and clients are built once."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_semaphore._celery.broker_urls import backend_from_broker
from celery_semaphore._core.clients import client_for
from celery_semaphore._core.masking import mask_url
from celery_semaphore._core.urls import BackendSpec, parse_backend_url
from celery_semaphore.errors import ConfigurationError

from ..redis_server import RedisServer, free_port, system_binary, wait_until

SETTING = "semaphore_backend_url"
SECRET = "s3cr3t-Pw"


def parse(url: str) -> BackendSpec:
    return parse_backend_url(SETTING, url)


# --- the forms that work ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://127.0.0.1:6379/1", {"kind": "redis", "nodes": (("127.0.0.1", 6379),), "db": 1, "tls": False}),
        ("redis://", {"kind": "redis", "nodes": (("localhost", 6379),), "db": 0}),
        ("redis://h", {"nodes": (("h", 6379),), "db": 0}),
        ("redis://h:7000/", {"nodes": (("h", 7000),), "db": 0}),
        ("redis://h?db=4", {"db": 4}),
        ("redis://[::1]:6380/2", {"nodes": (("::1", 6380),), "db": 2}),
        (f"redis://:{SECRET}@h/0", {"username": None, "password": SECRET}),
        (f"redis://alice:{SECRET}@h/0", {"username": "alice", "password": SECRET}),
        ("redis://alice@h/0", {"username": "alice", "password": None}),
        ("redis://:p%40ss%3Aw@h/0", {"password": "p@ss:w"}),
        (f"redis://h/0?password={SECRET}", {"password": SECRET}),
        (
            "redis://h/0?socket_timeout=2.5&health_check_interval=10",
            {"options": {"socket_timeout": 2.5, "health_check_interval": 10}},
        ),
        ("rediss://h:6380/0?ssl_cert_reqs=none", {"tls": True, "options": {"ssl_cert_reqs": "none"}}),
        ("unix:///run/redis.sock", {"kind": "redis", "nodes": (), "unix_path": "/run/redis.sock", "db": 0}),
        (f"unix://:{SECRET}@/run/redis.sock?db=3", {"unix_path": "/run/redis.sock", "db": 3, "password": SECRET}),
        ("redis+cluster://h1:7000", {"kind": "cluster", "nodes": (("h1", 7000),), "tls": False}),
        (
            f"redis+cluster://alice:{SECRET}@h1:7000,h2:7001,[::1]:7002",
            {"nodes": (("h1", 7000), ("h2", 7001), ("::1", 7002)), "username": "alice", "password": SECRET},
        ),
        ("redis+cluster://h1:7000/0", {"kind": "cluster", "db": 0}),
        ("redis+cluster://h1", {"nodes": (("h1", 6379),)}),
        (
            "redis+cluster://h1:7000?read_from_replicas=true&require_full_coverage=no&reinitialize_steps=3",
            {"cluster_options": {"read_from_replicas": True, "require_full_coverage": False, "reinitialize_steps": 3}},
        ),
        ("rediss+cluster://h1:7000?ssl_cert_reqs=required", {"kind": "cluster", "tls": True}),
        (
            "redis+sentinel://s1:26379/mymaster",
            {"kind": "sentinel", "nodes": (("s1", 26379),), "service_name": "mymaster", "db": 0},
        ),
        ("redis+sentinel://s1,s2:26380/mymaster/2", {"nodes": (("s1", 26379), ("s2", 26380)), "db": 2}),
        ("redis+sentinel://s1/mymaster?db=5", {"db": 5}),
        (
            f"redis+sentinel://alice:{SECRET}@s1:26379/m?sentinel_password=spw&sentinel_socket_timeout=0.5",
            {
                "username": "alice",
                "password": SECRET,
                "sentinel_options": {"password": "spw", "socket_timeout": 0.5},
            },
        ),
        (
            "redis+sentinel://s1/m?sentinel_username=bob&sentinel_password=x",
            {"sentinel_options": {"username": "bob", "password": "x"}},
        ),
        ("redis+sentinel://s1/my%20master", {"service_name": "my master"}),
        ("rediss+sentinel://s1/m", {"tls": True, "sentinel_options": {"ssl": True}}),
        ("rediss+sentinel://s1/m?sentinel_ssl=false", {"tls": True, "sentinel_options": {}}),
        (
            "rediss+sentinel://s1/m?ssl_ca_certs=/ca.pem&sentinel_ssl_cert_reqs=none",
            {
                "options": {"ssl_ca_certs": "/ca.pem"},
                "sentinel_options": {"ssl": True, "ssl_ca_certs": "/ca.pem", "ssl_cert_reqs": "none"},
            },
        ),
        (
            "rediss+sentinel://s1/m?ssl_ca_certs=/ca.pem&sentinel_ssl=false",
            {"options": {"ssl_ca_certs": "/ca.pem"}, "sentinel_options": {}},
        ),
        ("REDIS+CLUSTER://h1:7000", {"kind": "cluster"}),
    ],
)
def test_valid_urls_describe_the_deployment(url: str, expected: dict[str, Any]) -> None:
    """Each accepted URL form yields a spec whose fields name the deployment it describes."""
    spec = parse(url)
    for name, value in expected.items():
        actual = getattr(spec, name)
        assert (dict(actual) if name.endswith("options") else actual) == value, name


# --- the forms that do not ----------------------------------------------------------------

MALFORMED = [
    # ports, sockets and dbs
    ("redis://127.0.0.1:99999/1", "port 99999 is out of range"),
    ("redis://127.0.0.1:abc/1", "port 'abc' is not a number"),
    ("redis://127.0.0.1:0/1", "out of range"),
    ("redis://127.0.0.1:/1", "port '' is not a number"),
    ("redis://h/abc", "db 'abc' is not a non-negative integer"),
    ("redis://h/-1", "not a non-negative integer"),
    ("redis://h/1/2", "expected /<db>"),
    ("redis://h?db=x", "db 'x'"),
    ("redis://h/1?db=2", "db given both"),
    ("redis://h:1,h:2/0", "names one server"),
    ("redis://h/0?socket_timeout=soon", "socket_timeout"),
    ("redis://h/0?no_such_option=1", "unknown option 'no_such_option'"),
    ("redis://h/0?db=1&db=2", "given twice"),
    ("redis://h/0?socket_timeout=", "has no value"),
    ("redis://h/0#top", "fragment"),
    ("redis://h /0", "no spaces"),
    ("redis://bad_host!/0", "bad host"),
    ("rediss://h/0?ssl_cert_reqs=maybe", "SSL"),
    ("unix://localhost/run/redis.sock", "socket path, not a host"),
    ("unix://", "no socket path"),
    ("unix:///run/r.sock?db=x", "db 'x'"),
    # schemes
    ("http://host/1", "unknown scheme 'http://'"),
    ("redis+foo://h/0", "unknown scheme"),
    ("localhost:6379", "not a URL"),
    # cluster
    ("redis+cluster://", "no cluster host"),
    ("redis+cluster:///", "no cluster host"),
    ("redis+cluster://h1:7000,,h2:7001", "empty entry"),
    ("redis+cluster://h1:7000,h2:70000", "port 70000 is out of range"),
    ("redis+cluster://h1:x", "port 'x' is not a number"),
    ("redis+cluster://h1:7000/1", "only db 0"),
    ("redis+cluster://h1:7000?db=2", "only db 0"),
    ("redis+cluster://h1:7000?read_from_replicas=perhaps", "not true or false"),
    ("redis+cluster://h1:7000?reinitialize_steps=-1", "not a non-negative integer"),
    ("redis+cluster://h1:7000?health_check_interval=5", "not supported by the Redis Cluster client"),
    # sentinel
    ("redis+sentinel://", "no Sentinel host"),
    ("redis+sentinel:///mymaster", "no Sentinel host"),
    ("redis+sentinel://s1:26379", "no service name"),
    ("redis+sentinel://s1:26379/", "no service name"),
    ("redis+sentinel://s1:26379//0", "no service name"),
    ("redis+sentinel://s1:26379/m/x", "db 'x'"),
    ("redis+sentinel://s1:26379/m/-3", "not a non-negative integer"),
    ("redis+sentinel://s1:26379/m/1/2", "expected /<service_name>[/<db>]"),
    ("redis+sentinel://s1:26379/m/", "expected /<service_name>[/<db>]"),
    ("redis+sentinel://s1:26379/m/1?db=2", "db given both"),
    ("redis+sentinel://s1:99999/m", "out of range"),
    ("redis+sentinel://s1,,s2/m", "empty entry"),
    ("redis+sentinel://s1/m?sentinel_socket_timeout=x", "Sentinel"),
    ("redis+sentinel://s1/m?sentinel_bogus=1", "unknown option 'bogus'"),
    ("redis+sentinel://s1/m?sentinel_ssl=true", "needs the rediss+sentinel"),
]


def _with_password(url: str) -> str:
    """The same URL with user:password (or, where it has no authority, a password option)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return f"alice:{SECRET}@{url}"
    return f"{scheme}://alice:{SECRET}@{rest}"


def _assert_masked(error: ConfigurationError) -> None:
    for text in (str(error), repr(error), repr(error.args), repr(error.value), error.reason):
        assert SECRET not in text
    assert "***" in str(error.value)


@pytest.mark.parametrize(("url", "reason"), MALFORMED)
def test_malformed_url_is_a_configuration_error_naming_the_setting(url: str, reason: str) -> None:
    """A malformed URL raises ConfigurationError with the setting, the URL and why."""
    with pytest.raises(ConfigurationError) as caught:
        parse(url)
    error = caught.value
    assert error.setting == SETTING
    assert error.args[0] == SETTING
    assert error.value == url
    assert reason in error.reason
    assert str(error).startswith(f"{SETTING}=")
    assert isinstance(error, ValueError)


@pytest.mark.parametrize(("url", "reason"), MALFORMED)
def test_malformed_url_with_a_password_masks_it_everywhere(url: str, reason: str) -> None:
    """The same malformed URLs with a password: the password appears in no part of the error."""
    with pytest.raises(ConfigurationError) as caught:
        parse(_with_password(url))
    _assert_masked(caught.value)


@pytest.mark.parametrize(
    "url",
    [
        f"http://user:{SECRET}@host/1",  # an unknown scheme with a password
        f"redis://user:{SECRET}@host:{SECRET}/0",  # the password echoed in the bad port
        f"redis://h/0?password={SECRET}&bogus=1",
        f"redis+sentinel://s1/m?sentinel_password={SECRET}&sentinel_bogus=1",
        f"redis://:{SECRET}@h/0?password=other",
        f"redis+cluster://:{SECRET.replace('-', '%2D')}@h1:x",
    ],
)
def test_passwords_never_leak_into_errors(url: str) -> None:
    """Passwords in the userinfo, in query options, or echoed in a bad part are masked."""
    with pytest.raises(ConfigurationError) as caught:
        parse(url)
    _assert_masked(caught.value)


def test_a_non_string_is_a_configuration_error() -> None:
    """A URL setting that is not a string is rejected with the setting named."""
    with pytest.raises(ConfigurationError, match=SETTING):
        parse_backend_url(SETTING, 6379)


# --- masking ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("redis://h:6379/0", "redis://h:6379/0"),
        (f"redis://:{SECRET}@h/0", "redis://:***@h/0"),
        (f"rediss://alice:{SECRET}@h/0", "rediss://alice:***@h/0"),
        (f"unix://:{SECRET}@/run/r.sock", "unix://:***@/run/r.sock"),
        (f"redis+cluster://alice:{SECRET}@h1:1,h2:2", "redis+cluster://alice:***@h1:1,h2:2"),
        (
            f"redis+sentinel://:{SECRET}@s1,s2/m/1?sentinel_password={SECRET}",
            "redis+sentinel://:***@s1,s2/m/1?sentinel_password=***",
        ),
        (f"redis://h/0?password={SECRET}&db=1", "redis://h/0?password=***&db=1"),
        (
            f"sentinel://:{SECRET}@s1:26379;sentinel://u:{SECRET}@s2:26379",
            "sentinel://:***@s1:26379;sentinel://u:***@s2:26379",
        ),
        (f"http://user:{SECRET}@host/1", "http://user:***@host/1"),
        (f"redis://:p@ss/w{SECRET}@h/0", "redis://:***@h/0"),
        (f"user:{SECRET}@host", "user:***@host"),
        ("redis://alice@h/0", "redis://alice@h/0"),
    ],
)
def test_mask_url_hides_every_password(url: str, masked: str) -> None:
    """mask_url replaces each password (userinfo or query option) with *** and keeps the rest."""
    assert mask_url(url) == masked


def test_spec_repr_and_str_mask_the_password() -> None:
    """A spec can be logged: its repr and str carry the masked URL only."""
    spec = parse(f"redis+sentinel://alice:{SECRET}@s1/m?sentinel_password={SECRET}")
    assert SECRET not in repr(spec)
    assert SECRET not in str(spec)
    assert spec.masked_url == "redis+sentinel://alice:***@s1/m?sentinel_password=***"


# --- defaults from a Celery broker setting ------------------------------------------------


def test_a_plain_redis_broker_is_the_default() -> None:
    """A redis:// broker (or the first of a failover list) is the semaphore's default Redis."""
    assert backend_from_broker("redis://h:6379/0") == parse("redis://h:6379/0")
    assert backend_from_broker(["rediss://h1/0", "rediss://h2/0"]) == parse("rediss://h1/0")
    assert backend_from_broker("redis://h1/0;redis://h2/0") == parse("redis://h1/0")


def test_kombu_redis_socket_broker_is_a_unix_socket() -> None:
    """kombu's redis+socket:// broker maps to the unix:// form redis-py knows."""
    spec = backend_from_broker("redis+socket:///run/redis.sock")
    assert spec is not None and spec.unix_path == "/run/redis.sock"


@pytest.mark.parametrize("broker", ["amqp://guest@localhost//", "memory://", "sqs://", None, [], ""])
def test_a_non_redis_broker_gives_no_default(broker: Any) -> None:
    """A broker that is not Redis gives None: the caller then asks for semaphore_backend_url."""
    assert backend_from_broker(broker) is None


@pytest.mark.parametrize(
    "broker",
    [
        f"sentinel://:{SECRET}@s1:26379;sentinel://s2:26380;sentinel://s3",
        [f"sentinel://:{SECRET}@s1:26379", "sentinel://s2:26380", "sentinel://s3"],
    ],
)
def test_kombu_sentinel_broker_is_a_sentinel_managed_master(broker: Any) -> None:
    """kombu's Sentinel form (a ;-joined string or a list) with master_name and sentinel_kwargs
    from the transport options gives the Sentinel-managed master kombu itself uses."""
    spec = backend_from_broker(
        broker, {"master_name": "mymaster", "sentinel_kwargs": {"password": "spw"}, "visibility_timeout": 60}
    )
    assert spec is not None
    assert spec.kind == "sentinel"
    assert spec.nodes == (("s1", 26379), ("s2", 26380), ("s3", 26379))
    assert spec.service_name == "mymaster"
    assert spec.password == SECRET
    assert dict(spec.sentinel_options) == {"password": "spw"}
    assert spec.db == 0
    assert SECRET not in repr(spec)


def test_kombu_sentinel_broker_db_and_tls() -> None:
    """The db of the first sentinel:// entry and broker_use_ssl carry over to the master."""
    spec = backend_from_broker(
        "sentinel://s1:26379/3;sentinel://s2:26379", {"master_name": "m"}, use_ssl={"ssl_cert_reqs": "none"}
    )
    assert spec is not None
    assert spec.db == 3
    assert spec.tls
    assert dict(spec.options) == {"ssl": True, "ssl_cert_reqs": "none"}


def test_kombu_sentinel_broker_without_master_name_is_an_error() -> None:
    """Without master_name the error names broker_transport_options, password masked."""
    with pytest.raises(ConfigurationError) as caught:
        backend_from_broker(f"sentinel://:{SECRET}@s1:26379", {"sentinel_kwargs": {"password": SECRET}})
    assert caught.value.setting == "broker_transport_options"
    assert "master_name" in caught.value.reason
    _assert_masked(caught.value)


@pytest.mark.parametrize(
    ("broker", "reason"),
    [
        (f"sentinel://:{SECRET}@s1:99999", "out of range"),
        (f"sentinel://:{SECRET}@s1:26379;redis://h/0", "is not sentinel://"),
        (f"sentinel://:{SECRET}@s1:26379/x", "db 'x'"),
        (f"sentinel://:{SECRET}@s1,s2:26379", "one Sentinel host"),
    ],
)
def test_malformed_kombu_sentinel_broker_is_an_error(broker: str, reason: str) -> None:
    """A malformed Sentinel broker URL is an error naming broker_url, password masked."""
    with pytest.raises(ConfigurationError) as caught:
        backend_from_broker(broker, {"master_name": "m"})
    assert caught.value.setting == "broker_url"
    assert reason in caught.value.reason
    _assert_masked(caught.value)


def test_malformed_plain_broker_is_an_error_naming_broker_url() -> None:
    """A plain Redis broker URL that cannot work is reported against broker_url."""
    with pytest.raises(ConfigurationError) as caught:
        backend_from_broker(f"redis://:{SECRET}@h:99999/0")
    assert caught.value.setting == "broker_url"
    _assert_masked(caught.value)


# --- clients (one server, real) -----------------------------------------------------------


def test_client_for_is_one_client_per_url(redis_server: RedisServer) -> None:
    """The same URL (or an equal spec) gives the same client; another URL another client."""
    url = redis_server.url
    client = client_for(url)
    assert client is client_for(url)
    assert client is client_for(parse(url))
    assert client is not client_for(url[:-1] + "1")
    assert isinstance(client, redis.Redis)
    assert client.ping()


def test_scheme_in_capitals_builds_a_client(redis_server: RedisServer) -> None:
    """A scheme written in capitals (accepted by the parser) also builds a working client."""
    client = client_for(f"REDIS://127.0.0.1:{redis_server.port}/5")
    assert client.ping()
    assert client.connection_pool.connection_kwargs["db"] == 5


def test_client_for_checks_the_url_first() -> None:
    """client_for on a malformed URL raises the ConfigurationError, not a redis-py error."""
    with pytest.raises(ConfigurationError, match="out of range"):
        client_for("redis://127.0.0.1:99999/0")


def test_client_for_uses_password_and_db() -> None:
    """A password-protected server is reached with the URL's password, on the URL's db."""
    with RedisServer(password=SECRET) as server:
        client = client_for(f"redis://:{SECRET}@127.0.0.1:{server.port}/3")
        client.set("k", "v")
        with server.client(db=3) as direct:
            assert direct.get("k") == b"v"


def test_client_for_acl_user(redis_server: RedisServer) -> None:
    """An ACL user from the URL authenticates as that user."""
    with redis_server.client() as admin:
        admin.execute_command("ACL", "SETUSER", "semaphore-user", "on", f">{SECRET}", "~*", "+@all")
    try:
        client = client_for(f"redis://semaphore-user:{SECRET}@127.0.0.1:{redis_server.port}/0")
        assert client.execute_command("ACL", "WHOAMI") in (b"semaphore-user", "semaphore-user")
    finally:
        with redis_server.client() as admin:
            admin.execute_command("ACL", "DELUSER", "semaphore-user")


def test_client_for_unix_socket() -> None:
    """unix:// reaches a server on its socket, on the db of the db= option."""
    with RedisServer(extra=["--unixsocket", "sock", "--unixsocketperm", "700"]) as server:
        client = client_for(f"unix://{server.dir}/sock?db=2")
        try:
            client.set("k", "v")
            with server.client(db=2) as direct:
                assert direct.get("k") == b"v"
        finally:
            # client_for keeps it for the process: its connection to this server, gone after
            # the test, would stay open to the end of the run
            client.close()


def _ping_in_child(url: str, queue: Any) -> None:
    try:
        queue.put(bool(client_for(url).ping()))
    except Exception as error:  # reported to the parent, which fails the test
        queue.put(repr(error))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_client_survives_fork(redis_server: RedisServer) -> None:
    """A client made (and used) in a parent works in a forked child, as in a prefork worker."""
    url = redis_server.url
    assert client_for(url).ping()
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_ping_in_child, args=(url, queue))
    child.start()
    try:
        assert queue.get(timeout=20) is True
    finally:
        child.join(timeout=20)
        queue.close()
        queue.join_thread()
    assert child.exitcode == 0
    assert client_for(url).ping()


# The narrowest ACL rules docs/deploying.md gives for the semaphore's own commands.
SEMAPHORE_ACL = ["resetkeys", "~semaphore:*", "resetchannels", "&*", "-@all", "+@read", "+@write", "+@scripting",
                 "+@pubsub", "+@connection", "+time"]  # fmt: skip


def test_documented_acl_rules_suffice_for_the_semaphore(redis_server: RedisServer) -> None:
    """A user limited to the documented ACL rules can acquire, wait for a hand-off, release,
    read status, set and clear a limit and reset, through a client_for URL."""
    import threading

    from celery_semaphore import FairSemaphore

    user = "semaphore-acl"
    with redis_server.client() as admin:
        admin.execute_command("ACL", "SETUSER", user, "on", f">{SECRET}", *SEMAPHORE_ACL)
    try:
        client = client_for(f"redis://{user}:{SECRET}@127.0.0.1:{redis_server.port}/0")
        semaphore = FairSemaphore(client, "acl", 1, lease=5)
        first = semaphore.acquire(timeout=5)
        waited: list[object] = []

        def second() -> None:
            lease = semaphore.acquire(timeout=10)
            waited.append(lease)
            lease.release()

        thread = threading.Thread(target=second)
        thread.start()
        wait_until(lambda: client.zcard(semaphore.keys.queue) == 1, 10, "the second caller waiting in line")
        first.release()
        thread.join(timeout=15)
        assert len(waited) == 1
        semaphore.status()
        semaphore.set_limit(3)
        semaphore.clear_limit()
        semaphore.reset()
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.config_get("maxmemory-policy")
    finally:
        with redis_server.client() as admin:
            admin.execute_command("ACL", "DELUSER", user)


# --- TLS (rediss://) against a real TLS server ---------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _certificates(directory: Path) -> dict[str, Path]:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
             "-days", "1", "-subj", "/CN=celery-semaphore test CA", cwd=directory)  # fmt: skip
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=directory)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "1", "-extfile", "san.cnf", cwd=directory)  # fmt: skip
    return {name: directory / name for name in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, dict[str, Path]]]:
    """A Redis (the one on PATH, if built with TLS) with a plain port and a TLS port that
    requires a client certificate signed by the test CA."""
    binary = system_binary()
    if binary is None or shutil.which("openssl") is None:
        pytest.skip("needs redis-server on PATH and openssl")
    files = _certificates(tmp_path_factory.mktemp("tls"))
    tls_port = free_port()
    server = RedisServer(binary, extra=[
        "--tls-port", str(tls_port), "--tls-cert-file", str(files["server.pem"]),
        "--tls-key-file", str(files["server.key"]), "--tls-ca-cert-file", str(files["ca.pem"]),
        "--tls-auth-clients", "yes",
    ])  # fmt: skip
    try:
        server.start()
    except RuntimeError:
        server.close()
        pytest.skip("redis-server on PATH is built without TLS")
    yield tls_port, files
    server.close()


def test_rediss_url_with_ca_and_client_certificate(tls_server: tuple[int, dict[str, Path]]) -> None:
    """rediss:// with ssl_ca_certs, ssl_certfile and ssl_keyfile in the query talks TLS."""
    port, files = tls_server
    url = (f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={files['ca.pem']}"
           f"&ssl_certfile={files['client.pem']}&ssl_keyfile={files['client.key']}")  # fmt: skip
    client = client_for(url)
    client.set("over-tls", "yes")
    assert client.get("over-tls") == b"yes"


def test_rediss_url_without_trusted_ca_is_refused(tls_server: tuple[int, dict[str, Path]]) -> None:
    """Without the CA, the server's certificate is not trusted: a ConnectionError at first use."""
    port, files = tls_server
    client = client_for(
        f"rediss://127.0.0.1:{port}/0?ssl_certfile={files['client.pem']}&ssl_keyfile={files['client.key']}"
    )
    with pytest.raises(redis.ConnectionError, match=r"(?i)certificate"):
        client.ping()


def test_rediss_url_without_client_certificate_is_refused(
    tls_server: tuple[int, dict[str, Path]],
) -> None:
    """A server that requires client certificates refuses a client without one."""
    port, files = tls_server
    client = client_for(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={files['ca.pem']}&socket_timeout=5")
    with pytest.raises(redis.ConnectionError):
        client.ping()
