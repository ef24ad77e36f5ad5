"""One SGLang replica as a pure cost model: KV cache tiers, eviction, batching, timing.

Used twice: the discrete-event simulator (`router.sim.simulator`, virtual clock) and the
HTTP replica emulator (`router.sim.emulator`, wall clock). Both drive it the same way; the
engine never reads a clock, every call passes `now` (seconds, non-decreasing):

    engine = ReplicaEngine(preset, EngineMode("typed", True), gpu_tokens, host_tokens)
    engine.submit(rid, program_id, input_tokens, output_tokens, now,
                  reused_tokens=None, prefix=SharedPrefix(8000, anchor="main"))
    t = engine.next_event_time()       # when to call advance next (None: nothing scheduled)
    for ev in engine.advance(now):     # FirstToken(rid, t, cached_device, cached_host)
        ...                            # Done(rid, t, ok)
    engine.generated(rid, now)         # tokens decoded so far (streaming)
    engine.abort(rid, now)             # client gone
    engine.apply_hints({pid: Hint.IDLE}, now, full=False) -> {pid: (device, host)}
    engine.apply_scores({"Planner": 0.9}, {pid: "Planner"}, now)   # CacheSage survival
    engine.apply_priorities({pid: 30.0}, {pid: "app/Coder"}, frozenset({"app/Coder"}), now)
    engine.warm("Planner", 1400, now)  # warm an anchor between steps (load back or prefill)
    engine.residency(pid) -> (device_tokens, host_tokens)
    engine.usage() -> dict             # capacities, used tokens, running / queued counts

Every mutating call first runs the engine up to `now`; events produced on the way are kept
and returned by the next `advance`, so none is lost whatever the calling order.

Cache model (`router.sim.kv_tree`): a radix tree of token segments shared across the
programs of the replica. A program's context is a path from the root; its last context
(prompt + output) is the prefix of its next prompt up to `reused_tokens`, and a program
without a cached path starts from a `SharedPrefix`: its agent role's anchor (system prompt +
tools, stored once for every program of the role) or the first tokens of its parent's
context (a forked subagent). Each node holds a prefix of its tokens on device and a prefix
on host (HiCache write-through: every finished request's context is backed up to host). A
request hits the device prefix of its path, then host tokens beyond that (loaded over
PCIe), and recomputes the rest (prefill). Eviction is leaf-first, taking tokens off the
end of a segment. As in HiRadixCache, the host only evicts host-only tokens (their device
copy is gone); a backup of tokens still on device is kept, so a full host refuses (the rest
of) a write-through, and device tokens without a backup are dropped when evicted (backup is
retried when the program's next request leaves the batch, as SGLang retries it on the next
insert through the node). A prompt that leaves the program's previous context early drops
the stale tail at once (SGLang keeps it as an evictable branch no one reuses).

- `lru` (stock SGLang): least recently used first on both tiers; hints are ignored.
- `typed` (MORI patch): both tiers evict inactive, then idle, then busy (a shared segment
  takes its users' most protective type), then segments of no critical agent type before
  those of one (the space scheduler's `critical` types), then by CacheSage survival score
  (anchors only, when the router pushes scores), then LRU. Hints act at once: `idle` drops
  the device copy of the program's own segments if they are backed up (a device-only suffix
  or a shared segment pins them, as in the patch), `busy` loads host tokens back to device
  ahead of the next request (costing PCIe time; into free room only, all or nothing, as
  the patch does: what does not fit loads with the request; a batch's offloads go
  first, so a swap's load-back finds the room just freed), `inactive` only ranks the
  program first to go.
  Busy-typed requests are admitted before others, by the space scheduler's program
  priority when it pushes one (higher first).

Warm-up (CacheSage prefetch): `warm` brings an anchor to device ahead of its role's next
request, never at a waiting request's expense: not while a request is queued, and making
room only from segments that eviction would take before the anchor itself. A host copy is
loaded back over PCIe; with none, the anchor is prefilled once the engine has nothing to
admit. Tokens a warm-up or a busy hint loaded ahead count as device hits when a request
finds them, as SGLang reports them (its device/host split is taken when the request is
matched; host hits are what the request itself loads back).

Timing: prefill batches stall decode (SGLang runs prefill and decode batches in turn, no
mixed chunks by default). A prefill batch's prompts run in forwards of the preset's
`chunk_tokens` (SGLang's chunked prefill: a prompt may start in one forward and go on in
the next), each forward costing `prefill_overhead_s` on top of its tokens' compute
(`CostModel`), and an abort takes effect at the end of the current chunk: a client
that leaves during a long prompt's prefill frees the engine within a chunk, not when the
whole prompt is computed. A prefill batch lasts max(compute of the new tokens, the PCIe
loads of its host hits), since HiCache loads layer by layer under the compute, plus the
preset's `load_serial` share of the shorter where they take turns (on CPU). Decode is
continuous batching; one iteration costs weights + KV read from HBM (grows with batch and
total context) plus a fixed overhead. Between events the batch is constant, so a run of k
iterations is timed in closed form (arithmetic series) instead of one event per token.

Admission: a request enters the batch when its whole context (prompt + output) fits on
device next to the running requests' reserved contexts, evicting unlocked cache as needed;
otherwise it waits in the engine queue (head-of-line, as SGLang's PrefillAdder stops at the
first request that does not fit). A request larger than the whole device fails at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from router.policy.types import EngineMode, Hint, freeing_first
from router.presets import Preset
from router.sim.kv_tree import RANK, KVTree, Node, SharedPrefix

__all__ = ["CostModel", "Done", "FirstToken", "ReplicaEngine", "SharedPrefix"]


@dataclass(frozen=True, slots=True)
class FirstToken:
    """Prefill finished: the first output token exists. Cached tokens are prompt tokens."""

    rid: str
    t: float
    cached_device: int
    cached_host: int


@dataclass(frozen=True, slots=True)
class Done:
    rid: str
    t: float
    ok: bool = True


EngineEvent = FirstToken | Done


class CostModel:
    """Seconds for prefill, one decode iteration and a host->device copy, from a preset.

    Prefill is priced per token through the weights and per (query, key) pair of causal
    attention, chunk by chunk of `chunk_tokens` as SGLang's chunked prefill runs it (each
    chunk attends to everything before it), plus `prefill_overhead_s` per forward. An engine
    whose extend kernel recomputes the cached prefix's own attention (`prefix_attention`)
    pays for that in every chunk: on it, a cache hit saves the prefix's linear layers but not
    its attention."""

    def __init__(self, preset: Preset) -> None:
        m = preset.model
        self.preset = preset
        self.chunk = preset.chunk_tokens
        self._token_s = 2 * m.active_params / preset.flops_s  # one token through the weights
        # one (query, key) pair of attention
        self._pair_s = 4 * m.layers * m.q_heads * m.head_dim / (preset.flops_s * preset.attn_eff)
        self._kv_s = preset.kv_bytes_per_token / preset.kv_read_bytes_s  # read a token's KV
        self._load_s = preset.kv_bytes_per_token / preset.pcie_bytes_s
        self._dense = m.active_params == m.total_params

    def attention_pairs(self, new_tokens: int, prefix_tokens: int, offset: int = 0) -> float:
        """Attention pairs of computing `new_tokens` on `prefix_tokens`, the first chunk
        starting `offset` tokens into a forward (a batch's prompts share its chunks)."""
        pairs, done = 0.0, 0
        room = self.chunk - offset % self.chunk
        rho = self.preset.prefix_attention
        while done < new_tokens:
            n = min(room, new_tokens - done)
            q = prefix_tokens + done
            pairs += n * (q + n / 2) + rho * q * q / 2
            done, room = done + n, self.chunk
        return pairs

    def prefill_s(self, new_tokens: int, prefix_tokens: int, offset: int = 0) -> float:
        """Compute `new_tokens` of prompt on top of `prefix_tokens` already in KV (the
        forwards' fixed overhead is `forwards_s`, once per batch)."""
        if new_tokens <= 0:
            return 0.0
        pairs = self.attention_pairs(new_tokens, prefix_tokens, offset)
        return self._token_s * new_tokens + self._pair_s * pairs

    def forwards_s(self, batch_new_tokens: int) -> float:
        """The fixed cost of the forwards a prefill batch of this many new tokens takes."""
        return self.preset.prefill_overhead_s * max(1, -(-batch_new_tokens // self.chunk))

    def batch_s(self, compute_s: float, load_s: float) -> float:
        """A prefill batch's span: its compute and the host loads it waits for overlap,
        up to the preset's `load_serial` share of the shorter of the two."""
        return max(compute_s, load_s) + self.preset.load_serial * min(compute_s, load_s)

    def weights_read_s(self, batch: int) -> float:
        """Dense models read all weights per iteration; an MoE reads the experts its batch
        routes to (bounded by all of them; assumes distinct experts per token)."""
        m = self.preset.model
        params = m.total_params if self._dense else min(m.total_params, m.active_params * batch)
        return params * m.dtype_bytes / self.preset.bytes_s

    def step_coeffs(self, batch: int) -> tuple[float, float]:
        """Iteration time = a + b x total_context: (a, b) for a batch of `batch` requests."""
        p = self.preset
        linear = max(self.weights_read_s(batch), batch * self._token_s)
        return linear + p.step_overhead_s + batch * p.seq_overhead_s, self._kv_s

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        a, b = self.step_coeffs(batch)
        return a + b * context_tokens

    def load_s(self, tokens: int) -> float:
        """Host DRAM -> HBM over PCIe."""
        return tokens * self._load_s


@dataclass(slots=True)
class _Request:
    rid: str
    program_id: str
    input_tokens: int
    output_tokens: int
    arrival: float
    reused_limit: int | None
    prefix: SharedPrefix | None = None
    generated: int = 0
    dev_hit: int = 0  # prefix found on device at admission
    host_hit: int = 0  # prefix loaded from host at admission
    aborted: bool = False
    prefill_at: float = 0.0  # when its prompt's compute starts in its prefill batch
    prefill_s: float = 0.0  # ... and how long it lasts
    offset: int = 0  # where its new tokens start in the batch's token stream (its chunks)
    path: list[Node] = field(default_factory=list)  # its context's nodes, locked on device
    extra_s: float = 0.0  # prefill time beyond its new tokens (approximate reuse's work)


@dataclass(slots=True)
class _Decode:
    """A run of `n` decode iterations with a constant batch, starting at `start`."""

    start: float
    n: int
    a: float
    b: float
    context: int  # total context of the batch at the first iteration
    batch: int

    def elapsed(self, k: int) -> float:
        """Time of the first k iterations; context grows by `batch` per iteration."""
        return k * (self.a + self.b * self.context) + self.b * self.batch * k * (k - 1) / 2

    def done_by(self, t: float) -> int:
        """Iterations finished by time t (0..n)."""
        dt = t - self.start
        if dt <= 0:
            return 0
        qa, qb = self.b * self.batch / 2, self.a + self.b * self.context - self.b * self.batch / 2
        k = int(dt / qb) if qa == 0 else int((-qb + math.sqrt(qb * qb + 4 * qa * dt)) / (2 * qa))
        k = max(0, min(self.n, k))
        while k < self.n and self.elapsed(k + 1) <= dt:
            k += 1
        while k > 0 and self.elapsed(k) > dt:
            k -= 1
        return k

    @property
    def end(self) -> float:
        return self.start + self.elapsed(self.n)


@dataclass(slots=True)
class _Prefill:
    end: float
    batch: list[_Request] = field(default_factory=list)
    warm: Node | None = None  # a warm-up prefill of an anchor (no request)
    ready: float = 0.0  # when the PCIe loads of its host hits are done
    start: float = 0.0  # when the batch began (its end: CostModel.batch_s after this)


class ReplicaEngine:
    """One replica. Pure: no clock, no I/O; see the module docstring for the protocol."""

    def __init__(self, preset: Preset, mode: EngineMode, gpu_tokens: int, host_tokens: int):
        if mode.eviction not in ("lru", "typed"):
            raise ValueError(f"unknown eviction {mode.eviction!r}; use 'lru' or 'typed'")
        self.cost = CostModel(preset)
        self.mode = mode
        self.gpu_tokens = int(gpu_tokens)
        self.host_tokens = int(host_tokens) if mode.host_tier else 0
        self._typed = mode.eviction == "typed"
        self.tree = KVTree(self.gpu_tokens, self.host_tokens, self._typed)
        self._requests: dict[str, _Request] = {}
        self._queue: list[_Request] = []
        self._running: list[_Request] = []
        self._warm: list[tuple[str, int]] = []  # anchors to prefill once nothing else can run
        self._priority: dict[str, float] = {}  # program -> space-scheduler priority
        self._phase: _Prefill | _Decode | None = None
        self._t = 0.0  # engine clock: where the current phase starts or the last one ended
        self._events: list[EngineEvent] = []
        self._pcie_free_at = 0.0
        self.stats = {
            "prefill_s": 0.0,
            "decode_s": 0.0,
            "prefill_tokens": 0,
            "loaded_tokens": 0,
            "warm_loaded_tokens": 0,
            "warm_prefill_tokens": 0,
            "admitted": 0,  # requests that left the engine's queue for a batch ...
            "queue_wait_s": 0.0,  # ... and the seconds they spent in it, summed
            "generated_tokens": 0,  # output tokens computed (a prefill's first, each decode)
        }

    # protocol ---------------------------------------------------------------------------
    def submit(
        self,
        rid: str,
        program_id: str,
        input_tokens: int,
        output_tokens: int,
        now: float,
        reused_tokens: int | None = None,
        prefix: SharedPrefix | None = None,
        extra_prefill_s: float = 0.0,
    ) -> None:
        """Queue a request. `reused_tokens` (optional) caps the prefix of the program's own
        cached context it may reuse, for traces whose prompt shares less than the whole
        previous context; `prefix` says what it shares with other programs when it has no
        cached context of its own (see `SharedPrefix`); `extra_prefill_s` is prefill work
        beyond its new tokens (the simulator's model of approximate reuse, router.sim.approx)."""
        if rid in self._requests:
            raise ValueError(f"request {rid!r} already submitted")
        self._run(now)
        req = _Request(
            rid, program_id, int(input_tokens), int(output_tokens), now, reused_tokens, prefix
        )
        req.extra_s = extra_prefill_s
        self._requests[rid] = req
        if req.input_tokens + req.output_tokens > self.gpu_tokens:
            self._finish(req, now, ok=False)
            return
        self._queue.append(req)
        self._interrupt(now)  # SGLang's scheduler looks at its waiting queue every iteration
        self._kick(now)

    def advance(self, now: float) -> list[EngineEvent]:
        """Run the engine up to `now`; events in time order (including buffered ones)."""
        self._run(now)
        out, self._events = self._events, []
        return out

    def next_event_time(self) -> float | None:
        """When the current prefill or decode run ends (an event may or may not follow)."""
        if self._events:
            return self._t
        if self._phase is not None:
            return self._phase.end
        return None

    def generated(self, rid: str, now: float | None = None) -> int:
        """Output tokens produced so far (first token included)."""
        req = self._requests.get(rid)
        if req is None:
            return 0
        if now is not None and isinstance(self._phase, _Decode) and req in self._running:
            return req.generated + self._phase.done_by(now)
        return req.generated

    def abort(self, rid: str, now: float) -> None:
        """Drop a request (client gone). Like SGLang, a request in the batch leaves at the
        next iteration boundary; what it computed stays cached, unlocked."""
        self._run(now)
        req = self._requests.pop(rid, None)
        if req is None:
            return
        if req in self._queue:
            self._queue.remove(req)
        else:
            req.aborted = True
            self._cut_prefill(req, now)
            self._interrupt(now)

    def apply_hints(
        self, hints: dict[str, Hint], now: float, full: bool = False
    ) -> dict[str, tuple[int, int]]:
        """Type programs (typed mode acts on them; lru mode only records residency)."""
        self._run(now)
        if self._typed:
            if full:
                for pid in [p for p in self.tree.entries if p not in hints]:
                    self.tree.set_hint(pid, Hint.INACTIVE)
            for pid, hint in freeing_first(hints):
                self._apply_hint(pid, hint, now)
            self._interrupt(now)
            self._kick(now)
        return {pid: self.residency(pid) for pid in hints}

    def apply_scores(
        self, scores: dict[str, float], agents: dict[str, str] | None, now: float
    ) -> None:
        """CacheSage: survival scores per agent role (they replace the previous ones) and
        the role of programs the router identified. Only typed eviction orders by them."""
        self._run(now)
        self.tree.scores = {a: min(1.0, max(0.0, float(s))) for a, s in scores.items()}
        for pid, agent in (agents or {}).items():
            self.tree.set_agent(pid, agent)

    def apply_priorities(
        self,
        priorities: dict[str, float],
        agents: dict[str, str],
        critical: frozenset[str] | None,
        now: float,
    ) -> None:
        """Space scheduler: programs' priorities (busy requests are admitted highest
        first), their agent types, and the critical types (None: unchanged), whose KV
        typed eviction takes last within a type."""
        self._run(now)
        self._priority.update(priorities)
        for pid, agent in agents.items():
            self.tree.set_agent(pid, agent)
        if critical is not None:
            self.tree.critical = frozenset(critical)

    def warm(self, anchor: str, tokens: int, now: float) -> str:
        """Bring anchor `(anchor, tokens)` to device ahead of its next use (module
        docstring). Answers what happened: resident, loaded, queued (a prefill once the
        engine is free), busy (a request waits: not now) or no_room."""
        self._run(now)
        node = self.tree.anchors.get((anchor, tokens))
        if node is not None and node.dev >= node.length:
            return "resident"
        if self._queue or not 0 < tokens <= self.gpu_tokens:
            return "busy"
        if node is not None and self.mode.host_tier and node.host > node.dev:
            parts = self.tree.host_extra([node])
            loaded = sum(n for _, n in parts)
            if not self._room(loaded, node, anchor, now):
                return "no_room"
            self._pcie_free_at = max(self._pcie_free_at, now) + self.cost.load_s(loaded)
            self.tree.load(parts, self._pcie_free_at)
            self.stats["loaded_tokens"] += loaded
            self.stats["warm_loaded_tokens"] += loaded
            return "loaded"
        if (anchor, tokens) not in self._warm:
            self._warm.append((anchor, tokens))
            self._interrupt(now)
            self._kick(now)
        return "queued"

    def residency(self, program_id: str) -> tuple[int, int]:
        return self.tree.residency(program_id)

    def generated_by(self, now: float) -> int:
        """Output tokens computed by `now`, those of requests still decoding included: what
        an engine's own forward log counts, whichever steps are answered by then."""
        phase = self._phase
        if isinstance(phase, _Decode) and phase.start < now:
            return self.stats["generated_tokens"] + phase.done_by(now) * phase.batch
        return self.stats["generated_tokens"]

    def usage(self) -> dict:
        """Capacities and occupancy now; `stats` holds cumulative busy times and tokens."""
        return {
            "device_capacity_tokens": self.gpu_tokens,
            "host_capacity_tokens": self.host_tokens,
            "device_used_tokens": self.tree.dev_used,
            "host_used_tokens": self.tree.host_used,
            "device_active_tokens": self.tree.locked_tokens,
            "running": len(self._running) + (len(self._phase.batch) if self._prefilling else 0),
            "decoding": len(self._running),  # what SGLang's num_running_reqs gauge counts
            "queued": len(self._queue),
        }

    def programs(self) -> dict[str, dict]:
        """Residency and hint of every program with KV here (for /mori/residency);
        `hinted`: a router named the program (its hint is not just the default)."""
        out = {}
        for pid, e in self.tree.entries.items():
            dev, host = self.tree.residency(pid)
            out[pid] = {
                "hint": e.hint.value,
                "hinted": e.hinted,
                "device_tokens": dev,
                "host_tokens": host,
            }
        return out

    # engine loop ------------------------------------------------------------------------
    @property
    def _prefilling(self) -> bool:
        return isinstance(self._phase, _Prefill)

    def _run(self, now: float) -> None:
        """Finish every phase that ends by `now`, starting the next one each time."""
        while self._phase is not None and self._phase.end <= now:
            if isinstance(self._phase, _Prefill):
                self._end_prefill(self._phase)
            else:
                self._end_decode(self._phase)
            self._phase = None
            self._kick(self._t)

    def _kick(self, now: float) -> None:
        """Idle engine: start a prefill batch if anything fits, else a warm-up prefill if
        nothing waits, else a decode run."""
        if self._phase is not None:
            return
        self._t = max(self._t, now)
        batch = self._admit(self._t)
        if batch:
            compute_end, ready = self._prefill_end(batch, self._t)
            end = self._batch_end(self._t, compute_end, ready)
            self._phase = _Prefill(end, batch, ready=ready, start=self._t)
            self.stats["prefill_s"] += self._phase.end - self._t
        elif self._warm and not self._queue and self._start_warm(self._t):
            return
        elif self._running:
            batch_n = len(self._running)
            a, b = self.cost.step_coeffs(batch_n)
            context = sum(r.input_tokens + r.generated for r in self._running)
            n = min(r.output_tokens - r.generated for r in self._running)
            self._phase = _Decode(self._t, n, a, b, context, batch_n)

    def _interrupt(self, now: float) -> None:
        """Something changed (arrival, freed memory): end the decode run at the iteration
        boundary after `now` so the scheduler looks again, as SGLang does every iteration."""
        if isinstance(self._phase, _Decode):
            k = min(self._phase.n, self._phase.done_by(now) + 1)
            if k < self._phase.n:
                self._phase.n = k

    def _cut_prefill(self, req: _Request, now: float) -> None:
        """An aborted request of the prefill batch stops at the end of its current chunk:
        its remaining chunks are not computed, and the batch's later prompts move up."""
        phase = self._phase
        if not isinstance(phase, _Prefill) or req not in phase.batch or req.prefill_s <= 0:
            return
        prefix = req.dev_hit + req.host_hit
        new_tokens, begun = req.input_tokens - prefix, now - req.prefill_at
        # the chunks begun by `now` (a chunk attends to all before it), after the extra work
        # of approximate reuse, which runs first and whole
        done_s, done, chunk = req.extra_s, 0, self.cost.chunk
        while done_s < begun and done < new_tokens:
            at = req.offset + done
            piece = min(chunk - at % chunk, new_tokens - done)
            done_s += self.cost.prefill_s(piece, prefix + done, at)
            done += piece
        saved = req.prefill_s - done_s
        if saved <= 1e-12:
            return
        for other in phase.batch:
            if other.prefill_at > req.prefill_at:
                other.prefill_at -= saved
        req.prefill_s -= saved
        compute_end = max(r.prefill_at + r.prefill_s for r in phase.batch)
        end = self._batch_end(phase.start, compute_end, phase.ready)
        self.stats["prefill_s"] -= phase.end - end
        phase.end = end

    def _end_prefill(self, phase: _Prefill) -> None:
        self._t = phase.end
        if phase.warm is not None:
            node = phase.warm
            self.tree.unhold(node)
            node.last_use = phase.end
            if self.mode.host_tier:
                self.tree.write_through([node])
        for req in phase.batch:
            if req.aborted:
                self._release(req, req.dev_hit + req.host_hit, phase.end)
                continue
            self._events.append(FirstToken(req.rid, phase.end, req.dev_hit, req.host_hit))
            req.generated = min(1, req.output_tokens)
            self.stats["generated_tokens"] += req.generated
            if req.generated >= req.output_tokens:
                self._finish(req, phase.end)
            else:
                self._running.append(req)

    def _end_decode(self, phase: _Decode) -> None:
        self.stats["decode_s"] += phase.end - self._t
        self.stats["generated_tokens"] += phase.n * phase.batch
        self._t = phase.end
        still = []
        for req in self._running:
            req.generated += phase.n
            if req.aborted:
                self._release(req, req.input_tokens + req.generated, phase.end)
            elif req.generated >= req.output_tokens:
                self._finish(req, phase.end)
            else:
                still.append(req)
        self._running = still

    def _finish(self, req: _Request, t: float, ok: bool = True) -> None:
        if ok:
            self._release(req, req.input_tokens + req.output_tokens, t)
        self._requests.pop(req.rid, None)
        self._events.append(Done(req.rid, t, ok))

    # admission and prefill timing -------------------------------------------------------------
    def _order(self) -> list[_Request]:
        if not self._typed:
            return self._queue
        hint, priority = self.tree.hint, self._priority
        busy = [r for r in self._queue if hint(r.program_id) is Hint.BUSY]
        if priority:
            busy.sort(key=lambda r: -priority.get(r.program_id, 0.0))
        return busy + [r for r in self._queue if hint(r.program_id) is not Hint.BUSY]

    def _admit(self, now: float) -> list[_Request]:
        batch = []
        for req in self._order():
            e = self.tree.entries.get(req.program_id)
            if e is not None and e.running is not None:
                continue  # one request per program at a time; the next waits its turn
            if not self._reserve(req, now):
                break
            batch.append(req)
        for req in batch:
            self._queue.remove(req)
            self.stats["admitted"] += 1
            self.stats["queue_wait_s"] += now - req.arrival
        return batch

    def _reserve(self, req: _Request, now: float) -> bool:
        """Lock the request's whole context on device, evicting cache if needed."""
        tree, pid = self.tree, req.program_id
        limit = req.input_tokens if req.reused_limit is None else req.reused_limit
        m = tree.match(pid, limit, req.input_tokens, req.prefix, self.mode.host_tier)
        need = req.input_tokens + req.output_tokens - m.dev
        room = self.gpu_tokens - tree.dev_used + m.reclaim
        if need > room:
            e = tree.entries.get(pid)
            keep = set(m.base) | set(e.path if e else ())
            if not tree.evict_device(need - room, keep):
                return False
        total = req.input_tokens + req.output_tokens
        req.path = tree.admit(pid, m, total, req.rid, now)
        req.dev_hit, req.host_hit = m.dev, m.host
        return True

    def _prefill_end(self, batch: list[_Request], now: float) -> tuple[float, float]:
        """When the compute of the new tokens ends (the forwards' overhead, then prompt
        after prompt, sharing chunks) and when the PCIe loads of host hits are done."""
        new = [req.input_tokens - req.dev_hit - req.host_hit for req in batch]
        compute = self.cost.forwards_s(sum(new))
        ready, offset = now, 0
        for req, n in zip(batch, new, strict=True):
            prefix = req.dev_hit + req.host_hit
            req.prefill_at, req.offset = now + compute, offset
            req.prefill_s = self.cost.prefill_s(n, prefix, offset) + req.extra_s
            offset += n
            compute += req.prefill_s
            self.stats["prefill_tokens"] += req.input_tokens - prefix
            self.stats["loaded_tokens"] += req.host_hit
            ready = max(ready, max(n.ready_at for n in req.path))
            if req.host_hit:
                self._pcie_free_at = max(self._pcie_free_at, now) + self.cost.load_s(req.host_hit)
                ready = max(ready, self._pcie_free_at)
        return now + compute, ready

    def _batch_end(self, start: float, compute_end: float, ready: float) -> float:
        """A prefill batch's end: its compute and the loads it waits for, as the preset
        overlaps them."""
        return start + self.cost.batch_s(compute_end - start, max(0.0, ready - start))

    def _release(self, req: _Request, context: int, now: float) -> None:
        """The request left the batch: unlock its program's KV and back it up to host."""
        e = self.tree.entries.get(req.program_id)
        if e is None or e.running != req.rid:
            return
        self.tree.release(req.program_id, context, now)
        if self.mode.host_tier:
            self.tree.write_through(e.path)
        if e.hint is Hint.IDLE and self._typed:
            self.tree.offload(e.path, req.program_id)  # idle hint arrived while it ran

    # hints and warm-ups ----------------------------------------------------------------------
    def _apply_hint(self, pid: str, hint: Hint, now: float) -> None:
        if hint is Hint.INACTIVE:
            self._priority.pop(pid, None)
        if pid not in self.tree.entries and hint is Hint.INACTIVE:
            return
        e = self.tree.set_hint(pid, hint)
        if e.running is not None:
            return  # applied when the request leaves the batch (see _release)
        if hint is Hint.INACTIVE and not e.path:
            del self.tree.entries[pid]  # nothing cached, nothing to rank: forget it
        elif hint is Hint.IDLE and self.mode.host_tier:
            self.tree.offload(e.path, pid)
        elif hint is Hint.BUSY and self.mode.host_tier:
            self._load_back(e.path, now)

    def _load_back(self, path: list[Node], now: float) -> None:
        """Prefetch host tokens to device into free room only, all or nothing, as the patch
        loads back (`engine_patches`: `HiRadixCache.load_back` of the deepest host-only node
        with its evicted ancestors, within the free rows beyond the running requests'
        reserve; it never evicts): what does not fit loads with the request."""
        parts = self.tree.host_extra(path)
        tokens = sum(n for _, n in parts)
        if not tokens or tokens > self.gpu_tokens - self.tree.dev_used:
            return
        self._pcie_free_at = max(self._pcie_free_at, now) + self.cost.load_s(tokens)
        self.stats["loaded_tokens"] += tokens
        self.tree.load(parts, self._pcie_free_at)

    def _room(self, tokens: int, node: Node | None, anchor: str, now: float) -> bool:
        """Free `tokens` device tokens for a warm-up, only from segments eviction would take
        before the anchor itself (its type, its score, used now)."""
        free = self.gpu_tokens - self.tree.dev_used
        if tokens <= free:
            return True
        tree = self.tree
        rank = tree.rank(node) if node is not None else RANK[Hint.INACTIVE]
        mine = (rank, tree.scores.get(anchor, 0.0), now) if self._typed else (now,)
        keep = {node} if node is not None else set()
        return tree.evict_device(tokens - free, keep, allowed=lambda n: tree.victim_key(n) < mine)

    def _start_warm(self, now: float) -> bool:
        """Prefill the next queued anchor warm-up (False: none could start)."""
        while self._warm:
            anchor, tokens = self._warm.pop(0)
            node = self.tree.anchors.get((anchor, tokens))
            cached = node.dev if node is not None else 0
            if cached >= tokens or not self._room(tokens - cached, node, anchor, now):
                continue
            node = self.tree.anchor_node(anchor, tokens)
            self.tree.fill(node)
            self.tree.hold(node)
            work = self.cost.prefill_s(tokens - cached, cached)
            end = now + self.cost.forwards_s(tokens - cached) + work
            self.stats["prefill_s"] += end - now
            self.stats["warm_prefill_tokens"] += tokens - cached
            self._phase = _Prefill(end, warm=node)
            return True
        return False
