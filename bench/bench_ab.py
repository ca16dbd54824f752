#!/usr/bin/env python
"""Old code against new code: taskguard's core lease path and a guarded Celery task, each tree
measured in its own subprocess, in alternating rounds, beside an A/A control (old against a second
copy of old).

Run from the repository root:

    .venv/bin/python bench/bench_ab.py OLD [NEW] [--rounds 10] [--what core,celery] [--url URL]

``OLD`` and ``NEW`` are git revisions (``NEW`` defaults to the working tree as it is, uncommitted
changes included). Each revision is exported with ``git archive`` into a temporary directory (``OLD``
twice: ``old`` and ``old'``, the A/A control), and every measurement is a fresh interpreter that
imports taskguard from one of them (its path first on ``sys.path``; the child checks where the
module came from). Each round runs the three trees once, the order rotated every round, so slow
drifts of the machine fall on all three alike.

What a child measures, on one Redis (``--url``, default ``$TASKGUARD_REDIS_URL`` or
``redis://127.0.0.1:6379/0``; meant for loopback), under a key prefix of its own that it deletes:

* ``core``    ``RedisLocks.acquire(key, ttl=10)`` + ``lease.release()`` on fresh keys, ``--ops`` times
              after a warm-up, on one ``RedisLocks.from_url`` client: seconds per operation.
* ``celery``  this directory's ``celery_bench_app`` with ``celery worker -P prefork -c 2`` (the tree's
              taskguard on the worker's ``PYTHONPATH``): batches of ``--tasks`` guarded no-op tasks
              drained from a backlog, alternating with unguarded batches (the same worker), as
              ``bench_celery.py`` drains them: guarded tasks per second (the median of the batches).

Printed per measurement: each tree's median, and the per-round ratios new/old and old'/old
(higher is better: operations or tasks per second), median and min..max. The verdict follows the
rule "no slowdown": the median new/old ratio is at least 0.97, or its min..max spread covers 1.0;
the A/A row shows how far two copies of one tree differ on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RULE = 0.97


# -- the child: one measurement of one tree ---------------------------------------------------------------
def _use_tree(tree: str) -> None:
    sys.path[:0] = [tree, os.path.join(tree, "integrations")]
    os.environ["PYTHONPATH"] = os.pathsep.join([tree, os.path.join(tree, "integrations")])
    import taskguard
    import taskguard_celery  # noqa: F401

    got = os.path.realpath(taskguard.__file__)
    if not got.startswith(os.path.realpath(tree) + os.sep):
        raise SystemExit(f"taskguard was imported from {got}, not from {tree}")


def child_core(url: str, ops: int) -> dict[str, Any]:
    import redis
    from benchlib import delete_matching, run_prefix

    from taskguard import RedisLocks

    prefix = run_prefix()
    locks = RedisLocks.from_url(url, prefix=prefix)
    admin = redis.Redis.from_url(url)
    try:

        def cycle(i: int) -> None:
            got = locks.acquire(f"k{i}", ttl=10)
            assert got.acquired and got.lease is not None
            got.lease.release()

        for i in range(max(300, ops // 10)):  # connections made, scripts cached
            cycle(-i - 1)
        cpu0, t0 = time.process_time(), time.perf_counter()
        for i in range(ops):
            cycle(i)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        return {"rate": ops / wall, "cpu_per_op": cpu / ops}
    finally:
        locks.close()
        delete_matching(admin, f"*{prefix}*")  # (keys are hash-tagged: "{<prefix>:...}")


def child_celery(url: str, tasks: int, batches: int) -> dict[str, Any]:
    import redis
    from benchlib import run_prefix

    run = run_prefix()
    os.environ.update(TASKGUARD_REDIS_URL=url, TGBENCH_QUEUE=run, TGBENCH_PREFIX=run)
    import bench_celery

    admin = redis.Redis.from_url(url, client_name="tgbench-ab-admin", decode_responses=True)
    args = argparse.Namespace(
        url=url,
        url_host=redis.connection.parse_url(url).get("host") or "",
        timeout=60.0,
        wait="poll",
        concurrency=2,
        warmup=200,
        tasks=tasks,
    )
    bench = bench_celery.Bench(args, run, admin)
    try:
        bench.start_worker()
        for kind in ("unguarded", "guarded"):
            bench.drain(kind, args.warmup, measure_cpu=False)
        rates: dict[str, list[float]] = {"guarded": [], "unguarded": []}
        for b in range(batches):
            for kind in ("guarded", "unguarded") if b % 2 == 0 else ("unguarded", "guarded"):
                rates[kind].append(bench.drain(kind, tasks, measure_cpu=False)["rate"])
        return {
            "rate": statistics.median(rates["guarded"]),
            "vs_unguarded": statistics.median(g / u for g, u in zip(rates["guarded"], rates["unguarded"], strict=True)),
        }
    finally:
        if bench.worker is not None:
            bench.worker.stop()
            bench.worker.remove_log()
        bench_celery.cleanup(admin, run, bench.task_ids)


def child_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("core", "celery"))
    ap.add_argument("--tree", required=True)
    ap.add_argument("--url", required=True)
    ap.add_argument("--ops", type=int, default=3000)
    ap.add_argument("--tasks", type=int, default=300)
    ap.add_argument("--batches", type=int, default=4)
    a = ap.parse_args(argv)
    _use_tree(a.tree)
    sys.path.insert(0, str(HERE))
    out = child_core(a.url, a.ops) if a.what == "core" else child_celery(a.url, a.tasks, a.batches)
    print(json.dumps(out))
    return 0


# -- the parent: trees, rounds, ratios ----------------------------------------------------------------------
def export(rev: str, dest: Path) -> None:
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def measure(what: str, tree: str, a: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        what,
        "--tree",
        tree,
        "--url",
        a.url,
        "--ops",
        str(a.ops),
        "--tasks",
        str(a.tasks),
        "--batches",
        str(a.batches),
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"{what} on {tree} failed (rc {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}..{max(xs):.3f})"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child_main(argv[1:])
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("old", help="the old revision (git)")
    ap.add_argument("new", nargs="?", default=None, help="the new revision (default: the working tree)")
    ap.add_argument("--rounds", type=int, default=10, help="alternating rounds (default 10, at least 10 for a verdict)")
    ap.add_argument("--what", default="core,celery", help="core, celery or both (default core,celery)")
    ap.add_argument("--ops", type=int, default=3000, help="core: operations per child (default 3000)")
    ap.add_argument("--tasks", type=int, default=300, help="celery: tasks per batch (default 300)")
    ap.add_argument("--batches", type=int, default=4, help="celery: guarded batches per child (default 4)")
    ap.add_argument("--url", default=os.environ.get("TASKGUARD_REDIS_URL", "redis://127.0.0.1:6379/0"))
    a = ap.parse_args(argv)
    whats = [w for w in a.what.split(",") if w]
    if not whats or any(w not in ("core", "celery") for w in whats):
        ap.error("--what takes core, celery or core,celery")
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")

    with tempfile.TemporaryDirectory(prefix="tgbench-ab-") as tmp:
        trees = {"old": Path(tmp, "old"), "old'": Path(tmp, "old2")}
        for t in trees.values():
            export(a.old, t)
        if a.new is None:
            trees["new"] = ROOT
        else:
            trees["new"] = Path(tmp, "new")
            export(a.new, trees["new"])
        new_name = a.new or "the working tree"
        print(f"# taskguard old against new: old = {a.old}, new = {new_name}; A/A control: old' = a second copy of old")
        print(
            f"{a.rounds} rounds, the three trees in rotated order each round, each measurement a fresh process\n",
            flush=True,
        )
        failed = False
        for what in whats:
            names = list(trees)
            res: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
            for r in range(a.rounds):
                order = names[r % 3 :] + names[: r % 3]
                for n in order:
                    res[n].append(measure(what, str(trees[n]), a))
            unit = "acquire+release/s" if what == "core" else "guarded tasks/s"
            print(f"## {what}: {unit} (median over rounds, min..max)")
            for n in names:
                rates = [m["rate"] for m in res[n]]
                extra = ""
                if what == "core":
                    extra = f"   client CPU {statistics.median(m['cpu_per_op'] for m in res[n]) * 1e6:.0f} us/op"
                else:
                    extra = f"   guarded/unguarded {spread([m['vs_unguarded'] for m in res[n]])}"
                print(f"  {n:<5} {statistics.median(rates):9.1f}  ({min(rates):.1f}..{max(rates):.1f}){extra}")
            ratio = [x["rate"] / o["rate"] for x, o in zip(res["new"], res["old"], strict=True)]
            control = [x["rate"] / o["rate"] for x, o in zip(res["old'"], res["old"], strict=True)]
            ok = statistics.median(ratio) >= RULE or min(ratio) <= 1.0 <= max(ratio)
            failed |= not ok
            print(
                f"  new/old   per-round ratio {spread(ratio)}   {'PASS' if ok else 'FAIL'} "
                f"(median >= {RULE} or the spread covers 1.0)"
            )
            print(f"  old'/old  per-round ratio {spread(control)}   (A/A control)\n", flush=True)
        if a.rounds < 10:
            print(f"NOTE: {a.rounds} rounds; a verdict wants at least 10")
        return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
