"""Configuration: ``from_env`` (the ``TASKGUARD_*`` variables), ``RedisLocks.from_url`` and the
validation of options and TTLs. Every bad value is a ConfigError that names the setting and its
accepted form, and a password from a URL never appears in an error. Round trips go to the shared
real Redis under the test's own prefix."""

from __future__ import annotations

import math
import string
import traceback
import uuid
from urllib.parse import urlsplit

import pytest
import redis
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from taskguard import ConfigError, MemoryLocks, RedisLocks, TaskguardError, from_env
from taskguard.config import ENV_VARS

URL_VAR = "TASKGUARD_REDIS_URL"
ACCEPTED_URL = (
    "redis://[user[:password]@]host[:port][/db], rediss://..., unix:///path/to.sock or "
    "sentinel://[user[:password]@]host[:port][/db];sentinel://host2[:port]..."
)
PASSWORD = "s3cr3tPW"

PROPERTY = settings(
    max_examples=300, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)


def _error_text(e: BaseException) -> str:
    """Everything an error shows: message, repr, args and the formatted traceback (which follows
    ``__cause__``/``__context__`` unless suppressed)."""
    return "\n".join([str(e), repr(e), repr(e.args), "".join(traceback.format_exception(e))])


def _without_db(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def _delete_prefix(client: redis.Redis, prefix: str) -> None:
    keys = list(client.scan_iter(match="{" + prefix + ":*"))
    if keys:
        client.delete(*keys)


# -- TASKGUARD_REDIS_URL is required -------------------------------------------------------------


@pytest.mark.parametrize(
    "environ",
    [
        {},
        {"TASKGUARD_PREFIX": "jobs", "TASKGUARD_RETRIES": "2"},
        {"REDIS_URL": "redis://h"},  # another library's variable is not taskguard's
    ],
)
def test_missing_redis_url_names_the_variable(environ):
    with pytest.raises(ConfigError) as info:
        from_env(environ)
    msg = str(info.value)
    assert URL_VAR in msg
    assert "redis://" in msg  # says what to set it to
    assert isinstance(info.value, ValueError) and isinstance(info.value, TaskguardError)


def test_from_env_reads_os_environ_by_default(monkeypatch, redis_url, prefix):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match=URL_VAR):
        from_env()
    monkeypatch.setenv(URL_VAR, redis_url)
    monkeypatch.setenv("TASKGUARD_PREFIX", prefix)
    locks = from_env()
    try:
        assert locks.prefix == prefix
        lease = locks.acquire("from-os-environ", ttl=5).lease
        assert lease is not None and lease.release()
    finally:
        locks.close()


def test_the_replica_timeout_margin_applies_only_where_replicas_are_asked_for(redis_url, prefix):
    """A short socket timeout without the durability option is fine (TASKGUARD_REPLICA_TIMEOUT's
    default is never used); with TASKGUARD_REPLICAS the replica timeout must stay 0.5 s below it."""
    base = {URL_VAR: redis_url, "TASKGUARD_PREFIX": prefix, "TASKGUARD_SOCKET_TIMEOUT": "0.5"}
    from_env(base).close()
    with pytest.raises(ConfigError, match="TASKGUARD_REPLICA_TIMEOUT .* by at least 0.5 s"):
        from_env({**base, "TASKGUARD_REPLICAS": "1"})
    from_env(
        {**base, "TASKGUARD_SOCKET_TIMEOUT": "1.0", "TASKGUARD_REPLICAS": "1", "TASKGUARD_REPLICA_TIMEOUT": "0.5"}
    ).close()


def test_a_client_replaces_the_url_and_the_connection_variables(client, prefix):
    environ = {
        "TASKGUARD_PREFIX": prefix,
        "TASKGUARD_DB": "7",
        "TASKGUARD_RETRIES": "3",
        "TASKGUARD_CONNECT_TIMEOUT": "1",
        "TASKGUARD_RENEW_FRACTION": "0.25",
    }
    locks = from_env(environ, client=client)
    assert locks.client is client
    assert locks.prefix == prefix and locks.renew_fraction == 0.25
    lease = locks.acquire("with-client", ttl=5).lease
    assert client.exists("{" + prefix + ":with-client}") == 1  # the given client's database
    assert lease.release()


# -- each malformed variable ---------------------------------------------------------------------

SECONDS_FORM = "number of seconds > 0"
MALFORMED = [
    (URL_VAR, "http://127.0.0.1:6379/0", ACCEPTED_URL),
    (URL_VAR, "", ACCEPTED_URL),
    (URL_VAR, "   ", ACCEPTED_URL),
    (URL_VAR, "127.0.0.1:6379", ACCEPTED_URL),
    (URL_VAR, "redis://", "has no host"),
    (URL_VAR, "redis://127.0.0.1:notaport/0", ACCEPTED_URL),
    (URL_VAR, "redis://127.0.0.1:70000/0", ACCEPTED_URL),
    (URL_VAR, "redis://127.0.0.1:0/0", "1-65535"),
    (URL_VAR, "redis://127.0.0.1:6379/zero", "database number"),
    (URL_VAR, "redis://127.0.0.1:6379/٣", "database number"),
    (URL_VAR, "unix://", "socket path"),
    ("TASKGUARD_PREFIX", "", "1-64 characters of A-Z a-z 0-9 _ - . :"),
    ("TASKGUARD_PREFIX", "two words", "1-64 characters of A-Z a-z 0-9 _ - . :"),
    ("TASKGUARD_PREFIX", "{tag}", "1-64 characters of A-Z a-z 0-9 _ - . :"),
    ("TASKGUARD_PREFIX", "x" * 65, "1-64 characters of A-Z a-z 0-9 _ - . :"),
    ("TASKGUARD_PREFIX", "préfixe", "1-64 characters of A-Z a-z 0-9 _ - . :"),
    ("TASKGUARD_PREFIX", "jobs\n", "1-64 characters of A-Z a-z 0-9 _ - . :"),
    ("TASKGUARD_DB", "-1", "integer from 0 to 100000"),
    ("TASKGUARD_DB", "one", "integer from 0 to 100000"),
    ("TASKGUARD_DB", "1.5", "integer from 0 to 100000"),
    ("TASKGUARD_DB", "100001", "integer from 0 to 100000"),
    ("TASKGUARD_DB", "١", "integer from 0 to 100000"),
    ("TASKGUARD_DB", "²", "integer from 0 to 100000"),
    ("TASKGUARD_DB", "", "integer from 0 to 100000"),
    ("TASKGUARD_RETRIES", "101", "integer from 0 to 100"),
    ("TASKGUARD_RETRIES", "-1", "integer from 0 to 100"),
    ("TASKGUARD_RETRIES", "2.0", "integer from 0 to 100"),
    ("TASKGUARD_RETRIES", "many", "integer from 0 to 100"),
    ("TASKGUARD_RENEW_FRACTION", "0", "(0, 0.5]"),
    ("TASKGUARD_RENEW_FRACTION", "0.51", "(0, 0.5]"),
    ("TASKGUARD_RENEW_FRACTION", "-1", "(0, 0.5]"),
    ("TASKGUARD_RENEW_FRACTION", "1", "(0, 0.5]"),
    ("TASKGUARD_RENEW_FRACTION", "nan", "(0, 0.5]"),
    ("TASKGUARD_RENEW_FRACTION", "1/3", "(0, 0.5]"),
    # a digit string longer than Python's int() limit (4300 digits) must still be a ConfigError
    # (config.py's _int_range calls int() on it unguarded: a plain ValueError escapes)
    ("TASKGUARD_DB", "1" * 5000, "integer from 0 to 100000"),
    ("TASKGUARD_RETRIES", "9" * 4301, "integer from 0 to 100"),
    # a URL that passes check_url but that redis-py refuses must be named too (from_url says
    # "cannot build a Redis client from ...: ValueError", naming neither the variable nor the form)
    (URL_VAR, "redis://127.0.0.1:6379/0?socket_timeout=abc", ACCEPTED_URL),
    (URL_VAR, "sentinel://127.0.0.1:26379;redis://127.0.0.1:6379", ACCEPTED_URL),
    ("TASKGUARD_SENTINEL_MASTER", "my master", "the name Sentinel monitors"),
    ("TASKGUARD_SENTINEL_MASTER", "", "the name Sentinel monitors"),
    ("TASKGUARD_SENTINEL_PASSWORD", "", "is set but empty"),
    ("TASKGUARD_REPLICAS", "17", "integer from 0 to 16"),
    ("TASKGUARD_REPLICAS", "-1", "integer from 0 to 16"),
    ("TASKGUARD_REPLICA_TIMEOUT", "0", "at most 60"),
    ("TASKGUARD_REPLICA_TIMEOUT", "61", "at most 60"),
] + [
    (var, raw, SECONDS_FORM)
    for var in ("TASKGUARD_CONNECT_TIMEOUT", "TASKGUARD_SOCKET_TIMEOUT", "TASKGUARD_SHUTDOWN_TIMEOUT")
    # "1e10": above the 1e9 s cap of check_seconds, which config.py's _seconds does not apply, so
    # the error comes from from_url and names "connect_timeout" instead of the variable
    for raw in ("0", "-1", "-0.5", "five", "nan", "inf", "-inf", "", "5s", "1e10")
]


def _id(var: str, raw: str) -> str:
    return f"{var}={raw!r}" if len(raw) <= 40 else f"{var}={raw[:10]!r}...({len(raw)} chars)"


@pytest.mark.parametrize("var,raw,form", MALFORMED, ids=[_id(v, r) for v, r, _ in MALFORMED])
def test_each_malformed_variable_is_a_config_error_naming_it_and_the_accepted_form(redis_url, var, raw, form):
    environ = {**_base(var, redis_url), var: raw}
    with pytest.raises(ConfigError) as info:
        from_env(environ)
    msg = str(info.value)
    assert var in msg
    assert form in msg
    if var != URL_VAR:  # shows what it got (these values are not secret), long ones shortened
        assert repr(raw) in msg if len(raw) <= 40 else repr(raw[:37] + "...") in msg


def test_every_documented_variable_is_checked():
    """The table in taskguard/config.py and the parsers cover the same variables."""
    assert set(ENV_VARS) == {
        URL_VAR,
        "TASKGUARD_PREFIX",
        "TASKGUARD_DB",
        "TASKGUARD_CONNECT_TIMEOUT",
        "TASKGUARD_SOCKET_TIMEOUT",
        "TASKGUARD_RETRIES",
        "TASKGUARD_SHUTDOWN_TIMEOUT",
        "TASKGUARD_RENEW_FRACTION",
        "TASKGUARD_SENTINEL_MASTER",
        "TASKGUARD_SENTINEL_PASSWORD",
        "TASKGUARD_REPLICAS",
        "TASKGUARD_REPLICA_TIMEOUT",
    }
    covered = {var for var, _, _ in MALFORMED}
    assert covered == set(ENV_VARS)


# -- passwords never appear in errors ------------------------------------------------------------

URLS_WITH_PASSWORD = [
    f"redis://user:{PASSWORD}@host:notaport/0",
    f"redis://user:{PASSWORD}@host:99999/0",
    f"redis://user:{PASSWORD}@host:0/0",
    f"redis://user:{PASSWORD}@host/notadb",
    f"redis://:{PASSWORD}@/0",
    f"redis://user:{PASSWORD}@[::1/0",
    f"http://user:{PASSWORD}@host/0",
    f"REDIS://user:{PASSWORD}@host:notaport/0",
    f"rediss://user:{PASSWORD}@host:70000/0",
    f"unix://user:{PASSWORD}@",
    f"redis://{PASSWORD}@host:bad/0",  # a lone userinfo is a password for redis-py < 6 servers
    f"redis://user:p@ss:{PASSWORD}@host:bad/0",
    f"redis://user:{PASSWORD}@host/0?socket_timeout=abc",  # fails inside redis-py
    f"redis://user:{PASSWORD}@host/0?health_check_interval=x",
    f" redis://user:{PASSWORD}@host:x",
    f"redis://host/x?password={PASSWORD}",  # redis-py reads ?password= too
    f"redis://host:0/0?username=u&password={PASSWORD}",
    # without "//" (or with "///") the userinfo is not a netloc, and redact_url shows the URL
    # unmasked: "the URL has no host ..., got 'redis:user:s3cr3tPW@host/0'"
    f"redis:user:{PASSWORD}@host/0",
    f"redis:///user:{PASSWORD}@host/0",
]


@pytest.mark.parametrize("url", URLS_WITH_PASSWORD)
def test_a_bad_url_error_never_shows_its_password(url):
    with pytest.raises(ConfigError) as from_env_info:
        from_env({URL_VAR: url})
    with pytest.raises(ConfigError) as from_url_info:
        RedisLocks.from_url(url)
    for info in (from_env_info, from_url_info):
        text = _error_text(info.value)
        assert PASSWORD not in text, text
        # the URL is still recognisable: shown with its password masked, or as unparseable
        assert "***" in str(info.value) or "<unparseable URL>" in str(info.value), str(info.value)


def test_a_good_url_with_a_password_keeps_it_for_the_client(redis_url):
    """Redaction is for display only: the client gets the real password."""
    parts = urlsplit(redis_url)
    url = f"{parts.scheme}://someone:{PASSWORD}@{parts.hostname}:{parts.port or 6379}/0"
    locks = from_env({URL_VAR: url})
    try:
        assert locks.client.connection_pool.connection_kwargs["password"] == PASSWORD
        assert PASSWORD not in repr(locks)
    finally:
        locks.close()


# -- from_url options ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "option,value,name",
    [
        ("connect_timeout", 0, "connect_timeout"),
        ("connect_timeout", -1.0, "connect_timeout"),
        ("socket_timeout", math.nan, "socket_timeout"),
        ("socket_timeout", math.inf, "socket_timeout"),
        ("socket_timeout", True, "socket_timeout"),
        ("connect_timeout", "5", "connect_timeout"),
        ("retries", -1, "retries"),
        ("retries", 1.5, "retries"),
        ("retries", True, "retries"),
        ("prefix", "has space", "prefix"),
        ("prefix", "{x}", "prefix"),
        ("prefix", "", "prefix"),
        ("poll_interval", 0, "poll_interval"),
        ("fence_idle_ttl", -5, "fence_idle_ttl"),
        ("shutdown_timeout", math.nan, "shutdown_timeout"),
        ("max_hold", 0, "max_hold"),
    ],
)
def test_from_url_rejects_bad_options_naming_them(redis_url, option, value, name):
    with pytest.raises(ConfigError, match=name):
        RedisLocks.from_url(redis_url, **{option: value})


@pytest.mark.parametrize("prefix", ["my/app", "x" * 65, "\u00e9", "a b", "{x}", "", 5])
def test_one_prefix_rule_in_code_environment_celery_and_cli(redis_url, prefix):
    """A prefix the CLI, ``TASKGUARD_PREFIX`` or ``app.conf.taskguard_prefix`` would refuse is
    refused in code too (else leases taken from code could not be listed or released with the
    CLI), with the same rule and message; and one they all take works everywhere."""
    from click.testing import CliRunner

    from taskguard.cli import main

    builds = [lambda: RedisLocks.from_url(redis_url, prefix=prefix), lambda: MemoryLocks(prefix=prefix)]
    if isinstance(prefix, str):  # environment values are strings
        builds.append(lambda: from_env({URL_VAR: redis_url, "TASKGUARD_PREFIX": prefix}))
    for build in builds:
        with pytest.raises(ConfigError, match="1-64 characters of A-Z a-z 0-9 _ - . :"):
            build()
    if isinstance(prefix, str) and prefix:
        out = CliRunner().invoke(main, ["leases", "--url", redis_url, "--prefix", prefix])
        assert out.exit_code != 0 and "1-64 characters" in out.output


def test_a_prefix_every_entry_point_takes(redis_url):
    ok = "my-app.v2:leases_" + "x" * 47
    assert len(ok) == 64
    assert RedisLocks.from_url(redis_url, prefix=ok).prefix == ok == MemoryLocks(prefix=ok).prefix
    assert from_env({URL_VAR: redis_url, "TASKGUARD_PREFIX": ok}).prefix == ok


def test_from_url_rejects_a_non_string_url():
    for url in (None, 6379, b"redis://127.0.0.1:6379/0"):
        with pytest.raises(ConfigError, match="url"):
            RedisLocks.from_url(url)


def test_redis_locks_needs_a_redis_client():
    for client in (None, object(), "redis://127.0.0.1:6379/0"):
        with pytest.raises(ConfigError, match="client"):
            RedisLocks(client)


# -- renew_fraction in (0, 0.5] ---------------------------------------------------------------------

BAD_FRACTIONS = [0, 0.0, 0.51, -1, 1, 0.5000001, math.nan, math.inf, True, "0.3", None]


@pytest.mark.parametrize("fraction", BAD_FRACTIONS, ids=repr)
def test_renew_fraction_outside_zero_half_is_rejected_as_an_option(client, fraction):
    with pytest.raises(ConfigError, match=r"renew_fraction must be a number in \(0, 0\.5\]"):
        RedisLocks(client, renew_fraction=fraction)
    with pytest.raises(ConfigError, match="renew_fraction"):
        MemoryLocks(renew_fraction=fraction)


@pytest.mark.parametrize("raw", ["0", "0.51", "-1", "1", "0.50001", "-0.25"])
def test_renew_fraction_outside_zero_half_is_rejected_as_a_variable(redis_url, raw):
    with pytest.raises(ConfigError) as info:
        from_env({URL_VAR: redis_url, "TASKGUARD_RENEW_FRACTION": raw})
    assert "TASKGUARD_RENEW_FRACTION" in str(info.value) and "(0, 0.5]" in str(info.value)


def test_renew_fraction_bounds_that_are_accepted(client, redis_url):
    for value in (0.5, 1 / 3, 0.01, 1e-9):
        assert RedisLocks(client, renew_fraction=value).renew_fraction == value
        assert MemoryLocks(renew_fraction=value).renew_fraction == value
    for raw, value in (("0.5", 0.5), (" 0.25 ", 0.25), ("5e-1", 0.5)):
        locks = from_env({URL_VAR: redis_url, "TASKGUARD_RENEW_FRACTION": raw})
        assert locks.renew_fraction == value
        locks.close()
    # an explicit option wins over the variable, and is validated too
    locks = from_env({URL_VAR: redis_url, "TASKGUARD_RENEW_FRACTION": "0.1"}, renew_fraction=0.5)
    assert locks.renew_fraction == 0.5
    locks.close()
    with pytest.raises(ConfigError, match="renew_fraction"):
        from_env({URL_VAR: redis_url, "TASKGUARD_RENEW_FRACTION": "0.1"}, renew_fraction=0.51)


# -- TTLs --------------------------------------------------------------------------------------------

#: Not positive, not finite, not a number, or longer than the 1e9 s cap (Redis's PEXPIRE range
#: is far larger, but a TTL Redis refuses would leave a lease without expiry).
BAD_TTLS = [
    0,
    0.0,
    -0.0,
    -1,
    -0.001,
    math.nan,
    math.inf,
    -math.inf,
    True,
    False,
    "5",
    None,
    [5],
    1e9 + 1,
    1e300,
    10**400,
    2**63,
]


@pytest.fixture(params=["redis", "memory"])
def any_locks(request, redis_url, prefix):
    if request.param == "redis":
        locks = from_env({URL_VAR: redis_url, "TASKGUARD_PREFIX": prefix})
        yield locks
        locks.close()
    else:
        yield MemoryLocks(prefix=prefix)


@pytest.mark.parametrize("ttl", BAD_TTLS, ids=repr)
def test_a_bad_ttl_is_a_config_error_and_touches_nothing(any_locks, client, ttl):
    with pytest.raises(ConfigError, match="ttl") as info:
        any_locks.acquire("bad-ttl", ttl=ttl)
    assert "seconds" in str(info.value)
    assert any_locks.holder("bad-ttl") is None
    assert client.exists("{" + any_locks.prefix + ":bad-ttl}") == 0
    # the same check guards every operation that takes a TTL
    lease = any_locks.acquire("bad-ttl", ttl=5).lease
    if ttl is not None:  # renew(None) means "the lease's own TTL"
        with pytest.raises(ConfigError, match="ttl"):
            lease.renew(ttl)
    with pytest.raises(ConfigError, match="ttl"):
        any_locks.claim("bad-ttl", lease.owner_token, ttl=ttl)
    with pytest.raises(ConfigError, match="ttl"):
        any_locks.restore("bad-ttl", lease.owner_token, ttl=ttl)
    with pytest.raises(ConfigError, match="ttl"):
        any_locks.with_lease("other", lambda lease: None, ttl=ttl)
    # ... and none of them disturbed the lease
    assert lease.renew() and lease.release()


def test_small_large_and_integer_ttls_are_accepted(any_locks):
    for i, ttl in enumerate((1, 0.1, 2**20, 10**9, 1e9)):
        lease = any_locks.acquire(f"good-ttl-{i}", ttl=ttl).lease
        assert lease is not None and lease.ttl == float(ttl)
        lease.release()  # the 100 ms lease may be gone already


# -- a valid environment -----------------------------------------------------------------------------


def test_a_valid_environment_builds_working_redis_locks(redis_url, prefix, client):
    environ = {
        URL_VAR: redis_url,
        "TASKGUARD_PREFIX": prefix,
        "TASKGUARD_CONNECT_TIMEOUT": "2.5",
        "TASKGUARD_SOCKET_TIMEOUT": " 3 ",
        "TASKGUARD_RETRIES": "4",
        "TASKGUARD_SHUTDOWN_TIMEOUT": "1.5",
        "TASKGUARD_RENEW_FRACTION": "0.25",
        "UNRELATED": "ignored",
    }
    locks = from_env(environ)
    try:
        assert isinstance(locks, RedisLocks)
        assert locks.prefix == prefix
        assert locks.renew_fraction == 0.25
        assert locks.shutdown_timeout == 1.5
        kwargs = locks.client.connection_pool.connection_kwargs
        assert kwargs["socket_connect_timeout"] == 2.5 and kwargs["socket_timeout"] == 3.0
        assert locks.client.get_retry()._retries == 4
        assert locks.check_health().ok

        acq = locks.acquire("job", ttl=5, holder={"task": "t"})
        assert acq.acquired
        stored = client.hgetall("{" + prefix + ":job}")
        assert stored[b"o"].decode() == acq.lease.owner_token  # under the configured prefix
        assert not locks.acquire("job", ttl=5).acquired
        assert locks.holder("job").holder["task"] == "t"
        assert acq.lease.release()
        assert locks.holder("job") is None
        assert locks.acquire("job", ttl=5).lease.release()
    finally:
        locks.close()


def test_taskguard_db_selects_the_database_of_a_url_without_one(redis_url):
    """TASKGUARD_DB picks the database of a URL that names none (for one that does, see
    test_taskguard_db_overrides_the_database_named_in_the_url)."""
    prefix = f"tgdb-{uuid.uuid4().hex[:12]}"
    db3 = redis.Redis.from_url(_without_db(redis_url), db=3)
    locks = from_env({URL_VAR: _without_db(redis_url), "TASKGUARD_DB": "3", "TASKGUARD_PREFIX": prefix})
    try:
        assert locks.client.connection_pool.connection_kwargs["db"] == 3
        lease = locks.acquire("in-db-3", ttl=5).lease
        assert db3.exists("{" + prefix + ":in-db-3}") == 1
        assert lease.release()
    finally:
        locks.close()
        _delete_prefix(db3, prefix)
        db3.close()


def test_taskguard_db_overrides_the_database_named_in_the_url(redis_url):
    """Documented in taskguard/config.py: TASKGUARD_DB "overrides the URL's database". At the time
    of writing it does not: redis-py's from_url lets the URL's /0 win over the db keyword, so the
    leases silently go to database 0 (RedisLocks.from_url(url, db=3) has the same problem)."""
    prefix = f"tgdb-{uuid.uuid4().hex[:12]}"
    url = _without_db(redis_url) + "/0"
    db3 = redis.Redis.from_url(_without_db(redis_url), db=3)
    db0 = redis.Redis.from_url(_without_db(redis_url), db=0)
    locks = from_env({URL_VAR: url, "TASKGUARD_DB": "3", "TASKGUARD_PREFIX": prefix})
    try:
        lease = locks.acquire("override", ttl=5).lease
        in_db0 = db0.exists("{" + prefix + ":override}")
        lease.release()
        assert locks.client.connection_pool.connection_kwargs["db"] == 3
        assert in_db0 == 0
    finally:
        locks.close()
        for c in (db3, db0):
            _delete_prefix(c, prefix)
            c.close()


def test_an_unknown_url_option_is_a_config_error_not_a_type_error_later(redis_url, prefix):
    """An option redis-py does not know in the URL's query is an invalid URL: a ConfigError at
    construction (or at the latest a TaskguardError). At the time of writing, ``?no_such_option=1``
    passes from_env (check_url ignores the query and redis-py only stores it), and the first
    acquire raises TypeError from inside redis-py (``AbstractConnection.__init__() got an
    unexpected keyword argument``)."""
    url = redis_url + "?no_such_option=1"
    try:
        locks = from_env({URL_VAR: url, "TASKGUARD_PREFIX": prefix})
    except ConfigError as e:
        assert URL_VAR in str(e)
        return
    try:
        with pytest.raises((ConfigError, TaskguardError)):
            locks.acquire("unknown-option", ttl=5)
    finally:
        locks.close()


# -- property: arbitrary text is a ConfigError or works, never anything else --------------------------

#: Arbitrary text, including weird unicode and lone surrogates (os.environ can hold those), and
#: near-misses of valid values.
ANY_TEXT = st.one_of(
    st.text(),
    st.text(st.characters(exclude_categories=())),
    st.integers(-10, 10**6).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.from_regex(r"[A-Za-z0-9_.:\-]{1,70}", fullmatch=True),
    st.builds(
        lambda host, port, db: f"redis://{host}:{port}/{db}",
        st.from_regex(r"[a-z0-9.]{1,12}", fullmatch=True),
        st.integers(-1, 70000),
        st.one_of(st.integers(0, 15).map(str), st.text(max_size=3)),
    ),
)


_SECONDS = st.one_of(st.integers(1, 1000).map(str), st.floats(1e-6, 1e6).map(str))
#: Values each variable accepts, mixed in so that the success branch is exercised too.
VALID = {
    URL_VAR: st.sampled_from(
        [
            "redis://127.0.0.1:6379/0",
            "rediss://cache.internal:6380/15",
            "unix:///tmp/r.sock",
            "redis://user:pw@10.0.0.1",
            "redis://[::1]:6379",
        ]
    ),
    "TASKGUARD_PREFIX": st.from_regex(r"[A-Za-z0-9_.:\-]{1,64}", fullmatch=True),
    "TASKGUARD_DB": st.integers(0, 100000).map(str),
    "TASKGUARD_CONNECT_TIMEOUT": _SECONDS,
    "TASKGUARD_SOCKET_TIMEOUT": _SECONDS,
    "TASKGUARD_RETRIES": st.integers(0, 100).map(str),
    "TASKGUARD_SHUTDOWN_TIMEOUT": _SECONDS,
    "TASKGUARD_RENEW_FRACTION": st.floats(1e-9, 0.5).map(str),
    "TASKGUARD_SENTINEL_MASTER": st.from_regex(r"[A-Za-z0-9_.\-]{1,30}", fullmatch=True),
    "TASKGUARD_SENTINEL_PASSWORD": st.text(min_size=1),
    "TASKGUARD_REPLICAS": st.integers(0, 16).map(str),
    "TASKGUARD_REPLICA_TIMEOUT": st.one_of(st.sampled_from(["0.05", "0.1", "1", "2.5"]), st.floats(1e-3, 4.9).map(str)),
}
#: The variables that only go with a sentinel:// URL (and the master name that URL needs).
SENTINEL_VARS = {"TASKGUARD_SENTINEL_MASTER", "TASKGUARD_SENTINEL_PASSWORD"}
SENTINEL_ENV = {URL_VAR: "sentinel://127.0.0.1:26379;sentinel://127.0.0.1:26380", "TASKGUARD_SENTINEL_MASTER": "tgm"}


def _base(var, redis_url):
    """A good environment beside ``var``: a sentinel:// URL and its master name for the Sentinel
    variables, else the suite's Redis URL."""
    return dict(SENTINEL_ENV) if var in SENTINEL_VARS else {URL_VAR: redis_url}


def _outcome(environ):
    """'ok' or the ConfigError; any other exception propagates and fails the test."""
    try:
        locks = from_env(environ)
    except ConfigError as e:
        return e
    locks.close()
    return "ok"


def test_any_text_in_one_variable_is_a_config_error_or_works(redis_url):
    seen: dict[str, set] = {var: set() for var in ENV_VARS}

    @PROPERTY
    @given(var=st.sampled_from(sorted(ENV_VARS)), data=st.data())
    def check(var, data):
        raw = data.draw(st.one_of(ANY_TEXT, VALID[var]), label="raw")
        out = _outcome({**_base(var, redis_url), var: raw})
        seen[var].add("ok" if out == "ok" else "error")

    check()
    for var, outcomes in seen.items():  # the property was exercised both ways for every variable
        assert outcomes == {"ok", "error"}, (var, outcomes)


def test_any_text_in_one_variable_that_is_refused_is_named_in_the_error(redis_url):
    """The same inputs: when the only variable set besides a good URL is refused, the error
    names it. (At the time of writing, a timeout above 1e9 s, e.g. "1000000001", passes
    config.py's _seconds and is refused later by check_seconds as "connect_timeout ...".)"""

    @PROPERTY
    @given(var=st.sampled_from(sorted(ENV_VARS)), data=st.data())
    def check(var, data):
        raw = data.draw(st.one_of(ANY_TEXT, VALID[var]), label="raw")
        out = _outcome({**_base(var, redis_url), var: raw})
        if out != "ok":
            assert var in str(out), (var, raw, str(out))

    check()


def test_any_combination_of_variables_is_a_config_error_or_works(redis_url):
    seen = set()

    @PROPERTY
    @given(chosen=st.sets(st.sampled_from(sorted(ENV_VARS))), with_url=st.booleans(), data=st.data())
    def check(chosen, with_url, data):
        environ = {var: data.draw(st.one_of(ANY_TEXT, VALID[var]), label=var) for var in sorted(chosen)}
        if with_url and URL_VAR not in environ:
            environ = {**environ, URL_VAR: redis_url}
        out = _outcome(environ)
        seen.add("ok" if out == "ok" else "error")
        if out != "ok":
            # the error names a variable that was set, or the missing TASKGUARD_REDIS_URL
            candidates = set(environ) | {URL_VAR}
            assert any(var in str(out) for var in candidates), (environ, str(out))
            if URL_VAR not in environ and not any(var in str(out) for var in environ):
                assert "is not set" in str(out)

    check()
    assert seen == {"ok", "error"}


def test_property_a_url_password_never_appears_in_an_error():
    seen = set()

    @PROPERTY
    @given(
        scheme=st.sampled_from(["redis", "rediss", "unix", "http", "REDIS", "redis+sentinel", "sentinel"]),
        user=st.sampled_from(["u", "", "default"]),
        # alphanumeric, >= 6 characters; the "Q9" start keeps it from matching fixed message text
        # by chance (hypothesis readily tries passwords like "prefix" or "password")
        password=st.text(string.ascii_letters + string.digits, min_size=6, max_size=24).map(lambda s: "Q9" + s),
        junk=st.one_of(
            st.text(),
            st.text(st.characters(exclude_categories=())),
            st.from_regex(r"[a-z.]{0,8}(:[0-9a-z]{0,6})?(/[0-9a-z]{0,3})?(\?[a-z_=]{0,20})?", fullmatch=True),
        ),
    )
    def check(scheme, user, password, junk):
        assume(password not in junk and password not in scheme and password not in user)
        url = f"{scheme}://{user}:{password}@{junk}"
        for build in (lambda: from_env({URL_VAR: url}), lambda: RedisLocks.from_url(url)):
            try:
                locks = build()
            except ConfigError as e:
                seen.add("error")
                assert password not in _error_text(e), (url, str(e))
            else:
                seen.add("ok")
                assert password not in repr(locks)
                locks.close()

    check()
    assert seen == {"ok", "error"}


# -- key templates bind exactly as Signature.bind does --------------------------------------------------
def _sig_a(a, b=2, *, c, d=4):
    pass


def _sig_b(a, b, c=3):
    pass


def _sig_c(x, *rest, **extra):
    pass


def _sig_d(p, /, q=1):
    pass


@settings(max_examples=400, deadline=None)
@given(
    fn=st.sampled_from([_sig_a, _sig_b, _sig_c, _sig_d]),
    nargs=st.integers(0, 4),
    names=st.lists(st.sampled_from(["a", "b", "c", "d", "p", "q", "x", "zz"]), unique=True),
)
def test_key_template_binds_like_signature_bind(fn, nargs, names):
    """KeyTemplate's fast binding (common signatures) and its Signature.bind fallback agree with
    inspect's own binding on every call: same values with defaults, an error where it errs."""
    import inspect

    from taskguard.keys import KeyTemplate

    args = tuple(range(nargs))
    kwargs = {n: f"v-{n}" for n in names}
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
        bound.apply_defaults()
        expected = dict(bound.arguments)
        expected.update(expected.pop("extra", {}))  # **kwargs come back flattened
    except TypeError:
        expected = "error"
    try:
        got = KeyTemplate("fixed", fn).bind(args, kwargs)
    except TypeError:  # a caller's wrong arguments keep Python's own error type
        got = "error"
    assert got == expected


# -- the TTL floor: a lease that could expire before its first renewal guards nothing ------------------


@pytest.mark.parametrize("ttl", [0.001, 0.05, 0.0999])
def test_a_ttl_below_the_floor_is_refused_everywhere(any_locks, ttl):
    from taskguard.validate import MIN_TTL

    with pytest.raises(ConfigError, match=f">= {MIN_TTL:g}"):
        any_locks.acquire("floor", ttl=ttl)
    lease = any_locks.acquire("floor", ttl=MIN_TTL).lease  # the floor itself is accepted
    with pytest.raises(ConfigError, match="ttl"):
        lease.renew(ttl)
    with pytest.raises(ConfigError, match="ttl"):
        any_locks.claim("floor", lease.owner_token, ttl=ttl)
    with pytest.raises(ConfigError, match="ttl"):
        any_locks.restore("floor", lease.owner_token, ttl=ttl)
    lease.release()


def test_a_ttl_below_the_floor_fails_task_and_job_declarations_and_beat_entries():
    from taskguard_celery import guarded_task
    from taskguard_celery.beat import validate_entry_options
    from taskguard_rq import guarded_job

    with pytest.raises(ConfigError, match="ttl"):
        guarded_task(ttl=0.001)(lambda: None)
    with pytest.raises(ConfigError, match="ttl"):
        guarded_job(ttl=0.001)(lambda: None)
    with pytest.raises(ConfigError, match="beat entry 'e'.*ttl"):
        validate_entry_options("e", {"ttl": 0.001})


def test_a_url_redis_py_refuses_is_refused_at_check_time_without_its_password():
    from taskguard.urls import check_url

    with pytest.raises(ConfigError) as err:
        check_url("redis://:s3cret-pw@127.0.0.1:6379/0?socket_timeout=abc", "TASKGUARD_REDIS_URL")
    text = str(err.value)
    assert "TASKGUARD_REDIS_URL" in text and "socket_timeout" in text and "s3cret-pw" not in text


@pytest.mark.parametrize(
    "url, says",
    [
        ("redis://127.0.0.1:notaport/0", "got 'redis://127.0.0.1:notaport/0': the port 'notaport' is not a number"),
        ("redis://:s3cretPW@127.0.0.1:notaport/0", "got 'redis://***@127.0.0.1:notaport/0': the port 'notaport'"),
        ("redis://:s3/cret@PW@host:x/0", "got 'redis://***@host:x/0': the port 'x' is not a number"),
        ("redis://127.0.0.1:99999/0", "the port must be 1-65535"),
        ("127.0.0.1:6379", "unknown scheme (missing 'redis://'?)"),
    ],
)
def test_a_bad_url_says_what_is_wrong_without_its_password(url, says):
    with pytest.raises(ConfigError) as err:
        RedisLocks.from_url(url)
    assert says in str(err.value)
    assert "s3" not in str(err.value) and "cret" not in str(err.value)
