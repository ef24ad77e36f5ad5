"""Reservation: room a promotion pass leaves free.

The growth band (every rung): promotions leave free, per replica, the last-step context
growth of its REASONING programs (`Ledger.growth_band`, kept in the ledger), so their
steps' growth does not overflow a brim-full tier.

Agent contexts grow every step (tool result + output). A tier packed to the brim overflows
at the next step end, and the demotion that fixes a ~1k-token overflow moves a whole
~50k-token program, whose room the gate refills at once: one swap per step (generated
corpus, 80 programs: ~580 demotions/h, most victims back within 1 s, 17% of prompt tokens
recomputed). Demotion still triggers only above the budget, so the reserve is a band
between the promotion and the demotion watermarks. ACTING programs reserve nothing: most
idle ones are the victims, and reserving for them held GPU room empty on the idle-heavy
Claude Code sample.

On top of it, two stages: the space scheduler's partitions (`router.policy.space`: room
held for critical agent types, added to the band) and `BandWaiver` (`mori`: the part of
the band that programs in tool calls would absorb is not held).
"""

from __future__ import annotations

from router.policy.stages import Ledger
from router.policy.types import Placement, Status, Tier


class BandWaiver:
    """The part of the growth band that programs in tool calls would absorb.

    On a replica running at most `band_waiver_steps` steps, growth that GPU programs
    expected to stay in their tool call for longer than a step could make room for by
    leaving (the overflow demotion a step end would then make) is not held.

    The band keeps step ends from overflowing a brim-full tier. An overflow is cheap when
    its victim is idle for longer than the step that caused it, and the room the band
    holds is dear when few steps share the engine: one more program in a batch of two adds
    half again, in a batch of twenty, a twentieth, while step ends, each a possible
    overflow, come twenty at a time. Measured (simulated, docs/policy.md "The growth band
    gives way"): the README's demo cell (two steps per replica) 0.984 -> 1.007x Continuum
    over 12 seeds; the Claude Code sample +2 to +6 % at 50-80 programs; the generated
    corpora, which run 10-40 steps per replica, within 0.3 %. Without the step limit those
    lost up to 2 %; without the idleness test the Claude sample gained about half as much.
    """

    def __init__(self, engine: Ledger) -> None:
        self.engine = engine

    def waived(self, replica: str, growth: int, now: float) -> int:
        """Tokens of GPU(replica)'s growth band (`growth`: `Ledger.growth_band`) a promotion
        pass may use at `now`."""
        engine = self.engine
        if growth <= 0 or engine.reasoning_on(replica) > engine.config.band_waiver_steps:
            return 0
        return self._absorbable(replica, growth, now)

    def _absorbable(self, replica: str, up_to: int, now: float) -> int:
        """GPU(replica) room, up to `up_to`, held by ACTING programs an overflow demotion
        may take: unprotected, unmarked, and expected idle for longer than a step."""
        engine = self.engine
        protected = engine.timed.protected_until if engine.timed else {}
        expected_idle_s = engine.forecast.expected_idle_s  # type: ignore[union-attr]
        room = 0
        for q in engine.tiers.members(Placement(Tier.GPU, replica)):
            if room >= up_to:
                break
            if (
                q.status is Status.ACTING
                and q.program_id not in protected
                and q.demote_after_step is None
                and expected_idle_s(q, now) >= engine.step_s
            ):
                room += engine.tiers.freed_by(q)
        return min(room, up_to)
