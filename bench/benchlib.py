"""Helpers shared by the benchmark scripts: percentiles, plain-text tables, the code under test."""

from __future__ import annotations

import argparse
import gc
import math
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import redis

import taskguard
from taskguard.urls import redact_url


def pct(sorted_vals: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (q in [0, 1])."""
    if not sorted_vals:
        return float("nan")
    i = max(0, min(len(sorted_vals) - 1, math.ceil(q * len(sorted_vals)) - 1))
    return sorted_vals[i]


def fmt_table(headers: list[str], rows: list[list[str]], align: str | None = None, lead: int = 1) -> str:
    """Rows with fewer cells than headers keep their first ``lead`` cells and let the rest span."""
    align = align or "l" + "r" * (len(headers) - 1)
    full = [r for r in rows if len(r) == len(headers)]
    part = [r for r in rows if len(r) < len(headers)]
    widths = [
        max([len(h)] + [len(r[i]) for r in full] + [len(r[i]) for r in part if i < lead]) for i, h in enumerate(headers)
    ]

    def line(cells: list[str]) -> str:
        if len(cells) < len(headers):
            head = [c.ljust(w) for c, w in zip(cells[:lead], widths, strict=False)]
            return "  ".join(head + [" ".join(cells[lead:])]).rstrip()
        return "  ".join(
            c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, align, strict=False)
        ).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def git_state() -> str:
    """' (git <commit>[, uncommitted changes in: ...])' for the taskguard package, or ''."""
    pkg = os.path.dirname(os.path.abspath(taskguard.__file__))
    try:
        head = subprocess.run(
            ["git", "-C", pkg, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", pkg, "status", "--porcelain", "--", "."],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return ""
    changed = [line[3:] for line in dirty if line.strip()]
    return f" (git {head}" + (f", uncommitted changes in: {' '.join(changed)})" if changed else ")")


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def run_chunk(fn: Callable[[], None], n: int) -> tuple[float, list[float]]:
    """n ops; -> (wall seconds, per-op seconds)."""
    lat = [0.0] * n
    clock = time.perf_counter
    t0 = clock()
    for i in range(n):
        s = clock()
        fn()
        lat[i] = clock() - s
    return clock() - t0, lat


def delete_matching(admin: Any, pattern: str) -> int:
    """Delete every key matching the glob ``pattern`` (SCAN, batches of 500); -> keys deleted."""
    deleted, batch = 0, []
    for k in admin.scan_iter(match=pattern, count=1000):
        batch.append(k)
        if len(batch) >= 500:
            deleted += admin.delete(*batch)
            batch = []
    if batch:
        deleted += admin.delete(*batch)
    return deleted


def cleanup(admin: Any, prefix: str) -> tuple[int, int]:
    """Delete the run's keys (those holding ``prefix``); -> (keys deleted, keys left)."""
    deleted = delete_matching(admin, f"*{prefix}*")
    return deleted, sum(1 for _ in admin.scan_iter(match=f"*{prefix}*", count=1000))


def arg_parser(doc: str) -> argparse.ArgumentParser:
    """The scripts' parser: described by the first paragraph of ``doc``, with ``--url``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--url",
        default=os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0"),
        help="Redis URL (default: $TASKGUARD_REDIS_URL or redis://127.0.0.1:6379/0)",
    )
    return ap


def run_prefix() -> str:
    """A key prefix (and queue name) unique to this run: ``tgbench-<pid>-<random>``."""
    return f"tgbench-{os.getpid()}-{secrets.token_hex(4)}"


def open_admin(url: str, name: str = "tgbench-admin") -> tuple[Any, dict] | None:
    """An admin client (decoded replies) and ``INFO server``; ``None`` after printing one line
    (password masked) when Redis cannot be reached."""
    admin = redis.Redis.from_url(url, client_name=name, decode_responses=True)
    try:
        return admin, admin.info("server")
    except redis.RedisError as e:
        print(f"cannot reach Redis at {redact_url(url)}: {type(e).__name__}: {e}", file=sys.stderr)
        admin.close()
        return None


def exit_on_sigterm() -> None:
    """Turn SIGTERM into ``SystemExit`` so the scripts' ``finally`` cleanups run."""

    def on_term(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)


def interleaved_rounds(
    contenders: dict[str, Callable[[], None]], ops: int, rounds: int, warm_up: bool = True
) -> tuple[dict[str, list[float]], dict[str, list[float]], list[list[str]]]:
    """Run every contender ``ops`` times per round, ``rounds`` rounds, the order rotated each
    round (after a warm-up of each unless the caller did it). -> (mean seconds/op per round,
    sorted per-op latencies of all rounds, the order of each round), each by contender name."""
    names = list(contenders)
    for fn in contenders.values() if warm_up else ():  # connections made, scripts cached server-side
        for _ in range(max(200, ops // 10)):
            fn()
    per_round: dict[str, list[float]] = {n: [] for n in names}
    lat: dict[str, list[float]] = {n: [] for n in names}
    orders = []
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        orders.append(order)
        for name in order:
            gc.collect()
            wall, lt = run_chunk(contenders[name], ops)
            per_round[name].append(wall / ops)
            lat[name].extend(lt)
    for n in names:
        lat[n].sort()
    return per_round, lat, orders
