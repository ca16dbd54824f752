"""Leases lost in a Sentinel failover, with and without the durability option (``replicas=1``).

Each trial starts its own processes on free loopback ports (tests/sentinel_setup.py): a primary,
a replica whose replication link runs through a TCP proxy, three sentinels
(``down-after-milliseconds`` 1000, ``failover-timeout`` 3000). It takes a control lease with
``replicas=1`` while replication works, cuts (black-holes) the link, acquires the key under test
through Sentinel with ``replicas=0`` or ``replicas=1``, SIGKILLs the primary, waits until every
sentinel names the replica as the new primary, and looks for the lease on it directly. A *loss*
is an acquisition that answered "acquired" (a body would have started) whose lease the promoted
primary does not have. The two options alternate, trial by trial.

Before the cut, each trial also times ``--samples`` acquisitions with ``replicas=0`` and as many
with ``replicas=1`` (alternately, through Sentinel, the lease released untimed after each): the
latency the option adds while the replica keeps up.

    .venv/bin/python bench/failover.py                  # 50 trials of each option (~10 min)
    .venv/bin/python bench/failover.py --trials 5 --samples 50
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from benchlib import fmt_table, git_state, pct  # noqa: E402

from tests.sentinel_setup import DOWN_AFTER_MS, FAILOVER_TIMEOUT_MS, Trial, run_trial  # noqa: E402


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=50, help="trials of each option (default 50)")
    ap.add_argument("--samples", type=int, default=200, help="timed acquisitions per option per trial (default 200)")
    ap.add_argument("--replica-timeout", type=float, default=0.1, help="replica_timeout, seconds (default 0.1)")
    args = ap.parse_args()

    print(f"failover: {args.trials} trials of each option, replica_timeout={args.replica_timeout} s; {git_state()}")
    print(f"sentinel down-after-milliseconds {DOWN_AFTER_MS}, failover-timeout {FAILOVER_TIMEOUT_MS}\n")
    trials: dict[int, list[Trial]] = {0: [], 1: []}
    latency: dict[int, list[float]] = {0: [], 1: []}
    per_trial_added: list[float] = []
    started = time.monotonic()
    for i in range(2 * args.trials):
        option = i % 2
        trial, samples = run_trial(option, replica_timeout=args.replica_timeout, latency_samples=args.samples)
        trials[option].append(trial)
        for k, v in samples.items():
            latency[k].extend(v)
        if samples[0] and samples[1]:
            per_trial_added.append(statistics.median(samples[1]) - statistics.median(samples[0]))
        print(
            f"  trial {i + 1:3d}  replicas={option}  acquired={trial.acquired!s:5}  "
            f"on promoted={trial.on_promoted!s:5}  lost={trial.lost!s:5}  "
            f"control kept={trial.control_on_promoted!s:5}  promotion {trial.promotion:.2f} s",
            flush=True,
        )

    rows = []
    for option in (0, 1):
        ts = trials[option]
        rows.append(
            [
                f"replicas={option}",
                str(len(ts)),
                str(sum(t.acquired for t in ts)),
                str(sum(t.reason == "unreplicated" for t in ts)),
                str(sum(t.lost for t in ts)),
                str(sum(t.control_on_promoted for t in ts)),
                str(sum(t.second for t in ts)),
                f"{statistics.median(t.promotion for t in ts):.2f}",
            ]
        )
    print()
    print(
        fmt_table(
            [
                "option",
                "trials",
                "acquired",
                "refused (unreplicated)",
                "LOST",
                "control lease kept",
                "2nd holder got in",
                "promotion s (median)",
            ],
            rows,
        )
    )

    print("\nacquire latency through Sentinel while the replica keeps up (ms):")
    lat_rows = []
    for option in (0, 1):
        s = sorted(latency[option])
        if s:
            lat_rows.append(
                [
                    f"replicas={option}",
                    str(len(s)),
                    _ms(statistics.median(s)),
                    _ms(pct(s, 0.1)),
                    _ms(pct(s, 0.9)),
                    _ms(pct(s, 0.99)),
                ]
            )
    print(fmt_table(["option", "n", "median", "p10", "p90", "p99"], lat_rows))
    if latency[0] and latency[1] and per_trial_added:
        m0, m1 = statistics.median(latency[0]), statistics.median(latency[1])
        added = sorted(per_trial_added)
        print(
            f"\nadded by replicas=1: {_ms(m1 - m0)} ms at the median ({m1 / m0:.2f}x); per trial "
            f"(median of replicas=1 - median of replicas=0): median {_ms(statistics.median(added))} ms, "
            f"min {_ms(added[0])}, max {_ms(added[-1])}"
        )
    print(f"\ntotal {time.monotonic() - started:.0f} s")
    lost_with = sum(t.lost for t in trials[1])
    lost_without = sum(t.lost for t in trials[0])
    print(
        f"verdict: {lost_without} of {len(trials[0])} lost without the option, {lost_with} of {len(trials[1])} with it"
    )
    return 1 if lost_with else 0


if __name__ == "__main__":
    sys.exit(main())
