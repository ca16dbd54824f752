"""The ``taskguard`` command: ``doctor``, ``leases``, ``release``, ``metrics``, ``rq-cron``.

Every command takes ``--url`` (default: ``TASKGUARD_REDIS_URL``) and ``--prefix`` (default:
``TASKGUARD_PREFIX`` or ``taskguard``), and ``--json`` for scripts. Owner tokens are never shown.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import time
from typing import Any

import click
import redis

from . import __version__
from .config import ENV_VARS, EX_CONFIG, parse_prefix, read_env
from .errors import ConfigError, LeaseBackendError
from .extras import missing_extra
from .redis_locks import RedisLocks
from .urls import check_url, redacted

__all__ = ["main", "doctor_checks"]


def _source(option: str, var: str) -> str:
    """How to name an option's value in errors: ``--url`` when given on the command line, else
    the environment variable it came from."""
    ctx = click.get_current_context(silent=True)
    src = ctx.get_parameter_source(option) if ctx is not None else None
    return var if src is click.core.ParameterSource.ENVIRONMENT else f"--{option}"


#: A command's connection settings where no variable sets them: quick to fail (a command is run by
#: hand), the socket timeout long enough for the durability option's wait (``replica_timeout``).
CLI_CONNECT_TIMEOUT = CLI_SOCKET_TIMEOUT = 2.0
CLI_RETRIES = 0


def _locks(url: str | None, prefix: str | None) -> RedisLocks:
    """The locks object for a command: ``--url`` / ``--prefix`` (or their variables) plus the
    other ``TASKGUARD_*`` variables, as a worker reads them (the connection settings a variable
    does not set: :data:`CLI_CONNECT_TIMEOUT`, :data:`CLI_SOCKET_TIMEOUT`, :data:`CLI_RETRIES`).
    A bad value is a usage error naming where it came from."""
    try:
        if url is None and os.environ.get("TASKGUARD_REDIS_URL") == "":  # (click takes it for unset)
            raise ConfigError("TASKGUARD_REDIS_URL is set but empty: set it to a Redis URL (redis://host:6379/0)")
        if url is None:
            raise ConfigError("no Redis URL: pass --url redis://host:6379/0 or set TASKGUARD_REDIS_URL")
        url = check_url(url, _source("url", "TASKGUARD_REDIS_URL"))
        opts = read_env({k: v for k, v in os.environ.items() if k not in ("TASKGUARD_REDIS_URL", "TASKGUARD_PREFIX")})
        if prefix is None and os.environ.get("TASKGUARD_PREFIX") == "":
            # (click takes an empty variable for an unset one: refused, as from_env() does)
            opts["prefix"] = parse_prefix("TASKGUARD_PREFIX", "")
        if prefix is not None:
            opts["prefix"] = parse_prefix(_source("prefix", "TASKGUARD_PREFIX"), prefix)
        opts.setdefault("connect_timeout", CLI_CONNECT_TIMEOUT)
        opts.setdefault("socket_timeout", max(CLI_SOCKET_TIMEOUT, (opts.get("replica_timeout") or 0.0) + 1.0))
        opts.setdefault("retries", CLI_RETRIES)
        try:
            return RedisLocks.from_url(url, **opts)
        except ConfigError as e:
            raise ConfigError(f"{_culprit(str(e))}: {e}") from None
    except ConfigError as e:
        raise click.UsageError(str(e)) from None


def _culprit(message: str) -> str:
    """Where the settings an error message names came from: the ``TASKGUARD_*`` variables that
    set them (``replica_timeout`` against ``socket_timeout``: both), else the URL's source."""
    named = [var for var, (opt, _) in ENV_VARS.items() if re.search(rf"\b{opt}\b", message) and var in os.environ]
    return " / ".join(named) or _source("url", "TASKGUARD_REDIS_URL")


def _info(client: Any, section: str) -> dict[str, Any]:
    info: dict[str, Any] = client.info(section)
    return info


def doctor_checks(locks: RedisLocks) -> list[dict[str, Any]]:
    """Deployment checks (design: single primary, noeviction, persistence). Each is
    ``{"name", "status": "ok" | "warn" | "fail", "detail"}``."""
    c = locks.client
    checks: list[dict[str, Any]] = []

    def add(name: str, status: str, detail: str) -> None:
        checks.append({"name": name, "status": status, "detail": detail})

    health = locks.check_health()
    if not health.ok:
        add("reachable", "fail", health.detail)
        return checks
    add("reachable", "ok", "PING answered")
    try:
        server = _info(c, "server")
        version = str(server.get("redis_version", "?"))
        major_minor = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
        add(
            "server version",
            "ok" if major_minor >= (6, 2) else "warn",
            f"Redis {version}" + ("" if major_minor >= (6, 2) else " (6.2 or newer is what taskguard is tested on)"),
        )
        try:
            policy = c.config_get("maxmemory-policy").get("maxmemory-policy")
            add(
                "maxmemory-policy",
                "ok" if policy == "noeviction" else "fail",
                f"{policy}"
                + (
                    ""
                    if policy == "noeviction"
                    else ": must be noeviction (leases carry TTLs, so volatile-* policies evict them first)"
                ),
            )
        except redis.ResponseError as e:
            add("maxmemory-policy", "warn", f"cannot read it (CONFIG disabled?): {e}")
        persistence = _info(c, "persistence")
        aof = bool(persistence.get("aof_enabled"))
        try:
            save = c.config_get("save").get("save") or ""
        except redis.ResponseError:
            save = ""
        if aof or save.strip():
            add(
                "persistence",
                "ok",
                ("appendonly" if aof else "")
                + (" + " if aof and save.strip() else "")
                + (f"RDB save '{save}'" if save.strip() else ""),
            )
        else:
            add(
                "persistence",
                "fail",
                "off: a restart forgets every lease (fencing tokens still grow by the "
                "server-clock floor); enable appendonly",
            )
        cluster = _info(c, "cluster").get("cluster_enabled")
        add("cluster", "ok", "Redis Cluster" if cluster else "standalone")
        replication = _info(c, "replication")
        role = replication.get("role")
        add(
            "role",
            "ok" if role == "master" else "fail",
            f"{role}" + ("" if role == "master" else ": leases must be written to a primary"),
        )
        if role == "master" and not cluster:
            _replica_checks(locks, replication, add)
        samples = []
        for _ in range(20):
            t0 = time.perf_counter()
            c.ping()
            samples.append(time.perf_counter() - t0)
        median_ms = statistics.median(samples) * 1000
        add("latency", "ok" if median_ms < 5 else "warn", f"median PING round trip {median_ms:.2f} ms")
    except redis.RedisError as e:
        add("inspection", "fail", f"{type(e).__name__}: {e}")
    return checks


def _replica_checks(locks: RedisLocks, replication: dict[str, Any], add: Any) -> None:
    """The connected replicas (``INFO replication``) and whether the durability option
    (``replicas=``) can be met: a probe key (1 s TTL) written and ``WAIT`` ed for on one
    connection, as an acquisition does."""
    connected = int(replication.get("connected_slaves", 0) or 0)
    online = sum(
        1
        for k, v in replication.items()
        if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online"
    )
    want, timeout = locks.replicas, locks.replica_timeout
    add(
        "replicas",
        "ok" if connected else "warn",
        f"{connected} connected ({online} online)"
        + ("" if connected else ": a failover loses every lease; nothing to promote either"),
    )
    if want == 0:
        add(
            "durability",
            "ok" if not connected else "warn",
            "replicas=0: acquisitions do not wait for replicas"
            + (", so a failover may lose a lease just taken (set TASKGUARD_REPLICAS=1)" if connected else ""),
        )
        return
    pipe = locks.client.pipeline(transaction=False)
    pipe.set(f"{{{locks.prefix}:doctor}}:wait-probe", "1", px=1000)
    pipe.execute_command("WAIT", want, max(1, round(timeout * 1000)))
    started = time.perf_counter()
    acked = int(pipe.execute()[1])
    took_ms = (time.perf_counter() - started) * 1000
    if acked >= want:
        add("durability", "ok", f"replicas={want} met: {acked} acknowledged a probe write in {took_ms:.1f} ms")
    else:
        add(
            "durability",
            "fail",
            f"replicas={want} cannot be met: {acked} of {connected} connected replicas acknowledged a probe write "
            f"within replica_timeout={timeout} s, so every acquisition is refused (reason 'unreplicated')",
        )


@click.group()
@click.version_option(__version__, prog_name="taskguard")
def main() -> None:
    """Inspect and operate taskguard leases in Redis."""


_url = click.option("--url", envvar="TASKGUARD_REDIS_URL", help="Redis URL (default: $TASKGUARD_REDIS_URL).")
_prefix = click.option(
    "--prefix", envvar="TASKGUARD_PREFIX", help="Key prefix (default: $TASKGUARD_PREFIX or taskguard)."
)
_json = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


@main.command()
@_url
@_prefix
@_json
@click.option("--strict", is_flag=True, help="Treat warnings as failures.")
def doctor(url: str | None, prefix: str | None, as_json: bool, strict: bool) -> None:
    """Check the Redis that holds the leases: reachable, version, noeviction, persistence,
    primary, cluster or not, connected replicas and whether TASKGUARD_REPLICAS can be met,
    round-trip latency. Exits 1 when a check fails."""
    locks = _locks(url, prefix)
    checks = doctor_checks(locks)
    bad = [c for c in checks if c["status"] == "fail" or (strict and c["status"] == "warn")]
    if as_json:
        click.echo(json.dumps({"url": redacted(url or ""), "ok": not bad, "checks": checks}, indent=2))
    else:
        for c in checks:
            mark = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}[c["status"]]
            click.echo(f"{mark} {c['name']}: {c['detail']}")
        click.echo("doctor: " + ("all checks passed" if not bad else f"{len(bad)} check(s) failed"))
    sys.exit(1 if bad else 0)


@main.command()
@_url
@_prefix
@_json
@click.argument("pattern", default="*")
def leases(url: str | None, prefix: str | None, as_json: bool, pattern: str) -> None:
    """List held leases whose key matches PATTERN (a glob, default *): one line per holder (a key
    under a limit has up to N, by SLOT)."""
    locks = _locks(url, prefix)
    try:
        found = locks.leases(pattern)
    except LeaseBackendError as e:
        raise click.ClickException(str(e)) from None
    rows = [
        {
            "key": i.key,
            "slot": i.slot,
            "ttl": i.ttl,
            "fencing_token": i.fencing_token,
            "task": i.holder.get("task") or i.holder.get("job"),
            "task_id": i.holder.get("task_id") or i.holder.get("job_id"),
            "host": i.holder.get("host"),
            "pid": i.holder.get("pid"),
            "since": i.since,
        }
        for i in found
    ]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no leases held")
        return
    click.echo(f"{'KEY':40} {'SLOT':>4} {'TTL':>8} {'FENCE':>17}  HOLDER")
    for r in rows:
        ttl = "-" if r["ttl"] is None else f"{r['ttl']:.1f}s"
        who = " ".join(f"{k}={r[k]}" for k in ("task", "task_id", "host", "pid") if r[k] is not None)
        click.echo(f"{r['key']:40} {r['slot']:>4} {ttl:>8} {r['fencing_token'] or '-':>17}  {who}")


@main.command()
@_url
@_prefix
@_json
@click.argument("key")
@click.option("--force", is_flag=True, required=True, help="Required: release whoever holds it.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def release(url: str | None, prefix: str | None, as_json: bool, key: str, force: bool, yes: bool) -> None:
    """Release the lease on KEY whoever holds it (--force is required; under a limit, every
    holder). Its holder finds the lease lost at its next renewal or release; the next holder gets a
    larger fencing token."""
    locks = _locks(url, prefix)
    try:
        held = locks.holders(key)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    except LeaseBackendError as e:
        raise click.ClickException(str(e)) from None
    info = held[0] if held else None
    if info is None:
        if as_json:
            click.echo(json.dumps({"key": key, "released": False, "reason": "no lease"}))
        else:
            click.echo(f"no lease held on {key!r}")
        sys.exit(1)
    if not yes:
        if len(held) == 1:
            question = f"release {key!r} held by {info.holder} (fence {info.fencing_token}, {info.ttl}s left)?"
        else:
            question = f"release every one of the {len(held)} holders of {key!r}?\n" + "\n".join(
                f"  slot {h.slot}: {h.holder} (fence {h.fencing_token}, {h.ttl}s left)" for h in held
            )
        click.confirm(question, abort=True)
    try:
        ok = locks.force_release(key)
    except LeaseBackendError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps({"key": key, "released": ok, "fencing_token": info.fencing_token}))
    else:
        click.echo(f"released {key!r}" if ok else f"{key!r} was released meanwhile")


#: rq-cron's settings that may come from the environment: (parameter, option, variable).
_RQ_CRON_ENV = (
    ("leader_ttl", "--leader-ttl", "TASKGUARD_RQ_CRON_LEADER_TTL"),
    ("catch_up", "--catch-up", "TASKGUARD_RQ_CRON_CATCH_UP"),
    ("timezone", "--timezone", "TASKGUARD_RQ_CRON_TIMEZONE"),
    ("name", "--name", "TASKGUARD_RQ_CRON_NAME"),
)


def _number(value: str | None, option: str) -> float | None:
    """A seconds setting as given (option or environment), as a number (checked further by the
    scheduler's settings). Raises ConfigError naming ``option`` for text that is no number."""
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{option}: must be a number of seconds, got {value!r}") from None


def _from_environment(message: str) -> str:
    """``message`` naming the environment variable, not the option, for a setting that came
    from the environment (click's ``ParameterSource``)."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return message
    for param, option, variable in _RQ_CRON_ENV:
        if ctx.get_parameter_source(param) == click.core.ParameterSource.ENVIRONMENT:
            message = message.replace(option, f"{variable} ({option})", 1)
    return message


@main.command("rq-cron")
@_url
@_prefix
@click.option(
    "--rq-url", envvar="RQ_REDIS_URL", help="Redis URL of RQ's queues and jobs (default: $RQ_REDIS_URL, else --url)."
)
@click.option(
    "--timezone",
    envvar="TASKGUARD_RQ_CRON_TIMEZONE",
    help="IANA zone cron expressions are read in, the same for every scheduler of one --name "
    "(default: $TASKGUARD_RQ_CRON_TIMEZONE or UTC).",
)
@click.option(
    "--name",
    envvar="TASKGUARD_RQ_CRON_NAME",
    help="Names the leader lease shared by the schedulers of one schedule "
    "(default: $TASKGUARD_RQ_CRON_NAME or default).",
)
@click.option(
    "--leader-ttl",
    envvar="TASKGUARD_RQ_CRON_LEADER_TTL",
    help="Seconds; a standby takes over within it after the leader dies "
    "(default: $TASKGUARD_RQ_CRON_LEADER_TTL or 30).",
)
@click.option(
    "--catch-up",
    envvar="TASKGUARD_RQ_CRON_CATCH_UP",
    help="Seconds a new leader still enqueues a slot that fell due during a hand-over "
    "(default: $TASKGUARD_RQ_CRON_CATCH_UP or leader TTL + loop + 2; 0: none).",
)
@click.option(
    "--loop-interval",
    type=float,
    default=1.0,
    show_default=True,
    help="Seconds between two looks at the schedule, at most.",
)
@click.option(
    "--logging-level",
    "-l",
    default="INFO",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], case_sensitive=False),
)
@click.option(
    "--path",
    "paths",
    multiple=True,
    default=["."],
    show_default=True,
    help="Import path for the configuration and its jobs (as rq's --path).",
)
@click.argument("config_path")
def rq_cron(
    url: str | None,
    prefix: str | None,
    rq_url: str | None,
    timezone: str | None,
    name: str | None,
    leader_ttl: str | None,
    catch_up: str | None,
    loop_interval: float,
    logging_level: str,
    paths: tuple[str, ...],
    config_path: str,
) -> None:
    """Run the `rq cron` configuration CONFIG_PATH (a module path or a .py file of
    rq.cron.register(...) calls) with each slot enqueued once, however many of these run: one
    leads and enqueues, the others stand by. Exits 78 when the configuration is refused."""
    import logging

    logging.basicConfig(level=logging_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sys.path[:0] = [p for p in paths if p not in sys.path]
    locks = _locks(url, prefix)
    try:
        from taskguard_rq.cron import RQCronScheduler
    except ImportError as e:  # exit 78, as a refused configuration
        click.echo(f"taskguard rq-cron cannot start: {missing_extra('taskguard rq-cron', 'rq', e)}", err=True)
        sys.exit(EX_CONFIG)
    rq_source = rq_url or url
    try:
        if rq_url is not None:
            check_url(rq_url, _source("rq_url", "RQ_REDIS_URL"))
        scheduler = RQCronScheduler(
            redis.Redis.from_url(str(rq_source)),
            locks,
            config_path,
            leader_ttl=_number(leader_ttl, "--leader-ttl"),
            catch_up=_number(catch_up, "--catch-up"),
            name=name,
            timezone=timezone,
            loop_interval=loop_interval,
        )
        scheduler.run()
    except ConfigError as e:
        click.echo(f"taskguard rq-cron cannot start: {_from_environment(str(e))}", err=True)
        sys.exit(EX_CONFIG)
    except LeaseBackendError as e:
        raise click.ClickException(str(e)) from None
    finally:
        locks.close()


@main.command()
@click.option("--port", type=int, default=9808, show_default=True)
@click.option("--addr", default="0.0.0.0", show_default=True)
def metrics(port: int, addr: str) -> None:
    """Serve Prometheus /metrics: the samples every worker process writes to
    PROMETHEUS_MULTIPROC_DIR (required: without it this process has no taskguard samples to
    serve). --addr 127.0.0.1 keeps the endpoint local."""
    from .metrics import serve

    try:
        import prometheus_client  # noqa: F401
    except ImportError as e:  # a configuration to fix, as a missing directory is: 78
        click.echo(f"taskguard metrics cannot start: {missing_extra('taskguard metrics', 'prometheus', e)}", err=True)
        sys.exit(EX_CONFIG)
    where = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not where or not os.path.isdir(where):
        click.echo(
            "taskguard metrics cannot start: PROMETHEUS_MULTIPROC_DIR "
            + ("is not set" if not where else f"({where}) is not a directory")
            + ": set it to the directory the workers' processes write their samples to "
            "(the same value as theirs, with TASKGUARD_METRICS=1 there)",
            err=True,
        )
        sys.exit(EX_CONFIG)

    serve(port, addr)
    click.echo(f"serving taskguard metrics on {addr}:{port}/metrics")
    while True:
        time.sleep(3600)


if __name__ == "__main__":  # pragma: no cover
    main()
