"""Which Redis deployment a Celery broker setting names, so that a semaphore can default to it.

Separate from :mod:`.urls` because it follows kombu's conventions, not the package's own URL
forms: a broker setting is a string, a ``;``-joined string or a list; kombu spells a Unix socket
``redis+socket://``; and its Sentinel form (``sentinel://h1:26379;sentinel://h2:26379`` with
``broker_transport_options={"master_name": ...}``) spreads one deployment over several URLs and a
transport option. Each piece is read with the parsers of :mod:`.urls`. This module imports
neither Celery nor kombu: the Celery layer hands it the settings' values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .._core.masking import _mask_options, _scrub, mask_url
from .._core.urls import (
    DEFAULT_SENTINEL_PORT,
    BackendSpec,
    _Invalid,
    _node,
    _path_db,
    _split_authority,
    parse_backend_url,
)
from ..errors import ConfigurationError

__all__ = ["backend_from_broker"]


def backend_from_broker(
    broker_url: str | Sequence[str] | None,
    transport_options: Mapping[str, Any] | None = None,
    *,
    use_ssl: bool | Mapping[str, Any] | None = None,
) -> BackendSpec | None:
    """The Redis deployment a Celery broker setting points at, or ``None`` if not a Redis one.

    ``broker_url`` is Celery's ``broker_url`` (a string, a ``;``-joined string or a list);
    ``transport_options`` its ``broker_transport_options``; ``use_ssl`` its ``broker_use_ssl``
    (only read for the Sentinel form, where kombu applies it to the master).

    - A plain Redis broker (``redis://``, ``rediss://``, kombu's ``redis+socket://``): the first
      URL of the list, as Celery connects to it first.
    - kombu's Sentinel form (``sentinel://h1:26379;sentinel://h2:26379/0``): every
      ``sentinel://`` entry is a Sentinel; ``master_name`` (required) and ``sentinel_kwargs``
      come from the transport options; the user, password and db come from the first entry,
      which is where kombu takes them for the master.

    Raises :class:`ConfigurationError` (naming ``broker_url`` or ``broker_transport_options``)
    when the broker is a Redis one but its setting cannot work.
    """
    urls = _broker_urls(broker_url)
    if not urls:
        return None
    first = urls[0]
    scheme = first.partition("://")[0].lower()
    if scheme in ("redis", "rediss"):
        return parse_backend_url("broker_url", first)
    if scheme == "redis+socket":
        return parse_backend_url("broker_url", "unix" + first[len("redis+socket") :])
    if scheme != "sentinel":
        return None
    return _kombu_sentinel(urls, dict(transport_options or {}), use_ssl)


def _broker_urls(broker_url: str | Sequence[str] | None) -> list[str]:
    if broker_url is None:
        return []
    items = [broker_url] if isinstance(broker_url, str) else list(broker_url)
    urls: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise ConfigurationError("broker_url", item, "expected a URL string")
        urls.extend(part.strip() for part in item.split(";") if part.strip())
    return urls


def _kombu_sentinel(urls: list[str], options: dict[str, Any], use_ssl: bool | Mapping[str, Any] | None) -> BackendSpec:
    joined = ";".join(urls)
    masked = mask_url(joined)
    master_name = options.get("master_name")
    if not isinstance(master_name, str) or not master_name:
        raise ConfigurationError(
            "broker_transport_options",
            _mask_options(options),
            f"the Sentinel broker {masked!r} needs a 'master_name' transport option",
        )
    sentinel_kwargs = options.get("sentinel_kwargs") or {}
    if not isinstance(sentinel_kwargs, Mapping):
        raise ConfigurationError("broker_transport_options", _mask_options(options), "sentinel_kwargs must be a dict")
    nodes: list[tuple[str, int]] = []
    username = password = None
    db = 0
    for index, url in enumerate(urls):
        scheme, _, rest = url.partition("://")
        if scheme.lower() != "sentinel":
            raise ConfigurationError("broker_url", masked, f"entry {mask_url(url)!r} is not sentinel://")
        try:
            if "#" in rest or "?" in rest:
                rest = rest.split("#")[0].split("?")[0]
            authority, slash, path = rest.partition("/")
            user, secret, hosts = _split_authority(authority)
            if len(hosts) != 1:
                raise _Invalid("each sentinel:// entry names one Sentinel host")
            nodes.append(_node(hosts[0], DEFAULT_SENTINEL_PORT))
            if index == 0:
                username, password = user, secret
                db = _path_db(slash + path, {})
        except _Invalid as error:
            raise ConfigurationError("broker_url", masked, _scrub(str(error), joined)) from None
    sentinel_options = dict(sentinel_kwargs)
    data_options: dict[str, Any] = {}
    if use_ssl:
        data_options["ssl"] = True
        if isinstance(use_ssl, Mapping):
            data_options.update(use_ssl)
    return BackendSpec(
        kind="sentinel", nodes=tuple(nodes), masked_url=f"{masked} (master {master_name!r})", db=db,
        tls=bool(use_ssl), username=username, password=password, service_name=master_name,
        options=data_options, sentinel_options=sentinel_options,
    )  # fmt: skip
