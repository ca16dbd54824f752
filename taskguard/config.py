"""``from_env()``: a :class:`~taskguard.RedisLocks` configured by ``TASKGUARD_*`` variables.

=============================  =============================================  ==============
variable                       accepted form                                  default
=============================  =============================================  ==============
``TASKGUARD_REDIS_URL``        ``redis://``, ``rediss://``, ``unix://`` or    required
                               ``sentinel://h:26379;sentinel://h2:26379``
``TASKGUARD_SENTINEL_MASTER``  the master name Sentinel monitors               required with
                                                                              ``sentinel://``
``TASKGUARD_SENTINEL_PASSWORD`` the sentinels' own password (not the           none
                               primary's: that one goes in the URL)
``TASKGUARD_REPLICAS``         int 0-16: replicas that must acknowledge each  ``0``
                               acquisition (``WAIT``) before a body starts
``TASKGUARD_REPLICA_TIMEOUT``  seconds, number > 0, at most 60                ``0.1``
``TASKGUARD_PREFIX``           1-64 chars of ``A-Z a-z 0-9 _ - . :``          ``taskguard``
``TASKGUARD_DB``               int >= 0 (overrides the URL's database)        from the URL
``TASKGUARD_CONNECT_TIMEOUT``  seconds, number > 0                            ``5``
``TASKGUARD_SOCKET_TIMEOUT``   seconds, number > 0                            ``5``
``TASKGUARD_RETRIES``          int 0-100 (redis-py retries per command)       ``1``
``TASKGUARD_SHUTDOWN_TIMEOUT`` seconds, number > 0 (``close()`` budget)       ``5``
``TASKGUARD_RENEW_FRACTION``   number in (0, 0.5]                             ``0.3333``
=============================  =============================================  ==============

Every bad value raises :class:`~taskguard.ConfigError` naming the variable and its accepted form;
a URL is only ever shown with its password masked.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .errors import ConfigError
from .redis_client import check_master_name
from .redis_locks import RedisLocks
from .urls import check_url, is_sentinel_url, redact_url
from .validate import (
    MAX_REPLICAS,
    MAX_SECONDS,
    WAIT_MARGIN,
    check_fraction,
    check_prefix,
    check_replicas,
    check_seconds,
    check_setting_names,
    replica_timeout_fits,
)

if TYPE_CHECKING:  # redis_locks imports this module
    from .redis_locks import RedisLocks

__all__ = ["from_env", "from_settings", "read_env", "parse_prefix", "ENV_VARS", "EX_CONFIG"]

#: The exit code of a command that refuses its configuration (``EX_CONFIG`` of sysexits.h):
#: ``celery beat -S taskguard``, ``taskguard rq-cron`` and ``taskguard metrics`` exit with it.
EX_CONFIG = 78


def _show(raw: str) -> str:
    return repr(raw if len(raw) <= 40 else raw[:37] + "...")


def _seconds(name: str, raw: str) -> float:
    try:
        return check_seconds(name, float(raw.strip()))
    except (ValueError, ConfigError):
        raise ConfigError(
            f"{name} must be a number of seconds > 0 and at most {MAX_SECONDS:.0e} "
            f"(e.g. '5' or '2.5'), got {_show(raw)}"
        ) from None


def _int_range(lo: int, hi: int) -> Callable[[str, str], int]:
    def parse(name: str, raw: str) -> int:
        s = raw.strip()
        if not (s.isascii() and s.isdigit()) or len(s) > 12 or not lo <= int(s) <= hi:
            raise ConfigError(f"{name} must be an integer from {lo} to {hi}, got {_show(raw)}")
        return int(s)

    return parse


def _fraction(name: str, raw: str) -> float:
    try:
        return check_fraction(float(raw.strip()), name)
    except (ValueError, ConfigError):
        raise ConfigError(f"{name} must be a number in (0, 0.5] (a fraction of the TTL), got {_show(raw)}") from None


def parse_prefix(name: str, raw: str) -> str:
    """A key prefix (:func:`taskguard.validate.check_prefix`). Raises ConfigError naming ``name``."""
    return check_prefix(raw, name)


def _url(name: str, raw: str) -> str:
    return check_url(raw, name)


def _master(name: str, raw: str) -> str:
    return check_master_name(name, raw.strip())


def _secret(name: str, raw: str) -> str:
    if not raw:
        raise ConfigError(f"{name} is set but empty (got ''): unset it when the sentinels need no password")
    return raw


def _replica_timeout(name: str, raw: str) -> float:
    try:
        return check_replicas(0, float(raw.strip()))[1]
    except (ValueError, ConfigError):
        raise ConfigError(
            f"{name} must be a number of seconds > 0 and at most 60 (e.g. '0.1'), got {_show(raw)}"
        ) from None


#: variable -> (option name, parser)
ENV_VARS: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    "TASKGUARD_REDIS_URL": ("url", _url),
    "TASKGUARD_PREFIX": ("prefix", parse_prefix),
    "TASKGUARD_DB": ("db", _int_range(0, 100000)),
    "TASKGUARD_CONNECT_TIMEOUT": ("connect_timeout", _seconds),
    "TASKGUARD_SOCKET_TIMEOUT": ("socket_timeout", _seconds),
    "TASKGUARD_RETRIES": ("retries", _int_range(0, 100)),
    "TASKGUARD_SHUTDOWN_TIMEOUT": ("shutdown_timeout", _seconds),
    "TASKGUARD_RENEW_FRACTION": ("renew_fraction", _fraction),
    "TASKGUARD_SENTINEL_MASTER": ("sentinel_master", _master),
    "TASKGUARD_SENTINEL_PASSWORD": ("sentinel_password", _secret),
    "TASKGUARD_REPLICAS": ("replicas", _int_range(0, MAX_REPLICAS)),
    "TASKGUARD_REPLICA_TIMEOUT": ("replica_timeout", _replica_timeout),
}


#: Every ``TASKGUARD_*`` variable taskguard reads (a close misspelling of one is refused), and
#: those its ``./run`` script and test suite read (never misspellings of the others).
KNOWN_ENV_VARS = frozenset(ENV_VARS) | {
    "TASKGUARD_METRICS",
    "TASKGUARD_VENV",
    "TASKGUARD_SCRATCH_BASE",
    "TASKGUARD_REDIS_SERVER",
    "TASKGUARD_REDIS_CLI",
    "TASKGUARD_AMQP_URL",
    "TASKGUARD_REQUIRE_RABBITMQ",
    "TASKGUARD_CHROMIUM",
    "TASKGUARD_LIBFAKETIME",
    "TASKGUARD_SOAK_SECONDS",
    "TASKGUARD_SUITE_REPORT",
    # read by `taskguard rq-cron` (taskguard/cli.py)
    "TASKGUARD_RQ_CRON_TIMEZONE",
    "TASKGUARD_RQ_CRON_NAME",
    "TASKGUARD_RQ_CRON_LEADER_TTL",
    "TASKGUARD_RQ_CRON_CATCH_UP",
}


def read_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Parse the ``TASKGUARD_*`` variables present in ``environ`` (default ``os.environ``).

    Returns ``{option name: value}`` for the variables that are set. Raises ConfigError for a
    malformed value, or a variable that is a close misspelling of one it reads
    (``TASKGUARD_PREFX``: "did you mean TASKGUARD_PREFIX?")."""
    env = os.environ if environ is None else environ
    check_setting_names([v for v in env if v.startswith("TASKGUARD_")], KNOWN_ENV_VARS, "the environment")
    out: dict[str, Any] = {}
    for var, (opt, parse) in ENV_VARS.items():
        raw = env.get(var)
        if raw is not None:
            out[opt] = parse(var, raw)
    return out


def from_env(environ: Mapping[str, str] | None = None, *, client: Any = None, **overrides: Any) -> RedisLocks:
    """Build a :class:`~taskguard.RedisLocks` from ``TASKGUARD_*`` variables.

    Args:
        environ: the variables (default ``os.environ``).
        client: a redis-py client to use instead of ``TASKGUARD_REDIS_URL``.
        overrides: options that win over the variables (``prefix``, ``renew_fraction``, ...).

    No round trip is made; call ``check_health()`` to probe Redis.

    Raises:
        ConfigError: a variable is malformed, or ``TASKGUARD_REDIS_URL`` is missing while no
            ``client`` is given.
    """
    opts = read_env(environ)
    opts.update(overrides)
    url = opts.pop("url", None)
    if client is not None:
        for conn_opt in ("db", "connect_timeout", "socket_timeout", "retries", "sentinel_master", "sentinel_password"):
            opts.pop(conn_opt, None)
        return RedisLocks(client, **opts)
    if url is None:
        raise ConfigError(
            "TASKGUARD_REDIS_URL is not set: set it to a Redis URL (e.g. redis://127.0.0.1:6379/0) "
            "or pass client= to from_env()"
        )
    for opt, var in (
        ("sentinel_master", "TASKGUARD_SENTINEL_MASTER"),
        ("sentinel_password", "TASKGUARD_SENTINEL_PASSWORD"),
    ):
        if opts.get(opt) is not None and not is_sentinel_url(url):
            raise ConfigError(f"{var} is set, but TASKGUARD_REDIS_URL is not a sentinel:// URL ({redact_url(url)})")
    if is_sentinel_url(url) and opts.get("sentinel_master") is None:
        raise ConfigError(
            f"TASKGUARD_REDIS_URL is a sentinel:// URL ({redact_url(url)}): set TASKGUARD_SENTINEL_MASTER to the "
            "name the sentinels monitor the primary under"
        )
    socket_timeout = opts.get("socket_timeout", 5.0)
    if opts.get("replicas") and not replica_timeout_fits(opts.get("replica_timeout", 0.1), socket_timeout):
        raise ConfigError(
            f"TASKGUARD_REPLICA_TIMEOUT ({opts.get('replica_timeout')} s) must be below TASKGUARD_SOCKET_TIMEOUT "
            f"({socket_timeout} s) by at least {WAIT_MARGIN} s: WAIT blocks that long on the client's socket"
        )
    try:
        return RedisLocks.from_url(url, **opts)
    except ConfigError as e:
        raise ConfigError(f"TASKGUARD_REDIS_URL: {e}") from None


def from_settings(
    where: str,
    url: Any,
    prefix: Any = None,
    *,
    sentinel_master: Any = None,
    sentinel_password: Any = None,
    replicas: Any = None,
    replica_timeout: Any = None,
) -> RedisLocks:
    """Build a :class:`~taskguard.RedisLocks` from a framework's own settings (already typed
    values, ``None`` for one not set), e.g. Celery's ``app.conf.taskguard_*``: ``where`` is the
    settings' common name prefix (``"app.conf.taskguard_"``), which every error names, followed
    by the setting's (``redis_url``, ``prefix`` (default ``"taskguard"``; ``""`` is refused like
    any bad prefix), ``sentinel_master``, ``sentinel_password``, ``replicas``,
    ``replica_timeout``). No round trip is made. Raises ConfigError naming the setting (an error
    of the URL's own names ``redis_url``)."""
    try:
        url = check_url(url, f"{where}redis_url")
        opts: dict[str, Any] = {"prefix": parse_prefix(f"{where}prefix", "taskguard" if prefix is None else prefix)}
        if sentinel_master is not None:
            opts["sentinel_master"] = check_master_name(f"{where}sentinel_master", sentinel_master)
        if sentinel_password is not None:
            if not isinstance(sentinel_password, str) or not sentinel_password:
                raise ConfigError(f"{where}sentinel_password must be a non-empty str")
            opts["sentinel_password"] = sentinel_password
        try:
            if replicas is not None:
                opts["replicas"] = check_replicas(replicas, 0.1)[0]
            if replica_timeout is not None:
                opts["replica_timeout"] = check_replicas(0, replica_timeout)[1]
        except ConfigError as e:  # "replicas must be ..." -> "<where>replicas must be ..."
            raise ConfigError(f"{where}{e}") from None
        return RedisLocks.from_url(url, **opts)
    except ConfigError as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith(where) else f"{where}redis_url: {msg}") from None
