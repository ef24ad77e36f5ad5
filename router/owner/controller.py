"""The imperative shell around the pure policy: clock, background loops, moves -> effects.

Every policy call goes through `Router.apply`, which turns the returned moves into
their effects: metrics, gate wake-ups and a hint push. Background loops drive the
periodic parts: rebalance ticks, full hint syncs, capacity refresh and health checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable, Collection, Coroutine
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from router.config import RouterConfig
from router.engines.outliers import Outliers
from router.engines.replicas import HintsUnsupported, Replica, make_replicas, make_upstream
from router.owner.gate import Gate
from router.owner.leadership import epoch_above, refused, reported_epoch
from router.owner.metrics import RouterMetrics
from router.owner.reconcile import Outcome, parse_residency, reconcile
from router.owner.sessions import Sessions
from router.policy import Policy, make_policy
from router.policy.runtime import AgentEvent, EventKind, PushPriorities, PushScores, Warm
from router.policy.types import Hint, Move, ReplicaCapacity, Status, Tier
from router.protocol.agent_identity import AnchorBook
from router.wire.upstream import UpstreamError

if TYPE_CHECKING:
    from router.protocol.link import Ticket

WARM_PREFIX = "mori-warm/"  # program ids of CacheSage warm-up requests

log = logging.getLogger("mori.router")

DEFAULT_CHARS_PER_TOKEN = 4.0
EMA_ALPHA = 0.3
LAG_PERIOD_S = 0.25  # the event loop's lag is sampled this often (wall seconds)
EARLY_EVENTS = 4  # client tool events a program's running step may hold back (the newest)

ToolEvent = Callable[[float], list[Move]]  # a policy call at `now` (on_tool_start, ...)


class Router:
    """State of one live router process: policy, replicas, gate, metrics, loops."""

    def __init__(
        self,
        config: RouterConfig,
        policy: Policy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock
        self._install(policy or make_policy(config.policy, config.policy_config()))
        self.metrics = RouterMetrics()
        self.gate = Gate(clock)
        self.outliers = Outliers(clock, config.stall_s, config.outlier_failures, config.eject_s)
        self.upstream = make_upstream(config)
        self.replicas = make_replicas(config, self.upstream)
        # told of every drain (url, why) and rejoin (url, None): the data-plane workers
        self.listeners: list[Callable[[str, str | None], None]] = []
        self.epoch = 0  # of the last hint batch (router/owner/leadership.py)
        self.active = False  # steers the replicas: took over, not refused since
        self._takeover: asyncio.Future[None] | None = None  # the takeover in progress
        self._terms = 0  # takeovers so far
        self.in_flight = 0
        self._chars_per_token: dict[str, float] = {}
        self._hints_dirty = asyncio.Event()
        # Busy-hint acknowledgement: hint push rounds started / finished, and the round each
        # freshly promoted program waits for before its request is forwarded.
        self._rounds_started = self._rounds_done = 0
        self._fenced = False  # a replica refused a batch of this term
        # One hint batch in flight at a time, so this router's batches reach each replica in
        # epoch order: a later one overtaking an earlier one (the hint loop's and a warm-up's,
        # a rejoin's full sync) would get the earlier refused as another router's.
        self._pushing = asyncio.Lock()
        self._rounds = asyncio.Condition()
        self._ack_round: dict[str, int] = {}
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()
        self._probes: dict[str, asyncio.Future[bool]] = {}  # health probe in flight per replica
        self.anchors = AnchorBook()
        self.sessions = Sessions()
        self._scores: dict[str, dict] = {}  # replica -> latest survival scores to push
        self._agents: dict[str, dict[str, str]] = {}  # replica -> program agents to push
        self._warming: set[str] = set()  # replicas with a warm-up in flight
        self._fresh_scores: set[str] = set()  # replicas whose scores changed since a push
        self._wakeup: asyncio.TimerHandle | None = None  # the policy's next extra tick
        self._wakeup_at = float("inf")
        # client tool events that overtook the report of their step's answer (tool_event)
        self._early: defaultdict[str, deque[ToolEvent]] = defaultdict(
            lambda: deque(maxlen=EARLY_EVENTS)
        )

    # lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Learn every replica's capacity (a down replica joins drained), start the loops."""
        results = await asyncio.gather(
            *(r.fetch_capacity(self.config.host_ratio) for r in self.replicas.values()),
            return_exceptions=True,
        )
        now = self.clock()
        for replica, result in zip(self.replicas.values(), results, strict=True):
            self.metrics.add_replica(replica.url)
            if isinstance(result, BaseException):
                log.warning("replica %s not reachable at start (%s): drained", replica.url, result)
                spec = replica.spec
                cap = ReplicaCapacity(spec.gpu_tokens or 0, spec.cpu_tokens or 0)
                self.policy.add_replica(replica.url, cap)
                self.apply(self.policy.set_healthy(replica.url, False, now))
            else:
                self.policy.add_replica(replica.url, result)
        loops = [self._tick_loop, self._capacity_loop, self._health_loop, self._lag_loop]
        if self.policy.sends_hints:
            loops += [self._hint_loop, self._reconcile_loop]
        if self.config.standby:
            log.warning("standby: taking over when traffic arrives")
        else:
            await self.ensure_active()
        self.metrics.refresh_tiers(self.policy)
        self._tasks = [asyncio.create_task(loop(), name=loop.__name__) for loop in loops]

    def spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        """Run a fire-and-forget job (an engine abort) that must outlive its request."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def stop(self) -> None:
        if self._wakeup is not None:
            self._wakeup.cancel()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._background:
            await asyncio.wait(self._background, timeout=2.0)
        for probe in list(self._probes.values()):  # a hung replica's probe: not waited for
            probe.cancel()
        self.upstream.close()

    # moves -> effects ---------------------------------------------------------------
    def apply(self, moves: list[Move]) -> None:
        """Record moves, let released requests through, schedule the hint push and the
        policy's next wake-up."""
        if moves:
            self.metrics.record_moves(moves)
            if self.policy.sends_hints:
                self._hints_dirty.set()
                for m in moves:
                    if m.to_gpu and m.src.tier is Tier.CPU:  # its busy hint loads KV back
                        self._ack_round[m.program_id] = self._rounds_started + 1
        self.gate.wake_all()
        self._schedule_wakeup()
        if self._actions is not None:
            self._carry_out(self._actions(self.clock()))

    # agent runtime layer ------------------------------------------------------------------
    @property
    def wants_anchors(self) -> bool:
        """Whether requests' anchors must reach the owner (a runtime-layer policy warms
        them); the workers leave them out of the ticket otherwise."""
        return self._observe is not None

    def identify(self, ticket: Ticket) -> Ticket:
        """File the request's program in the sessions book: the ticket comes back with its
        parent (the one it named, else its session's main program). Session headers it
        sent that could not be used are counted."""
        if ticket.identity is not None:
            for header in ticket.identity.ignored:
                self.metrics.count(self.metrics.identity_ignored, header)
        parent = self.sessions.admit(ticket.program_id, ticket.identity, ticket.parent)
        return ticket if parent == ticket.parent else ticket._replace(parent=parent)

    def observe_request(self, ticket: Ticket) -> None:
        """Tell a runtime-layer policy who is asking (before `on_request`)."""
        if self._observe is None:
            return
        if ticket.agent and ticket.anchor is not None:
            self.anchors.remember(ticket.agent, ticket.anchor)
        tokens = ticket.anchor.tokens if ticket.anchor is not None else 0
        event = AgentEvent(
            EventKind.REQUEST,
            self.clock(),
            ticket.program_id,
            ticket.agent,
            None,
            tokens,
            app=ticket.app,
        )
        self._observe(event if ticket.parent is None else replace(event, parent=ticket.parent))

    def _carry_out(self, actions: list) -> None:
        """Scores ride with the next hint push; a warm-up goes out when no request waits at
        the gate and the replica has none in flight (it never delays a waiting request)."""
        for action in actions:
            if isinstance(action, PushScores):
                self._scores[action.replica] = dict(action.scores)
                self._fresh_scores.add(action.replica)
                self._agents.setdefault(action.replica, {}).update(action.agents)
                self._hints_dirty.set()
            elif isinstance(action, PushPriorities):
                self._push_critical(action)
            elif isinstance(action, Warm) and action.replica in self.replicas:
                anchor = self.anchors.get(action.agent)
                if anchor is None or self.gate.waiting or action.replica in self._warming:
                    continue
                self._warming.add(action.replica)
                self.spawn(self._warm(self.replicas[action.replica], action.agent, anchor))

    def _push_critical(self, action: PushPriorities) -> None:
        """The space scheduler on the engine: the engine patch has no admission priorities,
        so critical agent types ride CacheSage's survival scores (1.0: within a hint type,
        their KV is evicted last) with the programs' agent types."""
        self._scores.setdefault(action.replica, {})
        if action.critical is not None:
            self._scores[action.replica] = dict.fromkeys(sorted(action.critical), 1.0)
            self._fresh_scores.add(action.replica)
        self._agents.setdefault(action.replica, {}).update(action.agents)
        self._hints_dirty.set()

    async def _warm(self, replica: Replica, agent: str, anchor) -> None:
        """Send the anchor with a one-character question and one output token (CacheSage
        §3.4); then type the warm-up program inactive so it never ranks the anchor busy."""
        program_id = WARM_PREFIX + agent
        body = {"model": "default", **anchor.warm_body(program_id)}
        try:
            timeout_s = self.config.health_timeout_s * 4
            status, _ = await self.upstream.call_json(
                replica.url, b"POST", b"/v1/chat/completions", body, timeout_s
            )
            outcome = "ok" if status == 200 else f"http_{status}"
            if status == 200 and replica.hints_supported and self.active:
                async with self._pushing:
                    self.epoch += 1
                    batch = {program_id: Hint.INACTIVE}
                    answer = await replica.push_hints(self.epoch, batch, False)
                if refused(answer):
                    self.step_down(replica.url, answer)
        except (UpstreamError, ValueError, HintsUnsupported) as e:
            outcome = type(e).__name__
        finally:
            self._warming.discard(replica.url)
        self.metrics.warmups.labels(replica.url, outcome).inc()

    def _schedule_wakeup(self) -> None:
        """Predictive policies need ticks between periods (`next_wakeup`, e.g. a load-back
        just before a predicted tool end). One timer is pending at most: an earlier time
        replaces it, a later one waits until it fired (its tick asks again)."""
        if self._next_wakeup is None:
            return
        now = self.clock()
        at = self._next_wakeup(now)
        if at is None or (self._wakeup is not None and self._wakeup_at <= at):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # driven outside the event loop: the tick loop covers it
            return
        if self._wakeup is not None:
            self._wakeup.cancel()
        self._wakeup_at = at
        self._wakeup = loop.call_later(max(0.0, at - now), self._on_wakeup)

    def _on_wakeup(self) -> None:
        self._wakeup, self._wakeup_at = None, float("inf")
        try:
            self.tick()  # applies the moves, which schedules the next wake-up
        except Exception:  # like the tick loop: one failure is logged, never fatal
            log.exception("policy wake-up failed")

    # token estimates ----------------------------------------------------------------
    def estimate_tokens(self, program_id: str, chars: int) -> int:
        return max(1, int(chars / self._chars_per_token.get(program_id, DEFAULT_CHARS_PER_TOKEN)))

    def learn_tokens(self, program_id: str, chars: int, prompt_tokens: int) -> None:
        """Per-program EMA of characters per prompt token (tokenisers differ by content)."""
        if prompt_tokens <= 0 or chars <= 0:
            return
        sample = chars / prompt_tokens
        old = self._chars_per_token.get(program_id)
        self._chars_per_token[program_id] = (
            sample if old is None else EMA_ALPHA * sample + (1 - EMA_ALPHA) * old
        )

    # client tool events -----------------------------------------------------------------
    def tool_event(self, program_id: str, event: ToolEvent) -> None:
        """A tool start or end the client told (`POST /v1/programs/{id}/tool_start`), in
        the program's own order.

        An agent posts it as soon as it has read its answer, which can be before the
        worker's report of that answer reaches the owner (the worker reports once the
        engine's stream has closed, and on a link that batches reports). The policy
        records a tool call only for an ACTING program, so such an event was dropped:
        live, 15-42 % of tool starts, and moves were then priced without the tool's
        duration. One that overtakes its step is held until the step's response
        (`step_ended`) instead."""
        p = self.policy.programs.get(program_id)
        if p is not None and p.status is Status.REASONING:
            self._early[program_id].append(event)
            return
        self.apply(event(self.clock()))

    def step_ended(self, program_id: str) -> None:
        """After `on_response`: the client's tool events that overtook it, in order."""
        events = self._early.pop(program_id, None)
        for event in events or ():
            self.apply(event(self.clock()))

    def end_program(self, program_id: str) -> bool:
        """Forget the program; a request of it held at the gate is answered at once."""
        if program_id not in self.policy.programs:
            return False
        self.apply(self.policy.end(program_id, self.clock()))
        self.gate.end(program_id)
        self._early.pop(program_id, None)
        self._chars_per_token.pop(program_id, None)
        return True

    # replica failures -------------------------------------------------------------
    def reachable(self) -> bool:
        """Whether any replica is in service (healthy and not drained)."""
        return any(self.policy.tiers.healthy.values())

    def drain(self, replica: Replica, why: str, reason: str) -> None:
        """Take a replica out: its programs go to WAITING and are re-placed, its silent
        requests are cut (they fail over or end with an error), and it stays out for the
        outlier back-off before a passing health check may readmit it."""
        if not self.policy.tiers.healthy.get(replica.url, False):
            return
        span = self.outliers.eject(replica.url)
        log.warning("replica %s drained for at least %.0f s: %s", replica.url, span, why)
        replica.failures = max(replica.failures, self.config.health_failures)
        self.apply(self.policy.set_healthy(replica.url, False, self.clock()))
        self.metrics.replica_healthy.labels(replica.url).set(0)
        self.metrics.ejections.labels(replica.url, reason).inc()
        self._tell(replica.url, f"replica drained: {why}")

    def _tell(self, url: str, why: str | None) -> None:
        for listener in self.listeners:
            listener(url, why)

    async def _rejoin(self, replica: Replica) -> None:
        try:
            cap = await replica.fetch_capacity(self.config.host_ratio)
        except (UpstreamError, ValueError) as e:
            log.info("replica %s healthy but capacity unknown: %s", replica.url, e)
            return
        self.policy.set_capacity(replica.url, cap)
        log.warning("replica %s rejoined", replica.url)
        self.apply(self.policy.set_healthy(replica.url, True, self.clock()))
        self.metrics.replica_healthy.labels(replica.url).set(1)
        self._tell(replica.url, None)
        if self.policy.sends_hints and self.active:
            await self.sync_hints(full=True)

    # loops -------------------------------------------------------------------------
    async def _every(self, period: float, step: Callable[[], object]) -> None:
        """Run `step` every `period` seconds; one failure is logged, never fatal."""
        while True:
            await asyncio.sleep(period)
            try:
                result = step()
                if asyncio.iscoroutine(result):
                    await result
            except Exception:  # a loop must survive anything one step throws
                log.exception("background step %s failed", getattr(step, "__name__", step))

    async def _lag_loop(self) -> None:
        """How late the event loop runs a timer, every LAG_PERIOD_S: the gate, the ticks
        and the door act on this loop's clock, so a lagging loop (a busy router, a slow
        machine) holds steps longer than the policy decided."""
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time() + LAG_PERIOD_S
            await asyncio.sleep(LAG_PERIOD_S)
            self.metrics.observe(self.metrics.loop_lag, max(0.0, loop.time() - asked))

    async def _tick_loop(self) -> None:
        await self._every(self.config.tick_s, self.tick)

    def tick(self) -> None:
        started = time.perf_counter()
        now = self.clock()
        self.apply(self.policy.tick(now))
        if len(self._chars_per_token) > len(self.policy.programs):  # ended by lease expiry
            live = self.policy.programs
            self._chars_per_token = {p: r for p, r in self._chars_per_token.items() if p in live}
        self.metrics.tick_seconds.observe(time.perf_counter() - started)
        self.metrics.refresh_tiers(self.policy)
        self.metrics.observe_idleness(self.policy, now)
        self.metrics.gate_waiting.set(self.gate.waiting)

    async def _capacity_loop(self) -> None:
        await self._every(self.config.capacity_refresh_s, self.refresh_capacity)

    async def refresh_capacity(self) -> None:
        for replica in self.replicas.values():
            if not self.policy.tiers.healthy[replica.url]:
                continue
            try:
                cap = await replica.fetch_capacity(self.config.host_ratio)
            except (UpstreamError, ValueError) as e:
                log.info("capacity refresh of %s failed: %s", replica.url, e)
                continue
            if cap != self.policy.tiers.capacity.get(replica.url):
                self.policy.set_capacity(replica.url, cap)

    async def _health_loop(self) -> None:
        await self._every(self.config.health_interval_s, self.check_health)

    async def check_health(self) -> None:
        """Tolerant of long prefills: only `health_failures` misses in a row drain."""
        replicas = list(self.replicas.values())
        results = await asyncio.gather(*(r.healthy() for r in replicas))
        for replica, ok in zip(replicas, results, strict=True):
            healthy = self.policy.tiers.healthy[replica.url]
            if ok:
                replica.failures = 0
                if not healthy and self.outliers.may_rejoin(replica.url):
                    await self._rejoin(replica)
                continue
            replica.failures += 1
            if healthy and replica.failures >= self.config.health_failures:
                self.drain(replica, f"{replica.failures} failed health checks", "health")

    def on_silent(self, url: str) -> None:
        """A worker's requests on a healthy replica have been silent for `stall_s`: probe
        it (at most once per `stall_s`) and drain it if the probe fails."""
        replica = self.replicas.get(url)
        if replica is None or not self.policy.tiers.healthy.get(url, False):
            return
        if self.outliers.due_probe(url):
            silence = f"no byte for {self.config.stall_s:g} s with requests in flight"
            self.spawn(self.confirm(replica, silence, "stalled"))

    def probe(self, replica: Replica) -> asyncio.Future[bool]:
        """The replica's health probe: one in flight at a time, shared by all who ask."""
        probe = self._probes.get(replica.url)
        if probe is None:
            probe = self._probes[replica.url] = asyncio.ensure_future(self._probe(replica))
            probe.add_done_callback(lambda _: self._probes.pop(replica.url, None))
        return probe

    async def _probe(self, replica: Replica) -> bool:
        """Two stages: is the process there at all (`probe_timeout_s`: a stopped or hung
        replica fails here, within the fault bound), then is the engine healthy
        (`health_timeout_s`: a live HTTP server in front of a wedged scheduler fails here)."""
        return await replica.alive(self.config.probe_timeout_s) and await replica.healthy()

    async def confirm(self, replica: Replica, why: str, reason: str) -> bool:
        """After a sign that may be the request's doing as much as the replica's: drain
        the replica only if its probe fails too. True when it was drained."""
        if await asyncio.shield(self.probe(replica)):
            return False
        self.drain(replica, f"{why}; health probe failed", reason)
        return True

    # residency -------------------------------------------------------------------------
    async def _reconcile_loop(self) -> None:
        async def flushed_then_reconciled() -> None:
            await self._hints_flushed()
            await self.reconcile()

        await self._every(self.config.reconcile_s, flushed_then_reconciled)

    async def _hints_flushed(self) -> None:
        """Until a hint round begun now was answered (at most `hint_ack_timeout_s`): the
        engines have then heard `inactive` for every program ended so far, which reconcile
        would otherwise read as held, named and unknown, and adopt back."""
        needed = self._rounds_started + 1
        self._hints_dirty.set()
        await self._round_done(needed)

    async def reconcile(self) -> None:
        """Check the tiers against every healthy replica's `/mori/residency`
        (router/owner/reconcile.py); a replica that does not answer is left out this time,
        and a program that ends while the engines are read is not adopted back. A standby
        holds no tiers: it reads the residency when it takes over."""
        if self.active:
            known = set(self.policy.programs)
            docs = await self._residency()
            self._reconciled(docs, ended=known - self.policy.programs.keys())

    async def _residency(self) -> dict[str, Any]:
        """url -> `/mori/residency` answer of every healthy replica that gave one."""
        urls = [u for u in self.replicas if self.policy.tiers.healthy.get(u)]
        docs = await asyncio.gather(
            *(self.replicas[u].fetch_residency() for u in urls), return_exceptions=True
        )
        return {
            url: doc
            for url, doc in zip(urls, docs, strict=True)
            if not isinstance(doc, BaseException)
        }

    def _reconciled(
        self, docs: dict[str, Any], waiting: bool = False, ended: Collection[str] = ()
    ) -> Outcome:
        """Reconcile the tiers with the residency `docs` (`waiting`: a takeover, which adopts
        the programs held in WAITING too; `ended`: programs ended while the docs were read,
        never adopted back); log and count what changed."""
        views = {url: parse_residency(url, doc) for url, doc in docs.items()}
        outcome = reconcile(self.policy, views, self.clock(), waiting, ended)
        if outcome.adopted or outcome.lost:
            log.warning(
                "residency: adopted %d programs the engines hold (%s), %d CPU-tier programs "
                "lost their host copy",
                len(outcome.adopted),
                ", ".join(sorted(outcome.adopted)[:5]),
                len(outcome.lost),
            )
            self.metrics.reconciled.labels("adopted").inc(len(outcome.adopted))
            self.metrics.reconciled.labels("lost").inc(len(outcome.lost))
            self.metrics.refresh_tiers(self.policy)
        return outcome

    # leadership (router/owner/leadership.py) -----------------------------------------------
    async def ensure_active(self) -> None:
        """Traffic reached this router (or it starts alone): be the active router before
        admitting it. Concurrent requests share one takeover."""
        if self.active:
            return
        if self._takeover is None or self._takeover.done():
            self._takeover = asyncio.ensure_future(self._take_over())
        await asyncio.shield(self._takeover)

    async def _take_over(self) -> None:
        """Rebuild the tiers from the replicas' residency, fence every earlier router with
        an epoch of a new term, then admit. A router that was active before starts from a
        fresh policy: what it knew may have changed under the other router."""
        started = time.perf_counter()
        if self._terms:
            self._install(self._fresh_policy())
        adopted = 0
        if self.policy.sends_hints:
            docs = await self._residency()
            adopted = len(self._reconciled(docs, waiting=True).adopted)
            self.epoch = epoch_above(reported_epoch(doc) for doc in docs.values())
            self._fenced = False
            await self.sync_hints(full=True)  # the replicas refuse every older epoch now
            if self._fenced:  # a router with a higher term took over meanwhile
                return
        self.active = True
        self._terms += 1
        took = time.perf_counter() - started
        self.metrics.takeovers.inc()
        self.metrics.takeover_seconds.observe(took)
        self.metrics.active.set(1)
        quiet = not self.config.standby and self._terms == 1  # a lone router's start
        log.log(
            logging.INFO if quiet else logging.WARNING,
            "active: took over at epoch %d in %.3f s (%d programs adopted from the replicas)",
            self.epoch,
            took,
            adopted,
        )

    def step_down(self, url: str, answer: Any) -> None:
        """A replica refused our batch: another router took over. Push nothing more, and
        answer the held requests (they retry through the proxy, to the active router)."""
        self._fenced = True
        if not self.active:
            return
        self.active = False
        self.metrics.active.set(0)
        self.metrics.step_downs.inc()
        log.warning(
            "standby: replica %s refused epoch %d (it applied %d): another router took over",
            url,
            self.epoch,
            reported_epoch(answer),
        )
        self.gate.wake_all()

    def _install(self, policy: Policy) -> None:
        self.policy = policy
        can = policy.capabilities  # what the policy answers beyond the event interface
        self._next_wakeup = policy.next_wakeup if can.wakeups else None
        # agent runtime layer (CacheSage, apps, rounds): events in, actions out
        self._observe = policy.observe if can.observes else None
        self._actions = policy.runtime_actions if can.acts else None

    def _fresh_policy(self) -> Policy:
        """An empty policy over the same replicas (capacity, health); the old policy's
        pending per-program state goes with it."""
        old, now = self.policy, self.clock()
        fresh = make_policy(self.config.policy, self.config.policy_config())
        for url, capacity in old.tiers.capacity.items():
            fresh.add_replica(url, capacity)
            if not old.tiers.healthy[url]:
                fresh.set_healthy(url, False, now)
        for pending in (self._early, self._ack_round, self._scores, self._agents):
            pending.clear()
        self._fresh_scores = set()
        return fresh

    # hints ---------------------------------------------------------------------------
    async def _hint_loop(self) -> None:
        """Push changed hints right after moves; a full sync every `hint_sync_s` repairs drift."""
        next_full = self.clock() + self.config.hint_sync_s
        while True:
            timeout = max(0.0, next_full - self.clock())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._hints_dirty.wait()
            full = self.clock() >= next_full
            if full:
                next_full = self.clock() + self.config.hint_sync_s
            if not self.active:  # a standby steers nothing
                self._hints_dirty.clear()
                continue
            try:
                await self.sync_hints(full=full)
            except Exception:
                log.exception("hint push failed")

    def hint_acked(self, program_id: str) -> Awaitable[None] | None:
        """What to await until the hint push that carries `program_id`'s promotion (its
        `busy` hint) has been answered, so the engine loads its KV back before the request
        arrives rather than racing it; None when nothing is pending (most requests)."""
        needed = self._ack_round.pop(program_id, None)
        if needed is None or self._rounds_done >= needed:
            return None
        return self._ack_wait(needed)

    async def _ack_wait(self, needed: int) -> None:
        """Bounded by `hint_ack_timeout_s`: a slow engine delays the hint, never the
        request, for longer."""
        started = self.clock()
        await self._round_done(needed)
        self.metrics.hint_ack_wait.observe(self.clock() - started)

    async def _round_done(self, needed: int) -> None:
        """Until hint round `needed` was answered, at most `hint_ack_timeout_s`."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.hint_ack_timeout_s), self._rounds:
                await self._rounds.wait_for(lambda: self._rounds_done >= needed)

    async def sync_hints(self, full: bool) -> None:
        self._rounds_started += 1
        round_no = self._rounds_started
        try:
            async with self._pushing:
                await self._sync_hints(full)
        finally:
            async with self._rounds:
                self._rounds_done = max(self._rounds_done, round_no)
                self._rounds.notify_all()

    async def _sync_hints(self, full: bool) -> None:
        self._hints_dirty.clear()
        batches = self.policy.hints() if full else self.policy.hint_updates()
        if full:
            self.policy.hint_updates()  # the full batch supersedes pending deltas
        extras = self._score_extras(full)
        self.epoch += 1
        jobs = [
            self._push(self.replicas[url], batches.get(url, {}), full, extras.get(url))
            for url in batches.keys() | extras.keys()
            if url in self.replicas
            and (batches.get(url) or full or extras.get(url))
            and self.policy.tiers.healthy[url]
        ]
        await asyncio.gather(*jobs)

    def _score_extras(self, full: bool) -> dict[str, dict]:
        """CacheSage's fields per replica: the latest scores (again at a full sync) and the
        program agents not sent yet."""
        out: dict[str, dict] = {}
        for url, scores in self._scores.items():
            agents = self._agents.pop(url, {})
            if full or agents or url in self._fresh_scores:
                out[url] = {"scores": scores, "agents": agents}
        self._fresh_scores = set()
        return out

    async def _push(
        self, replica: Replica, hints: dict[str, Hint], full: bool, extra: dict | None = None
    ) -> None:
        if not replica.hints_supported and not full:
            return
        try:
            answer = await replica.push_hints(self.epoch, hints, full, extra)
        except HintsUnsupported:
            if replica.hints_supported:
                log.warning("replica %s has no /mori/hints: serving without hints", replica.url)
            replica.hints_supported = False
            self.metrics.hint_unsupported.labels(replica.url).inc()
            self.metrics.hint_pushes.labels(replica.url, "unsupported").inc()
            return
        except (UpstreamError, ValueError) as e:
            log.info("hint push to %s failed: %s", replica.url, e)
            self.metrics.hint_pushes.labels(replica.url, "error").inc()
            return
        replica.hints_supported = True
        if refused(answer):
            self.metrics.hint_pushes.labels(replica.url, "stale").inc()
            self.step_down(replica.url, answer)
            return
        self.metrics.hint_pushes.labels(replica.url, "ok").inc()
