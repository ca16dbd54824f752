"""Short runs of ``bench/torture_guards.py`` (the full runs do 10^4 operations per guard): every guard
under SIGKILL, SIGSTOP, cut and delayed connections with real processes on real Redis, 0
violations; and the proof that the checks can fail — the same workers without the guard
(``--unguarded``), and each checker fed a ledger with a violation."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def say(*parts):
    print("   ", *parts, flush=True)


@pytest.fixture(scope="module")
def tg():
    """The script's module (its checkers)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return importlib.import_module("torture_guards")
    finally:
        sys.path.remove(str(ROOT / "bench"))


def run(redis_url, guard, ops, *extra):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "torture_guards.py"), guard, "--ops", str(ops), "--seconds", "60"]
        + ["--url", redis_url, *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    say(out.stdout.strip().replace("\n", "\n    "))
    found = re.search(r"violations: (\d+)", out.stdout)
    assert found, out.stdout + out.stderr[-3000:]
    faults = re.search(r"faults injected: .*\((\d+) in all\)", out.stdout)
    assert faults, out.stdout
    return out, int(found.group(1)), int(faults.group(1))


@pytest.mark.parametrize(
    "guard, ops", [("limit", 600), ("once", 600), ("unique", 600), ("throttle", 1500), ("beat", 400)]
)
def test_torture_short(redis_url, guard, ops):
    """A short run of one guard under faults: every check holds."""
    out, violations, faults = run(redis_url, guard, ops)
    assert out.returncode == 0 and violations == 0, out.stdout + out.stderr[-3000:]
    assert faults > 0
    if guard == "beat":  # the loss check covered some slots
        first, last = map(int, re.search(r"checked for loss: slots (\d+)-(\d+)", out.stdout).groups())
        assert last >= first, out.stdout


@pytest.mark.parametrize("guard", ["limit", "once", "unique", "throttle", "beat"])
def test_torture_finds_the_violations_of_unguarded_workers(redis_url, guard):
    """The same workers without the guard (no lease, no once record, no clear of the queued mark,
    no rate, every scheduler publishing): the checks report violations and the script exits 1."""
    out, violations, _ = run(redis_url, guard, 400, "--unguarded")
    assert out.returncode == 1 and violations > 0, out.stdout + out.stderr[-3000:]


def test_limit_checker_counts_holders_above_the_limit_and_fence_regressions(tg):
    clean = {"a", "b", "c"}
    ok = ["i 1 0 5 a", "i 2 1 7 b", "o 3 0 5 a", "i 4 0 6 c", "o 5 1 7 b", "o 6 0 6 c"]
    assert tg.check_limit(ok, clean, 2) == {"peak": 2, "over": 0, "regressions": 0}
    assert tg.check_limit(ok, clean, 1)["over"] == 2  # b beside a, then c beside b
    overlap = ["i 1 0 5 a", "i 2 1 7 b", "i 3 0 4 c", "o 4 0 5 a", "o 5 1 7 b", "o 6 0 4 c"]  # c: slot 0, fence 4
    assert tg.check_limit(overlap, clean, 2) == {"peak": 3, "over": 1, "regressions": 1}
    # a hold whose lease lapsed (not held throughout) is left out
    assert tg.check_limit(overlap, {"a", "b"}, 2) == {"peak": 2, "over": 0, "regressions": 0}


def test_once_checker_finds_a_replaced_value(tg):
    assert tg.check_once({"k": ["v1", "v1"]}, {"k": "v1"})["replaced"] == 0
    assert tg.check_once({"k": ["v1", "v2"]}, {"k": "v2"})["replaced"] == 1
    assert tg.check_once({"k": ["v1"]}, {"k": "v2"})["replaced"] == 1
    assert tg.check_once({"k": ["v1"]}, {"k": None})["replaced"] == 1


def test_unique_checker_finds_a_suppression_by_a_cleared_run_and_a_mark_left(tg):
    cleared = {"r1": "10"}
    assert tg.check_unique(["5 k0 r1", "12 k0 r2"], cleared) == 0  # asked while r1 was queued or running
    assert tg.check_unique(["11 k0 r1"], cleared) == 1
    now = 1_000_000
    assert tg.left_marks({"k0": "r2 1001000 ~n", "k1": "~n", "k2": None}, cleared, now) == 0
    assert tg.left_marks({"k0": "r1 1001000 ~n"}, cleared, now) == 1  # names a cleared run
    assert tg.left_marks({"k0": "r2 1009000 ~n"}, cleared, now) == 1  # beyond its TTL


def test_throttle_checker_finds_admissions_over_rate_and_burst(tg):
    # 10/s, burst 2: two at once, then one each 0.1 s is the most that may pass
    ok = ["0.000 0.001 1", "0.000 0.001 1"] + [f"{0.1 * i:.3f} {0.1 * i + 0.001:.3f} 1" for i in range(1, 20)]
    assert tg.check_throttle(ok, 10, 1.0, 2)["violations"] == 0
    assert tg.check_throttle([*ok, "0.450 0.451 1"], 10, 1.0, 2)["violations"] > 0
    # weighted: a cost of 3 beside a full burst
    assert tg.check_throttle(["0.0 0.001 2", "0.01 0.011 3"], 10, 1.0, 4)["violations"] == 1
    # a wide bracket (a slow reply) is never taken for a violation
    assert tg.check_throttle(["0.0 0.001 2", "0.0 0.5 3"], 10, 1.0, 4)["violations"] == 0


def test_beat_checker_finds_a_lost_slot_a_publish_after_confirmation_and_a_second_run(tg):
    log = ["p e0 every4s:1 7 8", "c e0 every4s:1 7", "p e0 every4s:2 7 8", "p e0 every4s:2 9 8", "c e0 every4s:2 9"]
    r = tg.check_beat(log, ["e0 every4s:1", "e0 every4s:2"], ["e0"], 1, 2)
    assert (r["lost"], r["after_confirm"], r["late"], r["republished"], r["twice"]) == (0, 0, 0, 1, 0)
    assert tg.check_beat(log, [], ["e0", "e1"], 1, 3)["lost"] == 4  # e0's 3rd, all three of e1's
    late = [*log, "p e0 every4s:2 7 8"]  # the deposed leader (fence 7) publishes after 9 confirmed
    r = tg.check_beat(late, [], ["e0"], 1, 2)
    assert (r["late"], r["after_confirm"]) == (1, 0)
    again = [*log, "p e0 every4s:1 9 8"]  # a leader as recent publishes a confirmed slot again
    assert tg.check_beat(again, [], ["e0"], 1, 2)["after_confirm"] == 1
    assert tg.check_beat(log, ["e0 every4s:1", "e0 every4s:1"], ["e0"], 1, 2)["twice"] == 1
