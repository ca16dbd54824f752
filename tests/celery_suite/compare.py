"""Compare two JUnit XML reports of the same tests: ``python compare.py GUARDED.xml PLAIN.xml``.

Prints each run's counts and every test whose outcome differs; exits 1 when any differs (or a
test ran in one run only), else 0."""

from __future__ import annotations

import collections
import sys
import xml.etree.ElementTree as ET


def outcomes(path: str) -> dict[str, str]:
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        out[name] = (
            "failed"
            if "failure" in kinds
            else "error"
            if "error" in kinds
            else "skipped"
            if "skipped" in kinds
            else "passed"
        )
        if "error" in kinds and "failure" in kinds:
            out[name] = "failed"
    return out


def counts(result: dict[str, str]) -> str:
    c = collections.Counter(result.values())
    return ", ".join(f"{c[k]} {k}" for k in ("passed", "failed", "error", "skipped") if c[k])


def main(guarded_path: str, plain_path: str) -> int:
    guarded, plain = outcomes(guarded_path), outcomes(plain_path)
    print(f"with GuardedTask:    {counts(guarded)}")
    print(f"without (control):   {counts(plain)}")
    differ = sorted(n for n in guarded.keys() | plain.keys() if guarded.get(n) != plain.get(n))
    for name in differ:
        print(
            f"  differs: {name}: with GuardedTask {guarded.get(name, 'not run')}, without {plain.get(name, 'not run')}"
        )
    same_failures = sorted(n for n in guarded if guarded[n] in ("failed", "error") and plain.get(n) == guarded[n])
    for name in same_failures:
        print(f"  {guarded[name]} in both runs: {name}")
    print(f"{len(differ)} tests differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
