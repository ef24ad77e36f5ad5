"""The router's tiers checked against what the engines hold (`GET /mori/residency`).

The router's GPU/CPU tiers are its own bookkeeping; the engines hold the KV. The two drift:
HiCache may drop a CPU-tier program's host copy under pressure, and a restarted router starts
with no tiers at all while the engines still hold every program's KV and the last router's
hints. Reconciliation reads each replica's residency and

- adopts the programs the router does not know: a program the engine holds (any tokens, hint
  not `inactive`) joins the tier its hint names on that replica (`busy` -> GPU, `idle` -> CPU)
  as an acting program with the context the engine holds, so a restarted router rebuilds the
  previous one's tiers and routes each program back to its KV (the first step toward a
  standby router taking over). Only a program a router named in a hint (`hinted`) is adopted:
  a name the engine gave KV itself (the emulator names a request that reached it without a
  `session_id` by its first message) is at best another name for a program the router knows
  under its own id, and adopting it would count that program's tokens twice. Nor is a
  program the router has just ended (the controller first waits for its pending hints to be
  answered, and names the programs that ended while the engines were read);
  a router taking over (router/owner/leadership.py) also adopts the named programs whose
  hint is `inactive` but whose KV is still there, into WAITING with that replica as their
  home: the last active held them in WAITING, and their next request should find their KV
  as it would have there (the periodic check leaves those alone: they are ended programs
  as often as waiting ones);
- drops the router's belief in KV that is gone: an acting CPU-tier program whose replica
  holds none of its tokens any more moves to WAITING (its next request is placed afresh,
  instead of being promoted for a host copy that no longer exists).

Pure: it works on the policy's public state and the parsed documents; the controller does
the HTTP (at start, before the first full hint sync, and every `reconcile_s`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from router.policy.base import Policy
from router.policy.program import Program
from router.policy.types import WAITING, Hint, Placement, Status, Tier

_TIER_OF_HINT = {Hint.BUSY: Tier.GPU, Hint.IDLE: Tier.CPU}


@dataclass(frozen=True, slots=True)
class Held:
    """What one replica holds for one program."""

    replica: str
    device_tokens: int
    host_tokens: int
    hint: Hint
    hinted: bool = True  # a router named the program (else its hint is the engine's default)

    @property
    def tokens(self) -> int:
        return max(self.device_tokens, self.host_tokens)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one reconciliation changed (for logs and tests)."""

    adopted: dict[str, Placement]
    lost: list[str]


def parse_residency(replica: str, doc: Any) -> dict[str, Held]:
    """Program -> Held from one `/mori/residency` answer; malformed entries are skipped. A
    row that does not say `hinted` (an engine older than the field) counts as not named by
    a router: never adopted."""
    programs = doc.get("programs") if isinstance(doc, dict) else None
    out: dict[str, Held] = {}
    for pid, row in programs.items() if isinstance(programs, dict) else ():
        try:
            held = Held(
                replica,
                int(row["device_tokens"]),
                int(row["host_tokens"]),
                Hint(row["hint"]),
                row.get("hinted") is True,
            )
        except (TypeError, KeyError, ValueError, AttributeError):
            continue
        out[pid] = held
    return out


def reconcile(
    policy: Policy,
    views: Mapping[str, Mapping[str, Held]],
    now: float,
    waiting: bool = False,
    ended: Collection[str] = (),
) -> Outcome:
    """Bring the policy's tiers in line with the replicas' residency (`views`: replica ->
    program -> Held, for the replicas that answered); `waiting`: adopt `inactive` programs
    that hold KV too (a takeover). `ended`: programs the router ended while the views were
    read (an engine still typed them busy or idle then): never adopted back."""
    best: dict[str, Held] = {}
    for held_here in views.values():
        for pid, held in held_here.items():
            if held.hinted and held.tokens > (best[pid].tokens if pid in best else 0):
                best[pid] = held
    adopted = {
        pid: _adopt(policy, pid, held, now)
        for pid, held in best.items()
        if pid not in policy.programs
        and pid not in ended
        and (held.hint in _TIER_OF_HINT or waiting)
        and policy.tiers.healthy.get(held.replica, False)
    }
    lost = [
        p.program_id
        for p in list(policy.programs.values())
        if p.placement.tier is Tier.CPU
        and p.status is Status.ACTING
        and p.placement.replica in views
        and views[p.placement.replica].get(p.program_id, _NOTHING).tokens == 0
    ]
    for pid in lost:
        policy.tiers.place(policy.programs[pid], WAITING)
    return Outcome(adopted, lost)


_NOTHING = Held("", 0, 0, Hint.INACTIVE)


def _adopt(policy: Policy, pid: str, held: Held, now: float) -> Placement:
    """A program the engine holds and the router does not know: an acting program with one
    completed step (not new), on the tier its last hint named (WAITING for `inactive`, its
    home the replica holding it)."""
    p = Program(pid, created_s=now, window=policy.config.window)
    p.steps = 1
    p.context_tokens = held.tokens
    p.last_replica = held.replica
    policy.programs[pid] = p
    tier = _TIER_OF_HINT.get(held.hint)
    place = WAITING if tier is None else Placement(tier, held.replica)
    policy.tiers.place(p, place)
    return place
