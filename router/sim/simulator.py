"""Discrete-event simulation of closed-loop agent clients, a policy and simulated replicas.

One run = one cell of a comparison (policy x concurrency x CPU ratio). Everything happens
on a virtual clock held in an event heap:

- `concurrency` closed-loop clients each replay one program from the corpus (send a step,
  wait for the response, sleep its `tool_s`, send the next), then take the next program
  (the corpus is shuffled once by the seed and cycled). A program's subagents
  (`parent_id`) run as extra clients from parent start + `start_s`.
- The policy is driven exactly as `router.policy.base` describes: `on_request` at arrival
  (prompt tokens as the context estimate), `route` forwards or the request waits at the
  gate until a later call's moves release it, `on_response` with input+output tokens,
  `on_tool_start` after each non-final response, `tick` every `tick_s`, `end` after a
  program's last step. After every call its hint updates go to the engines (when the
  policy `sends_hints`); engines evict the way `policy.engine_mode` says.
- Each replica is a `router.sim.model.ReplicaEngine`; the heap holds one entry per replica
  for its next internal event (stale entries are skipped), so decode costs one event per
  batch change, not one per token.

Each finished step becomes a `StepRecord` (TTFT from arrival at the router, so gate time
counts); GPU KV utilisation is the time-weighted share of device KV held by running
requests (SGLang's `token_usage`); `summarize` reduces the run.
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from functools import cache, partial
from statistics import fmean
from typing import get_type_hints

from pydantic import TypeAdapter, ValidationError

from kernels.costs import restore_cost
from router.policy import Policy, PolicyConfig, make_policy
from router.policy.runtime import AgentEvent, EventKind, PushPriorities, PushScores, Warm
from router.policy.types import ReplicaCapacity, Segment
from router.presets import Preset, get_preset
from router.replay.corpus import ClosedLoopCorpus, HandOffs
from router.replay.records import RunResult, StepRecord, summarize
from router.replay.retries import MAX_RETRIES, ClientRetries
from router.replay.trace import TraceProgram, TraceStep
from router.sim.approx import ApproxReuse, ApproxStore
from router.sim.model import CostModel, Done, FirstToken, ReplicaEngine, SharedPrefix
from router.sim.segments import PromptBlocks


def prefill_s_per_token(preset: Preset) -> float:
    """The recompute price a policy starts from (then it learns the engine's): one token's
    prefill at no context."""
    return CostModel(preset).prefill_s(1, 0)


@cache
def _knob_adapters() -> dict[str, tuple[TypeAdapter, object]]:
    """One validator per PolicyConfig field, built once (a matrix builds a SimConfig a run)."""
    return {name: (TypeAdapter(kind), kind) for name, kind in get_type_hints(PolicyConfig).items()}


def policy_knob(name: str, value: object) -> object:
    """`value` as PolicyConfig's field `name` (a known one: the callers check names first)
    takes it (60 for a float is 60.0), or a ValueError that names the knob: the dataclass
    checks no types, and a wrong one (a fractional window, a word for a price) crashed
    inside a worker's first step."""
    adapter, kind = _knob_adapters()[name]
    try:
        return adapter.validate_python(value)
    except ValidationError as e:
        problem = e.errors()[0]["msg"]
        raise ValueError(
            f"{name}={value!r}: {problem} ({getattr(kind, '__name__', kind)})"
        ) from None


@dataclass(frozen=True)
class SimConfig:
    """One simulated run. `policy_config` keys are PolicyConfig fields (window, tick_s...)."""

    policy: str = "mori"
    preset: str = "h100-8b"
    replicas: int = 1
    concurrency: int = 80
    cpu_ratio: float = 1.0
    duration_s: float = 3600.0
    token_scale: float = 1.0
    seed: int = 0
    start_jitter_s: float = 5.0  # clients start uniformly over this span, not all at t=0
    policy_config: dict = field(default_factory=dict)
    gpu_tokens: int | None = None  # device KV budget per replica (None: the preset's)
    app_graphs: bool = True  # apps register their trace `graph` (False: the policy infers it)
    # open loop: tasks per second, Poisson (Tokencake §7.1); None: `concurrency` closed-loop
    # clients. The run then continues until every task that arrived is answered.
    arrival_rate: float | None = None
    # TokenDance's approximate reuse of gathered blocks, modelled (router.sim.approx); None:
    # exact, what SGLang does
    approx: ApproxReuse | None = None
    # the live gate: a request held this long is answered 503 and the client retries as
    # the SDKs do (router.replay.retries), `client_retries` times before the step fails
    gate_timeout_s: float = 300.0
    client_retries: int = MAX_RETRIES
    # the hop between the router and an engine, one way (trace seconds): a forwarded
    # request reaches its engine this much later, and a finished step its client and the
    # router. 0: the router sits in the engine. The live stack's is its wall latency times
    # the time scale (the demo's: ~3 ms x 5 on a 2-vCPU box, docs/simulator.md "The hop")
    hop_s: float = 0.0

    def __post_init__(self) -> None:
        get_preset(self.preset)  # fail early with the list of known presets
        checks = {
            "replicas": self.replicas >= 1,
            "concurrency": self.concurrency >= 1,
            "cpu_ratio": self.cpu_ratio >= 0,
            "duration_s": self.duration_s > 0,
            "token_scale": self.token_scale > 0,
            "start_jitter_s": self.start_jitter_s >= 0,
            "gpu_tokens": self.gpu_tokens is None or self.gpu_tokens > 0,
            "arrival_rate": self.arrival_rate is None or self.arrival_rate > 0,
            "gate_timeout_s": self.gate_timeout_s > 0,
            "client_retries": self.client_retries >= 0,
            "hop_s": self.hop_s >= 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name} out of range: {getattr(self, name)}")
        known = {f.name for f in fields(PolicyConfig)} - {"time_scale"}  # a live clock's
        unknown = sorted(set(self.policy_config) - known)
        if unknown:
            hint = " (the simulator's clock is the trace's)" if unknown[0] == "time_scale" else ""
            raise ValueError(f"unknown policy setting {unknown[0]!r}{hint}; known: {sorted(known)}")
        settings = {k: policy_knob(k, v) for k, v in self.policy_config.items()}
        policy = PolicyConfig(**settings)
        # the simulator's clock ticks every tick_s and ends silent programs after lease_s:
        # at 0 or less it stood still (a hang, not an error); a driver of the policy itself
        # may tick at 0 (every call a full rebalance)
        for name in ("tick_s", "lease_s"):
            if not getattr(policy, name) > 0:
                raise ValueError(
                    f"{name} must be > 0 in the simulator, got {getattr(policy, name)}"
                )
        if policy.window < 1:
            raise ValueError(f"window must be >= 1 cycle, got {policy.window}")
        object.__setattr__(self, "policy_config", settings)


@dataclass(slots=True)
class _Client:
    """One replaying program instance (a main program or a subagent)."""

    pid: str  # unique per replay of a trace program
    program: TraceProgram
    parent: str | None = None  # pid of the parent instance (subagents)
    session: str = ""  # pid of the root instance: the task a subagent works on
    step: int = 0
    first_arrival: float | None = None  # the current step's first attempt
    retries: int = 0  # the current step's attempts repeated after a gate timeout
    refusals: int = 0  # times the current step (a start) was told to come back
    prompt: tuple[Segment, ...] = ()  # the current step's named blocks (kept for retries)


@dataclass(slots=True)
class _Request:
    client: _Client
    rid: str
    arrival: float
    step: TraceStep
    replica: str | None = None
    forwarded: float = 0.0  # left the gate for an engine
    first_token: float | None = None
    cached: tuple[int, int] = (0, 0)


# event kinds, ordered so that at equal times engines finish before clients act
_ENGINE, _TICK, _ARRIVE, _SPAWN, _WAKE, _TIMEOUT, _HOPPED = range(7)
GATE_RETRY_AFTER_S = 5.0  # the Retry-After of the gate's 503 (the router's tick, 5 s)
DRAIN_X = 1.0  # open loop: the run may go on this x duration_s for the last tasks to finish


class Simulation:
    """A single run; `run()` returns the cell's RunResult."""

    def __init__(self, corpus: list[TraceProgram], config: SimConfig) -> None:
        self.config = config
        self.corpus = ClosedLoopCorpus(corpus, config.token_scale, config.seed)
        self.rng = self.corpus.rng
        self.preset = get_preset(config.preset)
        self.rids = itertools.count()
        self.seq = itertools.count()
        self.heap: list[tuple[float, int, int, object]] = []
        self.now = 0.0
        self.records: list[StepRecord] = []
        self.inflight: dict[str, _Request] = {}  # rid -> request in an engine
        self.gated: dict[str, _Request] = {}  # pid -> request held by the gate
        self.moves: Counter[str] = Counter()  # by reason
        self.wake_at: float | None = None  # extra tick the policy asked for (next_wakeup)
        self._util_area = 0.0
        self._util_t = 0.0
        self._running_area = 0.0
        self._decoding_area = 0.0
        self._tasks_area = 0.0  # task-seconds in flight (open loop: mean tasks in flight)
        self.tasks_live = 0  # main programs started and not ended
        self._arrivals_left = 0  # open loop: tasks still to arrive
        self._forwarded: list[_Request] = []
        self.clients: dict[str, _Client] = {}  # live program instances by pid
        self.handoffs = HandOffs()  # steps of a task that other programs' steps wait for
        self.warms: Counter[str] = Counter()  # warm-up outcomes (engine answers)
        self._kv_samples: list[float] = []  # stored KV tokens per live agent, each tick
        self.blocks = PromptBlocks()  # named prompt blocks of every live program instance
        self.approx = None
        if config.approx is not None:
            restore = restore_cost(self.preset.kv_bytes_per_token, self.preset.kv_read_bytes_s)
            self.approx = ApproxStore(config.approx, restore.fused_s_per_token)
        self._build_policy_and_engines()
        can = self.policy.capabilities  # what it answers beyond the event interface
        self._observe = self.policy.observe if can.observes else None
        self._actions = self.policy.runtime_actions if can.acts else None
        # graph-aware policies (mori+space): apps register their graph when first seen
        self._register = self.policy.register_app if can.apps and config.app_graphs else None
        self._wakeup = self.policy.next_wakeup if can.wakeups else None
        self.apps: set[str] = set()
        self.retries = ClientRetries(config.client_retries)
        self._retry_rng = random.Random(f"retries-{config.seed}")  # the corpus' stream stays

    def _build_policy_and_engines(self) -> None:
        cfg = self.config
        pc = {
            "load_s_per_token": self.preset.kv_bytes_per_token / self.preset.pcie_bytes_s,
            "prefill_s_per_token": prefill_s_per_token(self.preset),
            "attention_tokens": self.preset.attention_tokens,
            "gate_timeout_s": cfg.gate_timeout_s,
        }
        pc.update(cfg.policy_config)
        self.policy: Policy = make_policy(cfg.policy, PolicyConfig(**pc))
        mode = self.policy.engine_mode
        gpu = cfg.gpu_tokens or self.preset.gpu_kv_tokens
        host = int(cfg.cpu_ratio * gpu)
        self.engines: dict[str, ReplicaEngine] = {}
        self.scheduled: dict[str, float | None] = {}
        for i in range(cfg.replicas):
            name = f"r{i}"
            self.engines[name] = ReplicaEngine(self.preset, mode, gpu, host)
            self.scheduled[name] = None
            self.policy.add_replica(name, ReplicaCapacity(gpu, host if mode.host_tier else 0))

    # heap ------------------------------------------------------------------------------
    def _push(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self.heap, (t, kind, next(self.seq), payload))

    def _schedule_engine(self, name: str) -> None:
        nt = self.engines[name].next_event_time()
        if nt is not None:
            nt = max(nt, self.now)
            if nt != self.scheduled[name]:
                self.scheduled[name] = nt
                self._push(nt, _ENGINE, name)

    # run ---------------------------------------------------------------------------------
    def run(
        self,
        progress: Callable[[float], None] | None = None,
        probe: Callable[[Simulation], None] | None = None,
    ) -> RunResult:
        """Simulate `duration_s` virtual seconds (open loop: then until the tasks that
        arrived are answered, at most `DRAIN_X` x longer); `progress(fraction)` now and
        then; `probe(self)` at every tick (bench/live_vs_sim.py samples the state)."""
        started = time.perf_counter()
        cfg = self.config
        horizon = cfg.duration_s
        if cfg.arrival_rate is None:
            for _ in range(cfg.concurrency):
                self._push(self.rng.uniform(0, cfg.start_jitter_s), _SPAWN, None)
        else:
            self._schedule_arrivals(cfg.arrival_rate)
            horizon *= 1 + DRAIN_X
        self._push(0.0, _TICK, None)
        next_report = 0.0
        while self.heap and self.heap[0][0] <= horizon:
            t, kind, _, payload = heapq.heappop(self.heap)
            if t > cfg.duration_s and not self.tasks_live and not self._arrivals_left:
                break  # open loop: every task that arrived is answered
            self._account_util(t)
            self.now = t
            if kind == _ENGINE:
                self._on_engine(payload)  # type: ignore[arg-type]
            elif kind == _TICK:
                self._sample_kv()
                self._policy_call(self.policy.tick(t))
                if probe is not None:
                    probe(self)
                self._push(t + self.policy.config.tick_s, _TICK, None)
            elif kind == _WAKE:
                if t == self.wake_at:  # else superseded by a later request
                    self.wake_at = None
                    self._policy_call(self.policy.tick(t))
            elif kind == _ARRIVE:
                self._on_arrive(payload)  # type: ignore[arg-type]
            elif kind == _TIMEOUT:
                self._on_gate_timeout(payload)  # type: ignore[arg-type]
            elif kind == _HOPPED:
                payload()  # type: ignore[operator]
            else:
                self._start_client(payload)  # type: ignore[arg-type]
            if progress is not None and t >= next_report:
                progress(min(1.0, t / cfg.duration_s))
                next_report = t + cfg.duration_s / 100
        open_loop = cfg.arrival_rate
        end = cfg.duration_s if open_loop is None else max(cfg.duration_s, self.now)
        self._account_util(end)
        wall = time.perf_counter() - started
        capacity = len(self.engines) * next(iter(self.engines.values())).gpu_tokens
        gpu_util = self._util_area / (end * capacity)
        stats = [e.stats for e in self.engines.values()]
        waits = [r.forwarded - r.arrival for r in self._forwarded]
        extra = {
            "gate_wait_mean_s": round(sum(waits) / len(waits), 3) if waits else 0.0,
            "running_mean": round(self._running_area / end / len(self.engines), 2),
            # the decode batch alone: SGLang's `num_running_reqs` leaves out the prefill batch
            "decoding_mean": round(self._decoding_area / end / len(self.engines), 2),
            "prefill_busy": round(sum(s["prefill_s"] for s in stats) / end, 3),
            "prefill_tokens": sum(s["prefill_tokens"] for s in stats),
            # every output token computed by the end, steps still running included (the
            # window's answered steps alone jump with one long step finishing or not)
            "engine_tok_s": round(sum(e.generated_by(end) for e in self.engines.values()) / end, 3),
            "loaded_tokens": sum(s["loaded_tokens"] for s in stats),
            "warm_loaded_tokens": sum(s["warm_loaded_tokens"] for s in stats),
            "warm_prefill_tokens": sum(s["warm_prefill_tokens"] for s in stats),
            **{f"warms_{outcome}": n for outcome, n in sorted(self.warms.items())},
            "preset": cfg.preset,
            "gpu_tokens": next(iter(self.engines.values())).gpu_tokens,
            "replicas": cfg.replicas,
            "token_scale": cfg.token_scale,
            "duration_s": end,
            **self._open_loop_stats(end),
            "seed": cfg.seed,
            "window": self.policy.config.window,
            "tick_s": self.policy.config.tick_s,
            "moves": self.moves.total(),
            # requests still held when the run ends: a starving program shows here, since
            # TTFT statistics only count answered steps
            "held_at_end": len(self.gated),
            "held_max_wait_s": round(
                max((end - r.arrival for r in self.gated.values()), default=0.0), 3
            ),
            **self._approx_stats(),
            "sim_wall_s": round(wall, 3),
        }
        return summarize(
            self.records,
            end,
            policy=cfg.policy,
            concurrency=cfg.concurrency
            if cfg.arrival_rate is None
            else round(self._tasks_area / end),
            cpu_ratio=cfg.cpu_ratio,
            gpu_util=gpu_util,
            extra=extra,
            kv_tokens_per_agent=fmean(self._kv_samples) if self._kv_samples else 0.0,
        )

    def _approx_stats(self) -> dict:
        if self.approx is None:
            return {}
        reuse = self.approx.reuse
        return {
            "approx_diff_share": round(reuse.diff_share, 4),
            "approx_recompute_share": round(reuse.recompute_share, 4),
            "approx_restore_scale": reuse.restore_scale,
            "approx_mirrored_tokens": self.approx.mirrored_tokens,
        }

    def _schedule_arrivals(self, rate: float) -> None:
        """Open loop (Tokencake §7.1): tasks arrive as a Poisson process of `rate` per
        second over `duration_s`, whatever the ones before them are doing."""
        rng = random.Random(f"arrivals-{self.config.seed}")
        t = rng.expovariate(rate)
        while t <= self.config.duration_s:
            self._push(t, _SPAWN, None)
            self._arrivals_left += 1
            t += rng.expovariate(rate)

    def _open_loop_stats(self, end: float) -> dict:
        if self.config.arrival_rate is None:
            return {}
        return {
            "arrival_rate": self.config.arrival_rate,
            "tasks_in_flight_mean": round(self._tasks_area / end, 2),
            "tasks_unfinished": self.tasks_live + self._arrivals_left,
        }

    def _sample_kv(self) -> None:
        """KV of the live agents stored on every replica (both tiers, each token once) per
        live agent."""
        if self.clients:
            stored = sum(e.tree.stored_tokens(self.clients) for e in self.engines.values())
            self._kv_samples.append(stored / len(self.clients))

    def _account_util(self, t: float) -> None:
        if t > self._util_t:
            usages = [e.usage() for e in self.engines.values()]
            self._util_area += (t - self._util_t) * sum(u["device_active_tokens"] for u in usages)
            self._running_area += (t - self._util_t) * sum(u["running"] for u in usages)
            self._decoding_area += (t - self._util_t) * sum(u["decoding"] for u in usages)
            self._tasks_area += (t - self._util_t) * self.tasks_live
            self._util_t = t

    # clients -----------------------------------------------------------------------------
    def _start_client(self, spawn: tuple[TraceProgram, str] | None) -> None:
        """Start a program instance: the next main program (None) or a given subagent
        (with its parent's pid)."""
        program, parent = spawn if spawn is not None else (self.corpus.next_main(), None)
        if spawn is None:
            self.tasks_live += 1
            self._arrivals_left -= self.config.arrival_rate is not None
        if program.graph and self._register is not None and program.app not in self.apps:
            self.apps.add(program.app)  # type: ignore[arg-type]
            self._register(program.app, program.graph)  # what the app sends: POST /v1/apps
        client = _Client(f"{program.program_id}#{self.corpus.next_instance()}", program, parent)
        owner = self.clients.get(parent) if parent is not None else None
        client.session = owner.session if owner is not None else (parent or client.pid)
        self.clients[client.pid] = client
        for child in self.corpus.subagents(program):
            if child.steps[0].after:  # starts on a hand-over, not at a nominal time
                self._start_client((child, client.pid))
            else:
                self._push(self.now + child.start_s, _SPAWN, (child, client.pid))
        self._send_when_ready(client)

    def _send_when_ready(self, client: _Client) -> None:
        """Send the client's next step now, or park it until the steps it waits for end."""
        refs = client.program.steps[client.step].after
        missing = self.handoffs.missing(client.session, refs) if refs else None
        if missing is None:
            self._on_arrive(client)
        else:
            self.handoffs.park(client.session, missing, client)

    def _on_arrive(self, client: _Client) -> None:
        step = client.program.steps[client.step]
        req = _Request(client, f"q{next(self.rids)}", self.now, step)
        again = client.first_arrival is not None  # a retry of the same step
        if not again:
            client.first_arrival = self.now
        if self._observe is not None:  # policies on the agent runtime layer (CacheSage)
            program = client.program
            self._observe(
                AgentEvent(
                    EventKind.REQUEST,
                    self.now,
                    client.pid,
                    program.agent,
                    client.session,
                    program.anchor_tokens,
                    app=program.app,
                )
            )
        round_id = f"{client.session}/{step.round}" if step.round else None
        if not again:
            client.prompt = self.blocks.advance(client.pid, client.program, step, client.session)
            if self.approx is not None:
                self.approx.arrive(client.pid, client.prompt, step.reused_tokens)
        segments = client.prompt
        self.policy.on_prompt(client.pid, segments, round_id)
        self.gated[client.pid] = req
        self._push(self.now + self.config.gate_timeout_s, _TIMEOUT, req)
        self._policy_call(self.policy.on_request(client.pid, self.now, step.input_tokens))
        self._release_gated()

    def _release_gated(self) -> None:
        """Forward every held request whose program the policy now routes; answer those
        it refuses (a start its door cannot let in before the gate's timeout)."""
        for pid in list(self.gated):
            replica = self.policy.route(pid)
            if replica is None:
                retry_after = self.policy.refusal(pid)
                if retry_after is not None:
                    self._refuse(self.gated.pop(pid), retry_after)
            else:
                req = self.gated.pop(pid)
                req.replica = replica
                req.forwarded = self.now
                self._forwarded.append(req)
                self.inflight[req.rid] = req
                self._after_hop(partial(self._submit, req))

    def _after_hop(self, then: Callable[[], None]) -> None:
        """`then` once a message crossed between the router and an engine (`hop_s`)."""
        if self.config.hop_s > 0:
            self._push(self.now + self.config.hop_s, _HOPPED, then)
        else:
            then()

    def _submit(self, req: _Request) -> None:
        """A forwarded request reaches its engine."""
        pid, replica = req.client.pid, req.replica
        st, program = req.step, req.client.program
        engine = self.engines[replica]
        prompt, reused, chain, extra_s = self._engine_terms(pid, replica, st, engine)
        engine.submit(
            req.rid,
            pid,
            prompt,
            st.output_tokens,
            self.now,
            reused_tokens=reused,
            prefix=SharedPrefix.of_program(
                program.agent,
                program.anchor_tokens,
                program.inherit_tokens,
                req.client.parent,
                chain,
            ),
            extra_prefill_s=extra_s,
        )
        self._schedule_engine(replica)

    def _engine_terms(
        self, pid: str, replica: str, step: TraceStep, engine: ReplicaEngine
    ) -> tuple[int, int, tuple[tuple[str, int], ...], float]:
        """(prompt, reused, named blocks, extra prefill s) the engine is handed: the step's
        own, or with approximate reuse modelled, its compressed terms."""
        chain = self.blocks.chain(pid)
        if self.approx is None:
            return step.input_tokens, step.reused_tokens, chain, 0.0
        prompt, reused, recompute, restored = self.approx.forward(
            pid, replica, self.blocks.current(pid), step.input_tokens, step.reused_tokens
        )
        exact = self.approx.exact_until(pid)
        extra = engine.cost.prefill_s(recompute, reused) + self.approx.restore_s(restored)
        return prompt, reused, tuple(c for c in chain if c[1] <= exact), extra

    def _policy_call(self, moves: list) -> None:
        """After every policy call: count moves, push hints, release what the moves allow."""
        self.moves.update(str(m.reason) for m in moves)
        updates = self.policy.hint_updates()
        if self.policy.sends_hints:
            for replica, hints in updates.items():
                self.engines[replica].apply_hints(hints, self.now)
                self._schedule_engine(replica)
        if self._actions is not None:
            self._run_actions(self._actions(self.now))
        if self.gated:
            self._release_gated()
        at = self._wakeup(self.now) if self._wakeup is not None else None
        if at is not None and at != self.wake_at:
            self.wake_at = at
            self._push(at, _WAKE, None)

    def _run_actions(self, actions: list) -> None:
        """Carry out the runtime layer's side effects on the simulated engines."""
        for action in actions:
            engine = self.engines.get(action.replica)
            if engine is None:
                continue
            if isinstance(action, PushScores):
                engine.apply_scores(dict(action.scores), dict(action.agents), self.now)
            elif isinstance(action, Warm):
                self.warms[engine.warm(action.agent, action.anchor_tokens, self.now)] += 1
            elif isinstance(action, PushPriorities):
                engine.apply_priorities(
                    dict(action.priorities), dict(action.agents), action.critical, self.now
                )
            self._schedule_engine(action.replica)

    # engines -----------------------------------------------------------------------------
    def _on_engine(self, name: str) -> None:
        if self.scheduled[name] != self.now:
            return  # superseded by a later reschedule
        self.scheduled[name] = None
        for ev in self.engines[name].advance(self.now):
            req = self.inflight.get(ev.rid)
            if req is None:
                continue
            if isinstance(ev, FirstToken):
                req.first_token = ev.t
                req.cached = (ev.cached_device, ev.cached_host)
            elif isinstance(ev, Done):
                self._on_done(req, ev)
        self._schedule_engine(name)

    def _on_done(self, req: _Request, ev: Done) -> None:
        del self.inflight[req.rid]
        self._after_hop(partial(self._answered, req, ev))

    def _answered(self, req: _Request, ev: Done) -> None:
        """A finished step reaches its client and the router, times as they see them (a
        hop after the engine's)."""
        st, client, hop = req.step, req.client, self.config.hop_s
        first = (req.first_token if req.first_token is not None else ev.t) + hop
        if ev.ok:
            self.policy.observe_step(
                req.replica, st.input_tokens, *req.cached, first - req.forwarded,
                st.output_tokens, ev.t + hop - first,
            )  # fmt: skip
            if hop > 0:  # the engine's part, as the live shell's worker times it beside it
                self.policy.observe_round_trip(client.pid, self.now, ev.t - req.forwarded - hop)
        self._record(req, first, ev.t + hop, ev.ok)
        usage = st.input_tokens + st.output_tokens if ev.ok else None
        self._policy_call(self.policy.on_response(client.pid, self.now, usage))
        self._next_step(client)

    def _record(self, req: _Request, first_token: float, finish: float, ok: bool) -> None:
        """The step as its client saw it (the attempt that was served, or the last one)."""
        st, client = req.step, req.client
        self.records.append(
            StepRecord(
                program_id=client.pid,
                replica=req.replica,
                arrival_s=req.arrival,
                first_token_s=first_token,
                finish_s=finish,
                input_tokens=st.input_tokens,
                output_tokens=st.output_tokens if ok else 0,
                cached_device=req.cached[0],
                cached_host=req.cached[1],
                ok=ok,
                session=client.session,
                agent=client.program.agent,
                last=client.step + 1 == len(client.program.steps),
                round=f"{client.session}/{st.round}" if st.round else None,
                first=client.step == 0,
                first_arrival_s=client.first_arrival,
                retries=client.retries,
                refusals=client.refusals,
            )
        )
        client.first_arrival, client.retries, client.refusals = None, 0, 0

    def _refuse(self, req: _Request, retry_after: float) -> None:
        """The door refused a start: the client comes back when told (no retry limit)."""
        client = req.client
        self.policy.cancel(client.pid, self.now)  # moves nobody (a pass over the gate runs)
        client.refusals += 1
        self._push(self.now + retry_after, _ARRIVE, client)

    def _on_gate_timeout(self, req: _Request) -> None:
        """The live gate answers a request held `gate_timeout_s` with 503; the client
        retries as the SDKs do, and the step fails once they give up."""
        client = req.client
        if self.gated.get(client.pid) is not req:
            return  # forwarded, refused or retried since
        del self.gated[client.pid]
        self._policy_call(self.policy.cancel(client.pid, self.now))
        delay = self.retries.delay_s(client.retries, GATE_RETRY_AFTER_S, self._retry_rng)
        if delay is not None:
            client.retries += 1
            self._push(self.now + delay, _ARRIVE, client)
            return
        self._record(req, self.now, self.now, ok=False)
        self._next_step(client)

    def _next_step(self, client: _Client) -> None:
        """After a step ended (answered or failed): hand-overs, then the tool call and the
        next step, or the program's end."""
        st, program = client.program.steps[client.step], client.program
        for waiter in self.handoffs.finish(client.session, program.program_id, client.step):
            self._send_when_ready(waiter)
        client.step += 1
        if client.step < len(program.steps):
            tool = st.tool or "unknown"
            self._policy_call(self.policy.on_tool_start(client.pid, self.now, tool, program.agent))
            if program.steps[client.step].after:
                self._send_when_ready(client)
            else:
                self._push(self.now + st.tool_s, _ARRIVE, client)
            return
        self._policy_call(self.policy.end(client.pid, self.now))
        self.clients.pop(client.pid, None)
        self.blocks.forget(client.pid)
        if self.approx is not None:
            self.approx.forget(client.pid)
        if client.session == client.pid:
            self.handoffs.end(client.session)
        if client.program.parent_id is None:
            self.tasks_live -= 1
            if self.config.arrival_rate is None:
                self._start_client(None)  # closed loop: the slot takes the next program


def simulate(corpus: list[TraceProgram], config: SimConfig, progress=None, probe=None) -> RunResult:
    """Run one cell (see `Simulation`)."""
    return Simulation(corpus, config).run(progress, probe)
