"""Validation and password-free display of Redis URLs."""

from __future__ import annotations

import re
from typing import NamedTuple
from urllib.parse import parse_qsl, unquote, urlsplit

from redis.connection import URL_QUERY_ARGUMENT_PARSERS, parse_url

from .errors import ConfigError

__all__ = ["check_url", "redact_url", "redacted", "scrub", "is_sentinel_url", "SentinelURL", "parse_sentinel_url"]

SCHEMES = ("redis", "rediss", "unix")
ACCEPTED = (
    "redis://[user[:password]@]host[:port][/db], rediss://..., unix:///path/to.sock or "
    "sentinel://[user[:password]@]host[:port][/db];sentinel://host2[:port]..."
)
#: The port of a sentinel address without one (Sentinel's own default).
SENTINEL_PORT = 26379
_SECRET_QUERY = ("password", "username", "user", "pass")
# user-info anywhere in the string, also where urlsplit finds no netloc ("redis:u:pw@host")
_USERINFO = re.compile(r"(?<=:)[^:@/?#]*(?=@)")


def redact_url(url: object) -> str:
    """``url`` with any password replaced by ``***``, quoted, for messages: safe for errors and
    logs. Anything that does not parse is shown as ``'<unparseable URL>'`` (it may hold a
    secret); a non-string as ``<its type>``."""
    if not isinstance(url, str):
        return f"<{type(url).__name__}>"
    return repr(redacted(url))


def redacted(url: str) -> str:
    """``url`` with any password replaced by ``***``, unquoted (for JSON output and tables)."""
    if is_sentinel_url(url):
        return ";".join(_redacted_one(part) for part in url.split(";"))
    return _redacted_one(url)


def _redacted_one(url: str) -> str:
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:
        return "<unparseable URL>"
    if parts.query:  # redis-py also reads ?password= (and friends) from the query string
        query = "&".join(
            f"{k}=***" if k.lower() in _SECRET_QUERY else f"{k}={v}"
            for k, _, v in (item.partition("=") for item in parts.query.split("&"))
        )
        parts = parts._replace(query=query)
    if not parts.netloc:
        return _USERINFO.sub("***", parts.geturl())
    if "@" not in parts.netloc and "@" in url:
        # an "@" the parser did not take for user info (after a "/" or "#" in it): whatever lies
        # between the scheme and the last "@" may be a secret
        return re.sub(r"(?<=://).*@", "***@", url, count=1)
    if parts.password is None and "@" not in parts.netloc:
        return parts.geturl()
    user = parts.username or ""
    netloc = (
        f"{user}:***@{host}{port}"
        if user
        else f":***@{host}{port}"
        if parts.password is not None
        else f"***@{host}{port}"
    )
    return parts._replace(netloc=netloc).geturl()


def scrub(text: str, url: str) -> str:
    """``text`` (an error message that may quote parts of ``url``) without ``url``'s password."""
    for part in url.split(";") if is_sentinel_url(url) else (url,):
        try:
            secret = urlsplit(part).password
        except ValueError:
            return "invalid URL"
        if secret:
            text = text.replace(secret, "***")
    return text


def is_sentinel_url(url: object) -> bool:
    """Is ``url`` a ``sentinel://`` URL (kombu's form: addresses joined by ``;``)?"""
    return isinstance(url, str) and url.strip().lower().startswith("sentinel://")


class SentinelURL(NamedTuple):
    """A parsed ``sentinel://`` URL: the sentinels' ``(host, port)`` addresses, and the user
    name, password and database of the *primary* they manage (given once, on any address; as
    kombu's ``sentinel://`` transport takes them). The master name and Sentinel's own password
    are settings, not part of the URL."""

    sentinels: list[tuple[str, int]]
    username: str | None
    password: str | None
    db: int


def parse_sentinel_url(url: str, name: str) -> SentinelURL:
    """Parse a ``sentinel://host:26379;sentinel://host2:26379`` URL (the port defaults to
    26379; ``[user[:password]@]`` and ``/db`` may be given on one address, or the same on
    several). Raises ConfigError naming ``name``, the password masked."""
    shown = redact_url(url)
    sentinels: list[tuple[str, int]] = []
    creds: set[tuple[str | None, str | None]] = set()
    dbs: set[int] = set()
    for part in (p.strip() for p in url.strip().split(";")):
        if not part:
            continue
        try:
            parts = urlsplit(part)
            port = parts.port
        except ValueError:
            raise ConfigError(
                f"{name}: each sentinel address must be sentinel://host[:port] with a port 1-65535 ({ACCEPTED}), "
                f"got {shown}"
            ) from None
        if parts.scheme.lower() != "sentinel":
            raise ConfigError(
                f"{name}: every address of a sentinel URL must start with sentinel:// ({ACCEPTED}), got {shown}"
            )
        if not parts.hostname:
            raise ConfigError(f"{name}: a sentinel address has no host ({ACCEPTED}), got {shown}")
        if parts.query or parts.fragment:
            raise ConfigError(f"{name}: a sentinel URL takes no query string, got {shown}")
        db = parts.path.lstrip("/")
        if db:
            if not (db.isdigit() and db.isascii() and len(db) <= 9):
                raise ConfigError(f"{name}: the path must be a database number, got {shown}")
            dbs.add(int(db))
        if parts.username or parts.password:
            creds.add((unquote(parts.username) if parts.username else None, unquote(parts.password or "") or None))
        sentinels.append((parts.hostname, SENTINEL_PORT if port is None else port))
    if not sentinels:
        raise ConfigError(f"{name}: a sentinel URL needs at least one sentinel://host[:port], got {shown}")
    if len(creds) > 1 or len(dbs) > 1:
        raise ConfigError(
            f"{name}: the addresses of a sentinel URL give different credentials or databases, got {shown}"
        )
    username, password = next(iter(creds), (None, None))
    return SentinelURL(sentinels, username, password, next(iter(dbs), 0))


def _split_broken(url: str) -> tuple[str, bool, str, str]:
    """``(scheme, had user info, host:port, rest)`` of a URL that ``urlsplit`` refuses.
    Everything up to the last ``@`` counts as user info (it may hold a password, "/" and "@"
    included) and is never returned."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "", False, "", url
    userinfo = "@" in rest
    rest = rest.rpartition("@")[2]
    hostport, slash, path = rest.partition("/")
    return scheme, userinfo, hostport, slash + path.split("?")[0]


def _shown_broken(url: str) -> str:
    """A URL ``urlsplit`` refuses, for messages: its user info masked, its query left out."""
    scheme, userinfo, hostport, rest = _split_broken(url)
    if not scheme:
        return "'<unparseable URL>'"
    return repr(f"{scheme}://{'***@' if userinfo else ''}{hostport}{rest}")


def _port_problem(url: str) -> str:
    """What is wrong with the port of a URL ``urlsplit`` refused (``""`` when not the port)."""
    hostport = _split_broken(url)[2]
    if hostport.startswith("["):  # [IPv6]:port
        hostport = hostport.rpartition("]")[2]
    port = hostport.rpartition(":")[2] if ":" in hostport else ""
    if port and not (port.isascii() and port.isdigit()):
        return f": the port {port!r} is not a number (1-65535)"
    if port and not 0 < int(port) < 65536:
        return ": the port must be 1-65535"
    return ""


def _known_query_options() -> set[str]:
    return set(URL_QUERY_ARGUMENT_PARSERS) | {"db", "password", "username", "protocol", "client_name"}


def check_url(url: object, name: str) -> str:
    """Validate a Redis URL; raise :class:`ConfigError` naming ``name`` and the accepted forms."""
    shown = redact_url(url)
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"{name} must be a Redis URL ({ACCEPTED}), got {shown}")
    if is_sentinel_url(url):
        parse_sentinel_url(url, name)
        return url
    problem = None
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # raised below, outside this block: urlsplit's message holds the netloc
        problem = f"{name} must be a Redis URL ({ACCEPTED}), got {_shown_broken(url)}{_port_problem(url)}"
    if problem:
        raise ConfigError(problem)
    if parts.scheme not in SCHEMES:
        hint = " (missing 'redis://'?)" if "://" not in url else ""
        raise ConfigError(f"{name} must be a Redis URL ({ACCEPTED}), got {shown}: unknown scheme{hint}")
    unknown = sorted({k for k, _ in parse_qsl(parts.query, keep_blank_values=True)} - _known_query_options())
    if unknown:
        raise ConfigError(f"{name}: unknown option(s) {', '.join(unknown)} in the URL's query string, got {shown}")
    if parts.scheme == "unix":
        if not parts.path:
            raise ConfigError(f"{name}: a unix:// URL needs a socket path ({ACCEPTED}), got {shown}")
        _parse_as_redis_py_does(url, name, shown)
        return url
    if not parts.hostname:
        raise ConfigError(f"{name}: the URL has no host ({ACCEPTED}), got {shown}")
    if port is not None and not 0 < port < 65536:
        raise ConfigError(f"{name}: the port must be 1-65535, got {shown}")
    db = parts.path.lstrip("/")
    if db and not (db.isdigit() and db.isascii() and len(db) <= 9):
        raise ConfigError(f"{name}: the path must be a database number, got {shown}")
    _parse_as_redis_py_does(url, name, shown)
    return url


def _parse_as_redis_py_does(url: str, name: str, shown: str) -> None:
    """The client is built by redis-py's own URL parser (``redis.connection.parse_url``): what it
    refuses is refused here first, with the setting's name and the password masked."""
    try:
        parse_url(url)  # type: ignore[no-untyped-call]  # (redis-py does not annotate parse_url)
    except (ValueError, TypeError) as e:
        raise ConfigError(
            f"{name} must be a Redis URL ({ACCEPTED}) that redis-py accepts: {scrub(str(e), url)}, got {shown}"
        ) from None
