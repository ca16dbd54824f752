"""Validation and password-free display of Redis URLs."""

from __future__ import annotations

from urllib.parse import urlsplit

from .errors import ConfigError

__all__ = ["check_url", "redact_url"]

SCHEMES = ("redis", "rediss", "unix")
ACCEPTED = "redis://[user[:password]@]host[:port][/db], rediss://... or unix:///path/to.sock"


def redact_url(url: object) -> str:
    """``url`` with any password replaced by ``***``; safe for errors and logs.

    Anything that does not parse is shown as ``'<unparseable URL>'`` (it may hold a secret)."""
    if not isinstance(url, str):
        return f"<{type(url).__name__}>"
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:
        return "'<unparseable URL>'"
    if parts.query:  # redis-py also reads ?password= (and friends) from the query string
        query = "&".join(
            f"{k}=***" if k.lower() in ("password", "username", "user", "pass") else f"{k}={v}"
            for k, _, v in (item.partition("=") for item in parts.query.split("&"))
        )
        parts = parts._replace(query=query)
    if parts.password is None and "@" not in parts.netloc:
        return repr(parts.geturl())
    user = parts.username or ""
    netloc = f"{user}:***@{host}{port}" if user else f":***@{host}{port}" if parts.password is not None else f"***@{host}{port}"
    return repr(parts._replace(netloc=netloc).geturl())


def check_url(url: object, name: str) -> str:
    """Validate a Redis URL; raise :class:`ConfigError` naming ``name`` and the accepted forms."""
    shown = redact_url(url)
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"{name} must be a Redis URL ({ACCEPTED}), got {shown}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ConfigError(f"{name} must be a Redis URL ({ACCEPTED}), got {shown}") from None
    if parts.scheme not in SCHEMES:
        raise ConfigError(f"{name} must be a Redis URL ({ACCEPTED}), got {shown}: unknown scheme")
    if parts.scheme == "unix":
        if not parts.path:
            raise ConfigError(f"{name}: a unix:// URL needs a socket path ({ACCEPTED}), got {shown}")
        return url
    if not parts.hostname:
        raise ConfigError(f"{name}: the URL has no host ({ACCEPTED}), got {shown}")
    if port is not None and not 0 < port < 65536:
        raise ConfigError(f"{name}: the port must be 1-65535, got {shown}")
    db = parts.path.lstrip("/")
    if db and not (db.isdigit() and db.isascii()):
        raise ConfigError(f"{name}: the path must be a database number, got {shown}")
    return url
