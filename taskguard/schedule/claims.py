"""Slot claims fenced by the leader lease.

Per entry, the leader keeps the latest slot it handled as a *lease record* of its leader lease
(:meth:`taskguard.Lease.put_record`: one single-key script that writes only while that lease is
held), named ``slot:<entry name>``, holding ``"<instant> <claimed|published> <leader fence>
<scheduler id>"``. The leader claims a slot (``claimed``), publishes it, then confirms it
(``published``). A scheduler that lost the lease cannot claim, so no second scheduler publishes a
slot; a message a valid leader published is never dropped later; a slot claimed but not
confirmed is published again by the next tick or the next leader (the worker runs a slot once).
"""

from __future__ import annotations

import math

from ..lease import Lease
from ..locks import Locks

__all__ = ["SlotRecord", "RECORD_PREFIX", "CLAIMED", "PUBLISHED", "read_record", "claim", "confirm"]

#: Lease record (on the leader lease) of an entry's latest handled slot: ``slot:<entry name>``.
RECORD_PREFIX = "slot:"
CLAIMED, PUBLISHED = "claimed", "published"


class SlotRecord:
    """An entry's slot record as read (``raw`` ``None``: none; then ``instant`` is ``-inf``);
    ``by`` the scheduler that wrote it (``""`` if unknown)."""

    __slots__ = ("instant", "state", "fence", "raw", "by")

    def __init__(self, raw: str | None) -> None:
        self.raw, self.instant, self.state, self.fence, self.by = raw, -math.inf, "", 0, ""
        parts = (raw or "").split(" ")
        if len(parts) >= 3:
            try:
                self.instant, self.state, self.fence = float(parts[0]), parts[1], int(parts[2])
            except ValueError:
                self.instant = -math.inf
            self.by = " ".join(parts[3:])


def _value(instant: float, state: str, leader: Lease, by: str) -> str:
    return f"{instant!r} {state} {leader.fencing_token} {by}"


def read_record(locks: Locks, leader_key: str, entry: str) -> SlotRecord:
    """The slot record of ``entry`` under the leader lease ``leader_key``. Raises LeaseBackendError."""
    return SlotRecord(locks.get_lease_record(leader_key, RECORD_PREFIX + entry))


def claim(leader: Lease, entry: str, instant: float, by: str, current: SlotRecord) -> str | None:
    """Claim ``entry``'s slot at ``instant`` (Unix seconds) for the scheduler ``by``, if its
    record still is ``current``. Returns the claim (the value :func:`confirm` expects) or ``None``
    when the record changed meanwhile. Raises LeaseLost when ``leader`` is no longer held,
    LeaseBackendError when Redis fails."""
    value = _value(instant, CLAIMED, leader, by)
    if not leader.put_record(RECORD_PREFIX + entry, value, if_value=current.raw, if_absent=current.raw is None):
        return None
    return value


def confirm(leader: Lease, entry: str, instant: float, by: str, claimed: str) -> bool:
    """Mark the claimed slot published. Returns ``False`` when the record no longer holds the
    claim. Raises LeaseLost / LeaseBackendError (the slot is then published again by the next
    leader, and run once)."""
    return leader.put_record(RECORD_PREFIX + entry, _value(instant, PUBLISHED, leader, by), if_value=claimed)
