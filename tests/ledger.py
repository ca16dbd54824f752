"""Entry/exit ledgers of a limited key's holders, written by test tasks and jobs as
``"<in|out> <time> <pid> <slot> <fence>"`` lines, and the checks made on them."""

from __future__ import annotations


def parse(lines) -> list[tuple[float, int, int, int]]:
    """Time-ordered ``(time, +1 entry / -1 exit, slot, fence)``; an exit sorts before an entry at
    the same instant."""
    out = []
    for raw in lines:
        kind, at, _pid, slot, fence = (raw.decode() if isinstance(raw, bytes) else raw).split()
        out.append((float(at), 1 if kind == "in" else -1, int(slot), int(fence)))
    return sorted(out, key=lambda e: (e[0], e[1]))


def peak(entries, limit: int) -> int:
    """Assert the holders inside never exceed ``limit`` and each slot's fences strictly increase;
    returns the peak."""
    inside = top = 0
    last: dict[int, int] = {}
    for _at, step, slot, fence in entries:
        inside += step
        top = max(top, inside)
        if step == 1:
            assert fence > last.get(slot, 0), (slot, fence, last)
            last[slot] = fence
    assert top <= limit, top
    return top
