"""Forecasting: when a program in a tool call comes back, and whether moving it pays.

Every priced rule of the engine (`router.policy.engine`) asks the same two questions of an
ACTING program: how long until its next request (the mean residual life of the tool call
it is in, given how long it has lasted: `router.policy.residual`, per tool key, learned
online by `DurationPredictor`), and what moving it off its GPU tier costs (its reload over
PCIe where its host copy survives, else its recompute, priced per replica from the
engine's own answers: `router.policy.prices`). A move pays when

    expected remaining idle time  >=  displace_margin x cost of bringing it back,

and, tool times being heavy-tailed, when the program stays away that long with at least
`displace_confidence` probability. The rungs of the ladder without priced moves
(`mori-paper`) run without a forecast.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np

from router.policy.predictor import DurationPredictor
from router.policy.program import Program
from router.policy.stages import Ledger
from router.policy.types import Status, Tier, ToolStart

UNKNOWN_TOOL = "unknown"  # a gap whose tool the router was not told
UNKNOWN_CALL = (None, UNKNOWN_TOOL)  # (agent, tool) of such a gap
RETURN_WAIT_ALPHA = 0.1  # weight of the newest return wait in `return_wait_s`


@dataclass(slots=True)
class ToolCall:
    """The tool call a program is in: what it is and when it is expected to end."""

    tool: str
    agent: str | None
    start_s: float
    predicted_s: float
    ended_s: float | None = None  # the client said it finished (on_tool_end)
    promote_tried: bool = False  # the predictive promotion done (one per call)

    @property
    def predicted_end_s(self) -> float:
        return self.start_s + self.predicted_s


class Forecast:
    """The tool calls programs are in, the durations learned from them, and move prices."""

    def __init__(self, engine: Ledger) -> None:
        self.engine = engine
        config = engine.config
        self.predictor = DurationPredictor(
            config.ewma_alpha, config.hint_alpha, time_scale=config.time_scale
        )
        self.calls: dict[str, ToolCall] = {}  # program -> the tool call it is in
        self._evicted_since: dict[str, float] = {}  # held requests of programs off the GPU
        self.return_wait_s = 0.0  # EWMA of those requests' gate waits (Continuum's T)

    # the calls ------------------------------------------------------------------------
    def tool_started(self, p: Program, call: ToolStart) -> None:
        """ACTING `p` starts `call`: its duration is predicted from its step's end."""
        predicted = self.predictor.predict(call.agent, call.tool, call.predict_s)
        self.calls[p.program_id] = ToolCall(call.tool, call.agent, p.interval_start, predicted)

    def request_came(self, program_id: str, p: Program | None, now: float) -> None:
        """The gap that just closed is one more observed tool duration; a program off the
        GPU starts waiting for room (`return_wait_s`)."""
        if p is not None and p.steps > 0 and p.status is Status.ACTING:
            self.observe_call(program_id, now)
            if p.placement.tier is not Tier.GPU:
                self._evicted_since[program_id] = now
        self.calls.pop(program_id, None)

    def observe_call(self, program_id: str, now: float) -> None:
        """The tool call of an ACTING program ended now (its next request came, or the
        client said so): feed its duration to the predictor, once."""
        p = self.engine.programs[program_id]
        call = self.calls.get(program_id)
        if call is None:
            self.predictor.observe(None, UNKNOWN_TOOL, now - p.interval_start)
        elif call.ended_s is None:
            call.ended_s = now
            self.predictor.observe(call.agent, call.tool, now - call.start_s, call.predicted_s)

    def started(self, p: Program, now: float) -> None:
        """A returning program that had lost its GPU room waited this long at the gate:
        what the next program moved off the GPU should expect to wait when it returns."""
        since = self._evicted_since.pop(p.program_id, None)
        if since is not None:
            a = RETURN_WAIT_ALPHA
            self.return_wait_s = a * (now - since) + (1 - a) * self.return_wait_s

    def gave_up(self, program_id: str) -> None:
        self._evicted_since.pop(program_id, None)

    def forget(self, program_id: str) -> None:
        self.calls.pop(program_id, None)
        self._evicted_since.pop(program_id, None)

    # expected idle time -----------------------------------------------------------------
    def expected_idle_s(self, p: Program, now: float) -> float:
        """Expected seconds until an ACTING program's next request."""
        return self.predictor.remaining_s(*self._current_call(p, now))

    def expected_idle_many(self, programs: list[Program], now: float) -> list[float]:
        """`expected_idle_s` of each of `programs` (ACTING) at once (`residuals`)."""
        return self.residuals(programs, [0.0] * len(programs), now)[0]

    def residuals(
        self, programs: list[Program], more_s: list[float], now: float
    ) -> tuple[list[float], list[float | None]]:
        """`DurationPredictor.residual` of the tool call each of `programs` (ACTING) is
        in, `more_s` apart: a tool's calls priced together, in numpy."""
        calls: dict[tuple[str | None, str], list[int]] = defaultdict(list)
        elapsed = []
        told = self.calls.get  # `_current_call`, inlined: this loop runs over a replica's
        for i, p in enumerate(programs):  # programs in tool calls, ~300 at 10,000 programs
            call = told(p.program_id)
            if call is None:
                calls[UNKNOWN_CALL].append(i)
                elapsed.append(now - p.interval_start)
            else:
                calls[call.agent, call.tool].append(i)
                elapsed.append(now - call.start_s)
        idle: list[float] = [0.0] * len(programs)
        stays: list[float | None] = [None] * len(programs)
        for (agent, tool), at in calls.items():
            got = self.predictor.residual_many(
                agent, tool, [elapsed[i] for i in at], [more_s[i] for i in at]
            )
            for i, left, stay in zip(at, *got, strict=True):
                idle[i], stays[i] = left, stay
        return idle, stays

    def _current_call(self, p: Program, now: float) -> tuple[str | None, str, float]:
        """(agent, tool, elapsed s) of the tool call ACTING `p` is in: an unknown tool since
        its step ended when the client did not say."""
        call = self.calls.get(p.program_id)
        if call is None:
            return None, UNKNOWN_TOOL, now - p.interval_start
        return call.agent, call.tool, now - call.start_s

    def idle_if_move_pays(self, p: Program, cost_s: float, now: float) -> float | None:
        """ACTING `p`'s expected idle seconds (`expected_idle_s`) if moving it off its GPU
        tier pays, else None. It pays if `p` stays away at least `cost_s` with probability
        `displace_confidence` or more, by its tool's learned duration distribution; without
        one (cold start), if its mean residual covers it. Agent tool times are heavy-tailed,
        so the mean residual is carried by rare long calls: moved on it, most victims came
        back well before it (3 replicas, real sample: median 9.8 s away against 27.8 s
        expected) and paid their recompute for nothing."""
        idle, stays = self.predictor.residual(*self._current_call(p, now), cost_s)
        return self._if_pays(idle, stays, cost_s)

    def idles_if_moves_pay(
        self, programs: list[Program], costs_s: list[float], now: float
    ) -> list[float | None]:
        """`idle_if_move_pays` of each of `programs` at once (`residuals`: a victim pool)."""
        idle, stays = self.residuals(programs, costs_s, now)
        return [self._if_pays(*args) for args in zip(idle, stays, costs_s, strict=True)]

    def _if_pays(self, idle: float, stays: float | None, cost_s: float) -> float | None:
        """`idle` if a move costing `cost_s` pays (`idle_if_move_pays`), else None."""
        pays = idle >= cost_s if stays is None else stays >= self.engine.config.displace_confidence
        return idle if pays else None

    # what a move costs ----------------------------------------------------------------------
    def host_room(self, replica: str) -> int:
        """Host DRAM tokens a CPU-tier program can really use on `replica`.

        HiCache writes every finished request through to host and never evicts the host
        copy of a block still on the GPU, so GPU-tier programs' backups hold host room
        the CPU tier cannot have: at a CPU ratio of 1 a full GPU tier leaves the CPU tier
        almost nothing, and a program "offloaded" there loses its host copy and recomputes.
        """
        tiers = self.engine.tiers
        # the CPU tier's budget less both tiers' use, without `budget`'s calls: pricing asks
        # per program (calling `free`/`budget` cost 1.5 % of an event's instructions)
        used = tiers.used(tiers.cpu_place[replica]) + tiers.used(tiers.gpu_place[replica])
        return tiers.capacity[replica].cpu_tokens - used

    def keeps_host_copy(self, p: Program, replica: str, room: int | None = None) -> bool:
        """Whether `p` keeps a host copy of its KV on `replica`'s CPU tier.

        A program on that replica's GPU tier has its copy there already (write-through)
        and `host_room` counts it: moving it to CPU changes no host usage, so it keeps
        the copy unless the host is over budget. Demanding its size in free host room on
        top, as before, counted it twice: victims on a full host were priced as
        recomputes, went to WAITING (whose host copies go first) and recomputed 40 % of
        their prompts on return (the README's demo cell, simulated). `room`: the replica's
        `host_room`, when the caller has it."""
        room = self.host_room(replica) if room is None else room
        if p.placement is self.engine.tiers.gpu_place[replica]:  # interned: identity
            return room >= 0
        return p.context_tokens <= room

    def victim_keeps_copy(self, q: Program, fresh: bool, room: int | None = None) -> bool:
        """Whether ACTING `q`, moved off its GPU tier to make room for a request, keeps its
        host copy. A request whose KV is in that replica's host tier brings no new host
        blocks (`keeps_host_copy`); one whose KV is written to host anew (`fresh`) takes
        about the room q frees, so q keeps its copy only if the host has that much free.
        `room`: the replica's `host_room`, when the caller has it (a victim pool asks for
        hundreds of programs of one replica)."""
        replica: str = q.placement.replica  # type: ignore[assignment]
        if fresh:
            return _fresh_keeps(q.context_tokens, self.host_room(replica) if room is None else room)
        return self.keeps_host_copy(q, replica, room)

    def recompute_cost_s(self, p: Program, replica: str) -> float:
        """Seconds prefilling `p`'s whole context on `replica` costs: once for `p` and once
        for every step running there, which the prefill batch stalls meanwhile."""
        return self._recompute_s(p.context_tokens, replica)

    def _recompute_s(self, tokens: Any, replica: str) -> Any:
        """`recompute_cost_s` of `tokens`: a count, or a numpy array of them (the prices'
        arithmetic runs element-wise, the same operations in the same order)."""
        engine = self.engine
        return engine.prices[replica].recompute_s(tokens) * (1 + engine.reasoning_on(replica))

    def move_costs_s(
        self, programs: list[Program], replica: str, fresh: bool, room: int
    ) -> list[float]:
        """`move_cost_s` of each of `programs` (ACTING on GPU(replica)), kept on host as
        `victim_keeps_copy` says with the host room `room`, in numpy (the same floats): a
        victim pool prices a replica's few hundred programs in tool calls at once."""
        tokens = np.array([p.context_tokens for p in programs], dtype=float)
        # on their GPU tier, as `keeps_host_copy` has it: kept unless the host is over budget
        kept = _fresh_keeps(tokens, room) if fresh else room >= 0
        reload = self.engine.prices[replica].reload_s(tokens)
        return np.where(kept, reload, self._lost_s(tokens, replica)).tolist()

    def move_cost_s(self, p: Program, kept_on_host: bool) -> float:
        """What moving `p` off its GPU tier costs, in seconds.

        Kept on host: the reload over PCIe, which overlaps the engine's work. The wait `p`
        may meet at the gate when it returns is matched by the wait the admitted request
        no longer has, and the room works now instead of idling: not a cost.

        Not kept: the recompute, which stalls every step running on the replica while it
        lasts (a prefill batch pauses decoding), so it counts once per running step and
        once for `p`; plus the gate wait programs moved off the GPU met lately, since
        under saturation such a move only trades one program's wait for another's and
        pays a prefill for it (generated corpus, 80 programs, CPU ratio 1: 245 tok/s
        without the two terms against 316 with them)."""
        replica: str = p.placement.replica  # type: ignore[assignment]
        if kept_on_host:
            return self.engine.prices[replica].reload_s(p.context_tokens)
        return self._lost_s(p.context_tokens, replica)

    def _lost_s(self, tokens: Any, replica: str) -> Any:
        """What a move that loses the host copy costs (`move_cost_s`): the recompute and the
        gate wait on return; of a count or a numpy array of them."""
        return self._recompute_s(tokens, replica) + self.return_wait_s


def _fresh_keeps(tokens: Any, room: int) -> Any:
    """Whether a victim of `tokens` keeps its host copy when the request it makes room for
    is written to host anew (`Forecast.victim_keeps_copy`); a count or a numpy array."""
    return tokens <= room
