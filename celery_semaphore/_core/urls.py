"""Which Redis deployment a semaphore URL names: every part checked once, at start, into a :class:`BackendSpec`.

Separate from :mod:`.clients`, which builds the clients, because reading a URL needs no
connection and keeps no state: the Celery layer checks its settings with it before any client
exists, and a spec is all that building a client needs to know. (Celery's broker settings, in
kombu's forms, are read by :mod:`.broker_urls`; passwords are masked by :mod:`.masking`.)

The URL forms follow the convention of the ``limits`` library, so a team that already writes
them for rate limits writes the same here:

``redis://[[user]:password@]host[:port][/db][?option=value...]``
    One Redis server (redis-py's own form: host defaults to localhost, port to 6379, db to 0).
``rediss://...``
    The same over TLS. TLS options go in the query: ``ssl_cert_reqs=none``,
    ``ssl_ca_certs=/path/ca.pem``, ``ssl_certfile=...``, ``ssl_keyfile=...``.
``unix://[[user]:password@]/path/to/redis.sock[?db=N]``
    One Redis server on a Unix socket.
``redis+cluster://[[user]:password@]host:port[,host:port...][?option=value...]``
    A Redis Cluster, reached through any of the listed nodes (the client learns the rest).
    No db (a cluster has only db 0). Besides connection options, the query takes
    ``read_from_replicas``, ``require_full_coverage``, ``reinitialize_steps`` and
    ``dynamic_startup_nodes``.
``rediss+cluster://...``
    The same over TLS.
``redis+sentinel://[[user]:password@]host:port[,host:port...]/<service_name>[/<db>][?option=value...]``
    The master that the listed Sentinels call ``service_name``, found again after a failover.
    ``user`` and ``password`` authenticate to that master (an ACL user or ``requirepass``);
    query options that start with ``sentinel_`` configure the connections to the Sentinels
    themselves, prefix removed: ``sentinel_password=...``, ``sentinel_username=...``,
    ``sentinel_socket_timeout=...``. A Sentinel port defaults to 26379. The client asks the
    Sentinels where the master is at least every :data:`.clients.SENTINEL_CHECK_INTERVAL`
    seconds, so after a planned failover it stops writing to the demoted master within about
    that time.
``rediss+sentinel://...``
    The same with TLS to the master and to the Sentinels (``sentinel_ssl=false`` if only the
    master speaks TLS). The ``ssl_*`` options apply to both; a ``sentinel_ssl_*`` option
    overrides one for the Sentinels.

Every other query option is a redis-py connection option (``socket_timeout``,
``socket_connect_timeout``, ``health_check_interval``, ``protocol``, ``ssl_*``, ...). A
password may also come as a ``password=`` query option.

A ``socket_timeout`` or ``socket_connect_timeout`` option must be a positive number of
seconds; without one a client gets :mod:`.clients`' defaults.

Why parse it all here: redis-py parses a URL lazily and leniently (``redis://h:99999`` fails at
the first command with a bare ``ValueError``, ``redis://h/abc`` silently means db 0), so a worker
would start and then fail every task. :func:`parse_backend_url` checks every part once, at
start, and names the setting in a :class:`~celery_semaphore.errors.ConfigurationError`. Passwords
never appear in an error or a log: :func:`.masking.mask_url` replaces them with ``***``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple
from urllib.parse import parse_qsl, unquote, urlencode

import redis
import redis.cluster
import redis.connection

from ..errors import ConfigurationError
from .masking import _scrub, mask_url

__all__ = [
    "SCHEMES",
    "BackendSpec",
    "parse_backend_url",
]

#: Every scheme :func:`parse_backend_url` accepts.
SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster", "redis+sentinel", "rediss+sentinel")

DEFAULT_REDIS_PORT = 6379
DEFAULT_SENTINEL_PORT = 26379
_TIMEOUT_OPTIONS = ("socket_timeout", "socket_connect_timeout")

Kind = Literal["redis", "cluster", "sentinel"]

# Options of the cluster client itself (not of its connections), each with its type.
_CLUSTER_OPTIONS: dict[str, type] = {
    "read_from_replicas": bool,
    "require_full_coverage": bool,
    "reinitialize_steps": int,
    "dynamic_startup_nodes": bool,
}
_TRUE = {"1", "true", "yes", "on", "y"}
_FALSE = {"0", "false", "no", "off", "n"}


@dataclass(frozen=True, eq=False)
class BackendSpec:
    """A checked description of one semaphore Redis deployment.

    ``repr()`` and ``str()`` show the URL with its password masked, so a spec can be logged.
    Two specs are equal when they would build the same client: :func:`.clients.client_for` caches by it.
    """

    kind: Kind
    #: ``(host, port)`` of the server (``redis``), the startup nodes (``cluster``) or the
    #: Sentinels (``sentinel``); empty for a Unix socket.
    nodes: tuple[tuple[str, int], ...]
    #: The URL as given, password masked: for logs and messages.
    masked_url: str
    db: int = 0
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    #: The Sentinel service (master) name; ``None`` unless ``kind == "sentinel"``.
    service_name: str | None = None
    unix_path: str | None = None
    #: redis-py connection options for the data nodes (already typed).
    options: Mapping[str, Any] = field(default_factory=dict)
    #: Options of the RedisCluster client itself.
    cluster_options: Mapping[str, Any] = field(default_factory=dict)
    #: Connection options for the Sentinels (``sentinel_kwargs`` of redis-py's ``Sentinel``).
    sentinel_options: Mapping[str, Any] = field(default_factory=dict)
    #: The URL as given (with its password): what a plain Redis client is built from.
    url: str | None = field(default=None, repr=False)

    def _identity(self) -> tuple[Any, ...]:
        return (
            self.kind, self.nodes, self.db, self.tls, self.username, self.password, self.service_name,
            self.unix_path, self.url, repr(sorted(self.options.items())),
            repr(sorted(self.cluster_options.items())), repr(sorted(self.sentinel_options.items())),
        )  # fmt: skip

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BackendSpec) and self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash(self._identity())

    def __repr__(self) -> str:
        return f"BackendSpec({self.masked_url!r})"

    def __str__(self) -> str:
        return self.masked_url


class _Invalid(Exception):
    """A reason a URL is wrong; turned into a ConfigurationError that names the setting."""


def parse_backend_url(setting: str, url: Any) -> BackendSpec:
    """Check every part of ``url`` and describe the deployment it names.

    Raises :class:`ConfigurationError` naming ``setting``, with the password masked in the
    error's value, its message and its args.
    """
    if not isinstance(url, str):
        raise ConfigurationError(setting, url, "expected a Redis URL string")
    masked = mask_url(url)
    try:
        return _parse(url, masked)
    except _Invalid as error:
        raise ConfigurationError(setting, masked, _scrub(str(error), url)) from None


def _parse(url: str, masked: str) -> BackendSpec:
    if url != url.strip() or any(char.isspace() for char in url):
        raise _Invalid("a URL has no spaces")
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise _Invalid(f"not a URL; expected one of {_scheme_list()}")
    scheme = scheme.lower()
    if scheme not in SCHEMES:
        raise _Invalid(f"unknown scheme {scheme + '://'!r}; expected one of {_scheme_list()}")
    url = scheme + sep + rest  # redis-py knows its schemes in lower case only
    if "#" in rest:
        raise _Invalid("a Redis URL has no #fragment")
    rest, _, query = rest.partition("?")
    authority, slash, path = rest.partition("/")
    path = slash + path
    username, password, hosts = _split_authority(authority)
    raw_options = _query_options(query)
    if "password" in raw_options:
        if password is not None:
            raise _Invalid("a password both in the URL and in its query")
        password = raw_options.pop("password")
    if "username" in raw_options:
        if username is not None:
            raise _Invalid("a user name both in the URL and in its query")
        username = raw_options.pop("username")
    parts = _UrlParts(url, scheme, masked, scheme.startswith("rediss"), hosts, path, username, password, raw_options)
    if scheme in ("redis", "rediss"):
        return _parse_single(parts)
    if scheme == "unix":
        return _parse_unix(parts)
    if scheme.endswith("+cluster"):
        return _parse_cluster(parts)
    return _parse_sentinel(parts)


class _UrlParts(NamedTuple):
    """A URL split into its parts (its password already masked in ``masked``)."""

    url: str
    scheme: str
    masked: str
    tls: bool
    hosts: list[str]
    path: str
    username: str | None
    password: str | None
    raw: dict[str, str]


def _scheme_list() -> str:
    return ", ".join(f"{scheme}://" for scheme in SCHEMES)


def _split_authority(authority: str) -> tuple[str | None, str | None, list[str]]:
    userinfo, at, hostlist = authority.rpartition("@")
    username: str | None = None
    password: str | None = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
        if colon and not secret:
            password = None
    hosts = hostlist.split(",") if hostlist else []
    return username, password, hosts


def _query_options(query: str) -> dict[str, str]:
    options: dict[str, str] = {}
    if not query:
        return options
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        raise _Invalid("the query is not a list of option=value pairs") from None
    for name, value in pairs:
        if name in options:
            raise _Invalid(f"option {name!r} given twice")
        if not value:
            raise _Invalid(f"option {name!r} has no value")
        options[name] = value
    return options


_BRACKETED = re.compile(r"^\[(?P<host>[0-9A-Fa-f:.%a-zA-Z]+)\](?::(?P<port>.*))?$")
_HOST = re.compile(r"^[A-Za-z0-9._-]+$")


def _node(text: str, default_port: int) -> tuple[str, int]:
    match = _BRACKETED.match(text)
    if match:
        host, port_text = match["host"], match["port"]
    else:
        host, colon, port_text_or_empty = text.partition(":")
        port_text = port_text_or_empty if colon else None
        if not _HOST.match(host):
            raise _Invalid(f"bad host {host!r} (write an IPv6 address in brackets: [::1]:6379)" if host else "no host")
    if port_text is None:
        return host, default_port
    if not port_text.isdigit() or not port_text.isascii():
        raise _Invalid(f"port {port_text!r} is not a number")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise _Invalid(f"port {port} is out of range 1..65535")
    return host, port


def _db(text: str) -> int:
    if not text.isdigit() or not text.isascii():
        raise _Invalid(f"db {text!r} is not a non-negative integer")
    return int(text)


def _typed_options(options: Mapping[str, str], *, tls: bool) -> dict[str, Any]:
    """The query options converted as redis-py would, then tried on a connection object.

    Building a connection object opens no socket, but it rejects an option redis-py does not
    know, which redis-py itself would only do at the first command.
    """
    if not options:
        return {}
    probe = f"{'rediss' if tls else 'redis'}://127.0.0.1:6379/0?{urlencode(dict(options))}"
    try:
        typed: dict[str, Any] = dict(redis.connection.parse_url(probe))  # type: ignore[no-untyped-call]
    except ValueError as error:
        raise _Invalid(str(error)) from None
    for name in ("host", "port", "db", "connection_class"):
        typed.pop(name, None)
    for name in _TIMEOUT_OPTIONS:
        # redis-py takes any float, and only the first connect trips over it: 0 makes the socket
        # non-blocking (every read fails), a negative one raises a bare ValueError, inf or nan
        # an OverflowError or a wait for ever, which is what the timeout is there to prevent
        value = typed.get(name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise _Invalid(f"option {name!r}: {options[name]!r} is not a positive number of seconds")
    _try_connection(typed, tls=tls)
    return typed


def _try_connection(options: Mapping[str, Any], *, tls: bool, unix_path: str | None = None) -> None:
    extra: dict[str, Any] = {}
    if unix_path is not None:
        extra["path"] = unix_path
    connection_class: Any = (
        redis.connection.UnixDomainSocketConnection
        if unix_path is not None
        else redis.connection.SSLConnection
        if tls
        else redis.connection.Connection
    )
    try:
        connection_class(**extra, **options)
    except TypeError as error:
        unknown = re.search(r"unexpected keyword argument '([^']+)'", str(error))
        raise _Invalid(f"unknown option {unknown[1]!r}" if unknown else f"bad options: {error}") from None
    except (ValueError, redis.RedisError) as error:
        raise _Invalid(f"bad option: {error}") from None


def _parse_single(parts: _UrlParts) -> BackendSpec:
    url, scheme, masked, _, hosts, path, username, password, raw = parts
    if len(hosts) > 1:
        raise _Invalid(f"{scheme}:// names one server; for several use {scheme}+cluster:// or {scheme}+sentinel://")
    host, port = _node(hosts[0], DEFAULT_REDIS_PORT) if hosts else ("localhost", DEFAULT_REDIS_PORT)
    db = _path_db(path, raw)
    options = _typed_options(raw, tls=scheme == "rediss")
    return BackendSpec(
        kind="redis", nodes=((host, port),), masked_url=masked, db=db, tls=scheme == "rediss",
        username=username, password=password, options=options, url=url,
    )  # fmt: skip


def _path_db(path: str, raw: dict[str, str]) -> int:
    """The db of ``/<db>`` or of a ``db=`` option (not both)."""
    in_path = path.strip("/") if path.count("/") <= 1 else None
    if in_path is None:
        raise _Invalid(f"path {path!r}: expected /<db>")
    query_db = raw.pop("db", None)
    if in_path and query_db is not None:
        raise _Invalid("db given both in the path and as db=")
    text = in_path or query_db
    return _db(text) if text else 0


def _parse_unix(parts: _UrlParts) -> BackendSpec:
    url, _, masked, _, hosts, path, username, password, raw = parts
    if hosts:
        raise _Invalid("unix:// names a socket path, not a host: unix:///path/to/redis.sock")
    if len(path) <= 1:
        raise _Invalid("no socket path: unix:///path/to/redis.sock")
    query_db = raw.pop("db", None)
    db = _db(query_db) if query_db is not None else 0
    socket_path = unquote(path)
    options = _typed_options(raw, tls=False)
    _try_connection(options, tls=False, unix_path=socket_path)
    return BackendSpec(
        kind="redis", nodes=(), masked_url=masked, db=db, username=username, password=password,
        unix_path=socket_path, options=options, url=url,
    )  # fmt: skip


def _nodes(hosts: list[str], default_port: int, what: str) -> tuple[tuple[str, int], ...]:
    if not hosts or hosts == [""]:
        raise _Invalid(f"no {what} host: expected host:port[,host:port...]")
    if any(not host for host in hosts):
        raise _Invalid(f"an empty entry in the {what} host list")
    return tuple(_node(host, default_port) for host in hosts)


def _parse_cluster(parts: _UrlParts) -> BackendSpec:
    _, _, masked, tls, hosts, path, username, password, raw = parts
    nodes = _nodes(hosts, DEFAULT_REDIS_PORT, "cluster")
    if path not in ("", "/", "/0") or raw.get("db", "0") != "0":
        raise _Invalid("a Redis Cluster has only db 0: give no /<db>")
    raw.pop("db", None)
    cluster_options: dict[str, Any] = {}
    for name, kind in _CLUSTER_OPTIONS.items():
        if name in raw:
            cluster_options[name] = _convert(name, raw.pop(name), kind)
    options = _typed_options(raw, tls=tls)
    allowed = getattr(redis.cluster, "REDIS_ALLOWED_KEYS", None)
    if allowed is not None:
        for name in options:
            if name not in allowed:
                raise _Invalid(f"option {name!r} is not supported by the Redis Cluster client")
    return BackendSpec(
        kind="cluster", nodes=nodes, masked_url=masked, tls=tls, username=username, password=password,
        options=options, cluster_options=cluster_options,
    )  # fmt: skip


def _convert(name: str, value: str, kind: type) -> Any:
    if kind is bool:
        if value.lower() in _TRUE:
            return True
        if value.lower() in _FALSE:
            return False
        raise _Invalid(f"option {name!r}: {value!r} is not true or false")
    if not value.isdigit():
        raise _Invalid(f"option {name!r}: {value!r} is not a non-negative integer")
    return int(value)


def _parse_sentinel(url: _UrlParts) -> BackendSpec:
    _, _, masked, tls, hosts, path, username, password, raw = url
    nodes = _nodes(hosts, DEFAULT_SENTINEL_PORT, "Sentinel")
    parts = path.split("/")[1:] if path else []
    if not parts or not parts[0]:
        raise _Invalid("no service name: expected .../<service_name>[/<db>]")
    if len(parts) > 2 or (len(parts) == 2 and not parts[1]):
        raise _Invalid(f"path {path!r}: expected /<service_name>[/<db>]")
    service = unquote(parts[0])
    query_db = raw.pop("db", None)
    if len(parts) == 2 and query_db is not None:
        raise _Invalid("db given both in the path and as db=")
    db_text = parts[1] if len(parts) == 2 else query_db
    db = _db(db_text) if db_text is not None else 0
    sentinel_raw = {name[len("sentinel_") :]: value for name, value in raw.items() if name.startswith("sentinel_")}
    data_raw = {name: value for name, value in raw.items() if not name.startswith("sentinel_")}
    sentinel_tls = tls
    if "ssl" in sentinel_raw:
        sentinel_tls = _convert("sentinel_ssl", sentinel_raw.pop("ssl"), bool)
    if not tls and sentinel_tls:
        raise _Invalid("sentinel_ssl=true needs the rediss+sentinel:// scheme")
    sentinel_password = sentinel_raw.pop("password", None)
    sentinel_username = sentinel_raw.pop("username", None)
    if sentinel_tls:
        # One TLS deployment, one set of certificates: the ssl_* options of the master apply to
        # the Sentinels too, unless a sentinel_ssl_* option says otherwise.
        for name, value in data_raw.items():
            if name.startswith("ssl_"):
                sentinel_raw.setdefault(name, value)
    try:
        sentinel_options = _typed_options(sentinel_raw, tls=sentinel_tls)
    except _Invalid as error:
        raise _Invalid(f"Sentinel {error}") from None
    if sentinel_tls:
        sentinel_options["ssl"] = True
    if sentinel_password is not None:
        sentinel_options["password"] = sentinel_password
    if sentinel_username is not None:
        sentinel_options["username"] = sentinel_username
    options = _typed_options(data_raw, tls=tls)
    return BackendSpec(
        kind="sentinel", nodes=nodes, masked_url=masked, db=db, tls=tls, username=username,
        password=password, service_name=service, options=options, sentinel_options=sentinel_options,
    )  # fmt: skip
