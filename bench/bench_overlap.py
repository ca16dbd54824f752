"""Debounce and coalesce beside plain apply_async: a debounced call's publish, a follow-up's start.

1. **Publish cost** (no worker; the calls are only published): per call of ``apply_async`` in
   interleaved rounds — ``plain`` (an unguarded task), ``guarded`` (a ``GuardedTask``: a publish
   stamp), ``debounce: open`` (each call opens its own window: the record written, one message
   published) and ``debounce: join`` (every call joins one open window: the record updated, no
   message). Medians per round and the ratios to ``plain`` (median, min..max over rounds).
2. **Start latency** (one ``celery worker -P prefork -c 2`` subprocess): ``plain`` and
   ``guarded`` (a ``GuardedTask``, a free key) — from ``apply_async`` returning to the body
   starting on an idle worker; ``coalesced follow-up`` — a
   call made while a run of its key is active (``overlap="coalesce"``) waits as the key's pending
   follow-up; from the active body ending to the follow-up's body starting (the holder takes the
   pending record at its end and publishes the follow-up's message). Medians, p90 and the ratio.

Needs a Redis it may write to; every key of the run (``tgbench-<pid>-<random>``) is deleted at the
end, also after an error or Ctrl-C."""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from bench_celery import Worker, cleanup  # noqa: E402
from benchlib import arg_parser, exit_on_sigterm, fmt_table, git_state, interleaved_rounds, pct, run_prefix  # noqa: E402

from taskguard.urls import redact_url  # noqa: E402


class OverlapWorker(Worker):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.args[self.args.index("celery_bench_app")] = "overlap_bench_app"


def ratio_line(per_round: dict[str, list[float]], name: str, base: str) -> str:
    r = [a / b for a, b in zip(per_round[name], per_round[base], strict=True)]
    return f"{statistics.median(r):.2f}x ({min(r):.2f}..{max(r):.2f})"


def publish_cost(m: Any, ops: int, rounds: int) -> None:
    counter = iter(range(10**9))
    contenders = {
        "plain": lambda: m.plain.apply_async((next(counter),)),
        "guarded": lambda: m.guarded.apply_async((next(counter),)),
        "debounce: open": lambda: m.debounced.apply_async((f"o{next(counter)}", 0)),
        "debounce: join": lambda: m.debounced.apply_async(("join", next(counter))),
    }
    per_round, lat, _ = interleaved_rounds(contenders, ops, rounds)
    rows = []
    for name in contenders:
        med = statistics.median(per_round[name]) * 1e6
        rows.append(
            [
                name,
                f"{med:.0f}",
                f"{pct(lat[name], 0.5) * 1e6:.0f}",
                f"{pct(lat[name], 0.99) * 1e6:.0f}",
                "1.00x" if name == "plain" else ratio_line(per_round, name, "plain"),
            ]
        )
    print(f"\n1. publish cost per call ({rounds} interleaved rounds of {ops} calls; no worker)\n")
    print(fmt_table(["contender", "mean us/call", "p50 us", "p99 us", "vs plain (median, min..max)"], rows))


def marks(admin: Any, prefix: str) -> dict[tuple[str, int], float]:
    out = {}
    for x in admin.lrange(f"{prefix}:marks", 0, -1):
        what, i, at = x.split()
        out[(what, int(i))] = float(at)
    return out


def wait_mark(admin: Any, prefix: str, key: tuple[str, int], timeout: float = 20.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = marks(admin, prefix).get(key)
        if got is not None:
            return got
        time.sleep(0.002)
    raise RuntimeError(f"no {key} mark within {timeout} s")


def start_latency(m: Any, admin: Any, prefix: str, samples: int, hold: float) -> None:
    plain, guarded, follow = [], [], []
    i = 1_000_000
    for n in range(samples):
        # plain and guarded: publish -> body start, on an idle worker
        for task, out in ((m.plain, plain), (m.guarded_mark, guarded)):
            i += 1
            task.apply_async((i,))
            sent = time.time()
            out.append(wait_mark(admin, prefix, ("start", i)) - sent)
        # coalesced: a call while the key's run is active; active end -> follow-up start
        lane = f"l{n}"
        i += 1
        m.coalesced.apply_async((lane, i, hold))
        wait_mark(admin, prefix, ("start", i))
        m.coalesced.apply_async((lane, i + 1, 0.0))
        end = wait_mark(admin, prefix, ("end", i))
        follow.append(wait_mark(admin, prefix, ("start", i + 1)) - end)
        wait_mark(admin, prefix, ("end", i + 1))
        i += 1
    rows = []
    for got in (plain, guarded, follow):
        got.sort()
    for name, got in (
        ("plain apply_async: publish -> start", plain),
        ("guarded apply_async: publish -> start", guarded),
        ("coalesced follow-up: active end -> start", follow),
    ):
        rows.append(
            [
                name,
                f"{pct(got, 0.5) * 1e3:.1f}",
                f"{pct(got, 0.9) * 1e3:.1f}",
                f"{pct(got, 0.5) / pct(plain, 0.5):.2f}x",
                f"{pct(got, 0.5) / pct(guarded, 0.5):.2f}x",
            ]
        )
    print(f"\n2. start latency ({samples} samples each, alternating; active run holds {hold:.2f} s; prefork -c 2)\n")
    print(fmt_table(["path", "p50 ms", "p90 ms", "p50 vs plain", "p50 vs guarded"], rows))


def main(argv: list[str] | None = None) -> int:
    ap = arg_parser(__doc__)
    ap.add_argument("--ops", type=int, default=500, help="calls per contender per round (default 500)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    ap.add_argument("--samples", type=int, default=30, help="start-latency samples per path (default 30)")
    ap.add_argument("--hold", type=float, default=0.2, help="seconds the active run holds its key (default 0.2)")
    args = ap.parse_args(argv)
    exit_on_sigterm()
    import redis

    run = run_prefix()
    os.environ.update({"TASKGUARD_REDIS_URL": args.url, "TGBENCH_QUEUE": run, "TGBENCH_PREFIX": run})
    import overlap_bench_app as m

    admin = redis.Redis.from_url(args.url, decode_responses=True)
    print(f"bench_overlap{git_state()}: Redis {redact_url(args.url)}, run prefix {run}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    worker = OverlapWorker(run, f"{run}@%h", 2, env)
    try:
        publish_cost(m, args.ops, args.rounds)
        admin.delete(run)  # the published messages: nobody consumes them
        worker.start()
        m.plain.apply_async((0,)).get(timeout=60)  # the worker is up
        start_latency(m, admin, run, args.samples, args.hold)
    finally:
        worker.stop()
        deleted, left = cleanup(admin, run, [])
        print(f"\ncleanup: {deleted} keys deleted, {left} left")
        if worker.proc is not None and worker.proc.returncode not in (0, None, -15):
            print(worker.output()[-2000:])
        worker.remove_log()
    return 0


if __name__ == "__main__":
    sys.exit(main())
