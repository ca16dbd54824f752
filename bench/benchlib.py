"""Helpers shared by the benchmark scripts: percentiles, plain-text tables, the code under test."""

from __future__ import annotations

import math
import os
import subprocess

import taskguard


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
    widths = [max([len(h)] + [len(r[i]) for r in full] + [len(r[i]) for r in part if i < lead])
              for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        if len(cells) < len(headers):
            head = [c.ljust(w) for c, w in zip(cells[:lead], widths)]
            return "  ".join(head + [" ".join(cells[lead:])]).rstrip()
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, align)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])



def git_state() -> str:
    """' (git <commit>[, uncommitted changes in: ...])' for the taskguard package, or ''."""
    pkg = os.path.dirname(os.path.abspath(taskguard.__file__))
    try:
        head = subprocess.run(["git", "-C", pkg, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", pkg, "status", "--porcelain", "--", "."], capture_output=True,
                               text=True, timeout=5, check=True).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return ""
    changed = [line[3:] for line in dirty if line.strip()]
    return f" (git {head}" + (f", uncommitted changes in: {' '.join(changed)})" if changed else ")")



def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"
